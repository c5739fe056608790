"""The one device check: names torch reads, cpu/cuda only, cuda only where there is CUDA."""
import pytest
import torch

from memfit.core.device import resolve_device
from memfit.core.errors import ConfigError


def test_accepted_and_refused_device_names():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    assert resolve_device(None) == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ConfigError, match="unknown device 'gpu0'; accepted: cpu, cuda, cuda:N"):
        resolve_device("gpu0")
    with pytest.raises(ConfigError, match="unsupported device 'meta'"):
        resolve_device("meta")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_cuda_without_cuda_is_a_config_error():
    with pytest.raises(ConfigError, match="needs a CUDA build of PyTorch with a GPU; use cpu"):
        resolve_device("cuda:0")
