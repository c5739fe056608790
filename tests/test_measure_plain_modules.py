"""Two plain nn.Modules written here, a CNN and an MLP-mixer: memfit.estimate(model, example) against the
allocator's events on a real step, within 3%, with and without full checkpointing."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import memfit
from memfit.measure.anymodel_estimate import measure_module


class CNN(nn.Module):
    """A small ResNet-like classifier: conv-BN-ReLU stages with residual blocks."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.blocks = nn.ModuleList(self._block(16) for _ in range(3))
        self.head = nn.Linear(16, classes)

    @staticmethod
    def _block(c: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1),
                             nn.BatchNorm2d(c))

    def forward(self, images, labels):
        x = self.stem(images)
        for block in self.blocks:
            x = torch.relu(x + block(x))
        return nn.functional.cross_entropy(self.head(x.mean(dim=(2, 3))), labels)


class MixerBlock(nn.Module):
    def __init__(self, patches: int, dim: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.tokens = nn.Sequential(nn.Linear(patches, 2 * patches), nn.GELU(), nn.Linear(2 * patches, patches))
        self.channels = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.tokens(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channels(self.norm2(x))


class Mixer(nn.Module):
    """MLP-Mixer (Tolstikhin et al. 2021): patch embedding, token- and channel-mixing MLPs."""

    def __init__(self, image: int = 32, patch: int = 4, dim: int = 64, depth: int = 4, classes: int = 10):
        super().__init__()
        self.embed = nn.Conv2d(3, dim, patch, stride=patch)
        self.blocks = nn.ModuleList(MixerBlock((image // patch) ** 2, dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, images, labels):
        x = self.embed(images).flatten(2).transpose(1, 2)
        for block in self.blocks:
            x = block(x)
        return nn.functional.cross_entropy(self.head(self.norm(x).mean(dim=1)), labels)


def batch(device):
    return torch.randn(16, 3, 32, 32, device=device), torch.randint(0, 10, (16,), device=device)


@pytest.mark.parametrize("model", [CNN, Mixer])
@pytest.mark.parametrize("checkpoint", ["none", "full"])
def test_plain_module_within_3pct_of_the_allocator(model, checkpoint):
    est = memfit.estimate(model, batch, checkpoint=checkpoint)
    real = measure_module(model, batch, checkpoint=checkpoint)
    assert est.total >= real["peak"]  # the tracker's storages, plus the convolutions' workspaces it cannot see
    assert abs(est.total - real["allocator"]) <= 0.03 * real["allocator"], (est.total, real["allocator"])
    assert est.per_device["activations"] > 0


def test_checkpointing_lowers_the_plain_modules_activations():
    for model in (CNN, Mixer):
        plain = memfit.estimate(model, batch).per_device["activations"]
        assert memfit.estimate(model, batch, checkpoint="full").per_device["activations"] < plain
