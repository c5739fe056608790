"""A traced step does not import torch._dynamo, gives the same bytes as with it, and leaves torch usable."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from memfit.measure.trace import trace_step
    from memfit.models.spec import parse_model

    spec = parse_model("gpt:layers=2,hidden=32,heads=2,vocab=64,seq=16")
    lazy = [trace_step(spec, 2, 16, checkpoint=c).peak for c in ("none", "full", "selective")]
    assert "torch._dynamo" not in sys.modules, "the trace imported torch._dynamo"
    import torch.utils.checkpoint as tc
    assert not hasattr(tc._run_fn_with_dynamo_disabled.__wrapped__, "__dynamo_disable")  # handed back
    import torch._dynamo  # the real package now: the trace runs with it, as before
    eager = [trace_step(spec, 2, 16, checkpoint=c).peak for c in ("none", "full", "selective")]
    assert lazy == eager, (lazy, eager)
    assert torch._dynamo.utils is sys.modules["torch._dynamo.utils"]
    f = torch.compile(lambda x: (x * 2).sin(), backend="eager")
    assert torch.equal(f(torch.ones(3)), (torch.ones(3) * 2).sin())
    print("ok", lazy)
""")


def test_trace_without_dynamo_equals_trace_with_it_and_compile_still_works():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "MEMFIT_NO_CACHE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ok")
