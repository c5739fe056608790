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


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        name = item.path.name
        if name.startswith(SHARED_TRACES) and "slow" not in item.keywords:
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
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
