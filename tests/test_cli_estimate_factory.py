"""`memfit estimate MODULE:FUNCTION --input ...`: any nn.Module from the command line, and one-line errors."""
from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch

import memfit
from memfit.cli import main

MODELS = textwrap.dedent('''
    import torch
    import torch.nn as nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.head = nn.Linear(8, 10)

        def forward(self, pixel_values, labels):
            x = torch.relu(self.conv(pixel_values)).mean(dim=(2, 3))
            return nn.functional.cross_entropy(self.head(x), labels)

    class Logits(Net):
        def forward(self, pixel_values, labels=None):
            return self.head(torch.relu(self.conv(pixel_values)).mean(dim=(2, 3)))

    def build():
        return Net()

    def logits():
        return Logits()

    def loss(output, inputs):
        return nn.functional.cross_entropy(output, inputs["labels"])

    NOT_CALLABLE = 3
    ''')
INPUTS = ["--input", "pixel_values=float32[4,3,16,16]", "--input", "labels=int64[4]"]


@pytest.fixture
def factory_pkg(tmp_path, monkeypatch):
    pkg = tmp_path / "my_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "models.py").write_text(MODELS)
    (pkg / "broken.py").write_text("raise RuntimeError('no GPU driver found\\nsecond line')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_pkg"
    for name in [m for m in sys.modules if m.startswith("my_pkg")]:
        del sys.modules[name]


def test_factory_estimate_equals_the_python_api(factory_pkg, capsys):
    assert main(["estimate", "my_pkg.models:build", *INPUTS, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    from my_pkg.models import build

    est = memfit.estimate(build, {"pixel_values": torch.empty(4, 3, 16, 16),
                                  "labels": torch.empty(4, dtype=torch.long)})
    assert data["per_device"] == est.per_device and data["model"] == "my_pkg.models:build"
    assert data["per_device"]["activations"] > 0 and data["n_params"] == 3 * 8 * 9 + 8 + 8 * 10 + 10
    # --loss: a model that returns logits
    assert main(["estimate", "my_pkg.models:logits", *INPUTS, "--loss", "my_pkg.models:loss", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["per_device"]["total"] > 0


def test_factory_table_output(factory_pkg, capsys):
    assert main(["estimate", "my_pkg.models:build", *INPUTS]) == 0
    out = capsys.readouterr().out
    assert "my_pkg.models:build" in out and "total (peak)" in out and "batch None" not in out


@pytest.mark.parametrize("argv,needle", [
    (["no_such_pkg.models:build", *INPUTS], "cannot import the model factory no_such_pkg.models:build"),
    (["my_pkg.broken:build", *INPUTS], "RuntimeError: no GPU driver found"),
    (["my_pkg.models:nothing", *INPUTS], "has no attribute 'nothing'"),
    (["my_pkg.models:NOT_CALLABLE", *INPUTS], "not a callable"),
    (["my_pkg.models:build"], "needs its example batch"),
    (["my_pkg.models:build", "--input", "pixel_values=float32(4,3)"], "malformed --input"),
    (["my_pkg.models:build", "--input", "pixel_values=floaty[4,3]"], "unknown dtype 'floaty'"),
    (["my_pkg.models:build", "--input", "x=float32[4,-3]"], "must be positive"),
    (["my_pkg.models:build", "--input", "x=float32[4,a]"], "must be integers"),
    (["my_pkg.models:build", "--input", "x=float32[4,0]"], "must be positive"),
    (["my_pkg.models:build", "--input", "x=float32[4]", "--input", "int64[4]"], "not a mix"),
    (["my_pkg.models:build", "--input", "pixel_values=float32[4,5,16,16]", "--input", "labels=int64[4]"],
     "the model's forward failed on the example: RuntimeError:"),
    (["my_pkg.models:logits", *INPUTS], "cannot find a scalar loss"),
    (["gpt2", "--input", "x=int64[4]"], "for a model factory"),
])
def test_factory_errors_one_line_exit_2(factory_pkg, argv, needle, capsys):
    code = main(["estimate", *argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and needle in lines[0], err
