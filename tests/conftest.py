import os

import pytest
import torch

import cpu_budget

# Traced chain profiles are not read from or written to the user's cache while testing: a test that
# patches the tracing path must not leave its figures behind (tests/test_measure_chain_cache.py opts in).
os.environ["MEMFIT_NO_CACHE"] = "1"


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="also run tests marked slow")
    cpu_budget.add_options(parser)


def pytest_configure(config):
    cpu_budget.configure(config)


# Files whose default-tier tests trace the same model shapes: under scripts/test.sh (--dist loadgroup)
# each such file's default-tier tests run on one worker, where memfit's in-process trace cache
# (measure/blocks.py) lets the later tests reuse the first one's chain profiles. Slow tests stay
# ungrouped, so that two workers share the slow grids.
SHARED_TRACES = ("test_plan_", "test_measure_", "test_profile_cache")


def _shares_a_fixture(item) -> bool:
    """The test uses a module- or class-scoped fixture (e.g. one run of the ranks whose results several
    tests assert on): grouped with its file's other tests, the fixture is made on one worker, not on each."""
    info = getattr(item, "_fixtureinfo", None)
    return info is not None and any(d.scope in ("module", "class") for defs in info.name2fixturedefs.values()
                                    for d in defs)


def _join_group(item, config, group: str) -> None:
    """Put the test in xdist group `group`. --dist loadgroup reads a test's group from the "@group" end of
    its node id, which pytest-xdist writes to item._nodeid; pytest 9 keeps the id in item._id (a NodeId)
    and ignores that, which left every group split over both workers. There the end is written here."""
    item.add_marker(pytest.mark.xdist_group(group))
    if not getattr(config.option, "loadgroup", False):  # set on xdist's workers under --dist loadgroup
        return
    try:
        from _pytest.nodeid import NodeId
    except ImportError:  # pytest 8: xdist's own hook writes item._nodeid, which its nodeid reads
        return
    if isinstance(getattr(item, "_id", None), NodeId) and "@" not in item.nodeid:
        item._id = NodeId.parse(f"{item.nodeid}@{group}")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        name = item.path.name
        if (name.startswith(SHARED_TRACES) or _shares_a_fixture(item)) and "slow" not in item.keywords:
            _join_group(item, config, item.path.stem)
    skip_slow = pytest.mark.skip(reason="slow: run with --runslow")
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "slow" in item.keywords and not config.getoption("--runslow"):
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
    if config.getoption("--runslow"):
        # The slow tests (one to four minutes each) first, the default tier's short ones after: the
        # workers (scripts/test.sh: --dist loadgroup hands out tests in this order) then end on short tests
        # together, rather than one worker running a four-minute grid while the other waits. A stable
        # sort: every worker collects the same order, as xdist requires.
        items.sort(key=lambda item: "slow" not in item.keywords)


@pytest.fixture(autouse=True)
def _seed_and_one_thread():
    # Tests use tiny models, which gain nothing from a second thread; on a busy 2-core machine an
    # OpenMP barrier waiting for a descheduled thread makes each op hundreds of times slower.
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
