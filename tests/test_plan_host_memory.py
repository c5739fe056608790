"""Host memory per node is a planning constraint (memfit.plan.host_memory): `host_memory=` /
`--host-memory`, a stated default, reported in the plan, and a plan that needs more host memory is not
chosen (refused in one line when nothing else fits). Also: the planner's progress bar, and its traced
parts cached on disk (a second process does not trace them again)."""
import contextlib
import io
from dataclasses import replace

import pytest
import torch

import memfit
from memfit.cli import main
from memfit.plan.cluster_fit import plan_cluster
from memfit.plan.costs import PlanError
from memfit.plan.host_memory import DEFAULT_NODE_HOST, machine_ram

SPEC = "llama:layers=4,hidden=128,heads=4,kv_heads=2,ffn=256,vocab=256,seq=64"
MiB = 2**20


ALLOW = "recompute,optimizer-offload"  # no accumulation: nothing else fits 8 MiB


@pytest.fixture(scope="module")
def gpu_plan():
    """The one-GPU plan of SPEC, made with the progress bar on: (the plan, what it wrote on stderr). One
    search serves the host-memory test and the progress bar's (each traced a model of its own before)."""
    from memfit.core import progress

    err = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stderr(err):
        mp.setenv("MEMFIT_PROGRESS", "1")
        mp.setattr(progress, "DELAY_S", 0.0)
        plan = memfit.fit(SPEC, budget="8MiB", batch=4, seq=64, device="cuda", verify=False, allow=ALLOW)
    return plan, err.getvalue()


def test_one_gpu_plan_reports_the_offloaded_state_as_host_memory_and_respects_a_smaller_host(gpu_plan):
    allow = ALLOW
    plan = gpu_plan[0]
    assert plan.offload_optimizer == "cpu"  # the budget needs it (the control for the refusal below)
    local = torch.cuda.is_available()  # planned for a GPU elsewhere: a GPU's share of a DGX node
    assert plan.host_memory == (machine_ram() if local else DEFAULT_NODE_HOST // 8)
    assert ("this machine's RAM" if local else "2 TiB / 8") in plan.summary()
    assert plan.host_need > 0 and "host memory:" in plan.summary()
    with pytest.raises(PlanError, match="host memory") as err:
        memfit.fit(SPEC, budget="8MiB", batch=4, seq=64, device="cuda", verify=False, allow=allow,
                   host_memory=plan.host_need - 1)
    assert "\n" not in str(err.value)


def test_on_a_cpu_device_the_whole_step_counts_against_host_memory():
    # One technique is enough (the whole set took 13 CPU-s): what is checked is how the chosen plan's
    # host memory is counted, which does not depend on how many kinds the search tried.
    plan = memfit.fit(SPEC, budget="64MiB", batch=4, seq=64, device="cpu", allow="recompute")
    assert plan.host_need >= plan.measured_peak  # one RAM: the device peak is host memory too
    with pytest.raises(PlanError, match="host memory"):
        memfit.fit(SPEC, budget="64MiB", batch=4, seq=64, device="cpu", allow="recompute", host_memory="1MiB")


def test_cluster_plan_holds_each_node_to_its_host_memory():
    cp = plan_cluster(SPEC, "6MiB", 2, batch=8, verify=False)
    assert cp.lay.offload_optimizer == "cpu" and cp.host_memory == DEFAULT_NODE_HOST
    assert 0 < cp.host_need <= cp.host_memory and "host memory per node" in cp.summary()
    with pytest.raises(PlanError, match="host memory per node") as err:
        plan_cluster(SPEC, "6MiB", 2, batch=8, verify=False, host_memory=cp.host_need - 1)
    assert "\n" not in str(err.value)


def test_cli_host_memory_bad_value_is_one_line_exit_2(capsys):
    assert main(["plan", SPEC, "--budget", "8MiB", "--host-memory", "lots"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "lots" in err


def test_progress_bar_on_stderr_counts_traces(gpu_plan):
    err = gpu_plan[1]
    assert "planning" in err and "trace" in err


def test_disk_profile_round_trips_through_its_json():
    from memfit.measure.blocks import chain_profile, spec_source
    from memfit.models.spec import parse_model
    from memfit.plan.costs import _bases
    from memfit.plan.disk_profile import _from_json, _to_json, disk_bases, trace_disk

    src = spec_source(parse_model("gpt:layers=3,hidden=32,heads=2,vocab=64,seq=16"), 2, 16)
    # One disk kind (a kept block's saved tensors) fills every field of the profile (forward, backward
    # pairs, the ends, restore); the file holds each kind alike, so recompute's would only add tracing.
    allow = ("offload-disk",)
    base = chain_profile(src, "32-true", "adamw", bases=_bases(allow))
    dp = trace_disk(src, base, disk_bases(allow), "32-true", "adamw")
    assert all(_to_json(dp).values())  # nothing empty: every field goes through the file
    back = _from_json(_to_json(dp), base)
    assert back == replace(dp, seconds=0.0)  # every traced stretch, key and byte count, through the file and back


@pytest.mark.slow  # 6-9 CPU-s; the default tier's host-memory tests above cover the limit and the report
def test_a_full_trace_over_the_host_memory_is_solved_again_within_it(monkeypatch):
    """The composed host need can miss what the trace holds (docs/planner.md, host memory): a trace over
    the host memory tightens the composed figure by the miss and solves again (here away from the
    offloaded activations), as a trace over the device budget lowers the device bound; a need no plan
    can lower ends in one line that names it."""
    from memfit.plan import trace_check

    tiny, kw = "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=16", dict(batch=2, seq=16, device="cpu")
    allow = "recompute,offload-cpu"  # on a CPU device host offload is only planned when named
    plan = memfit.fit(tiny, budget="505KiB", allow=allow, **kw)
    assert any(a.offload == "cpu" for a in plan.actions)  # the control: without a host limit it offloads
    real, extra = trace_check.traced, 64 * 1024

    def holds_more(problem, p):  # each offloaded block holds 64 KiB more host memory than composed
        peak, host = real(problem, p)
        return peak, host + extra * sum(a.offload == "cpu" for a in p.actions)

    monkeypatch.setattr(trace_check, "traced", holds_more)
    limit = plan.host_need + extra // 2  # the composed need fits; the trace's does not
    again = memfit.fit(tiny, budget="505KiB", allow=allow, host_memory=f"{limit}B", **kw)
    assert not any(a.offload == "cpu" for a in again.actions) and again.measured_peak <= again.budget
    assert again.host_need <= limit and any("of host memory" in n and "solved again" in n for n in again.notes)
    monkeypatch.setattr(trace_check, "traced", lambda problem, p: (real(problem, p)[0], 1 << 40))
    with pytest.raises(PlanError, match="1.00 TiB of host memory") as err:
        memfit.fit(tiny, budget="505KiB", allow=allow, host_memory=f"{limit}B", **kw)
    assert "\n" not in str(err.value)
