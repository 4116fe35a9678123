import os
import re

import pytest
import torch

import kvkernels

HAS_CUDA = torch.cuda.is_available()
TRITON_CPU = os.environ.get("TRITON_INTERPRET") == "1"


def devices():
    return ["cpu"] + (["cuda"] if HAS_CUDA else [])


@pytest.fixture(params=devices())
def device(request):
    return request.param


requires_c = pytest.mark.skipif(not kvkernels.backends()["cpp"] == "available", reason="kvkernels._C not built")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # the tests use tiny tensors: intra-op threads only add contention on a shared 2-core CI machine
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def slow_requested(config) -> bool:
    """Whether slow tests run: `pytest -m slow` (a mark expression naming slow, not negated) or KVKERNELS_SLOW=1."""
    return os.environ.get("KVKERNELS_SLOW") == "1" or bool(
        re.search(r"(?<!not )\bslow\b", config.getoption("markexpr", "") or "")
    )


def exercises_gpu(item) -> bool:
    """Whether a test runs a GPU path where one exists: a cuda parametrization, a skip-without-CUDA marker, or a
    Triton test file (compiled kernels on a GPU, the interpreter on CPU). A heuristic for ordering only."""
    if "cuda" in item.nodeid.lower() or item.path.name.startswith("test_triton"):
        return True
    for mark in item.iter_markers("skipif"):
        reason = str(mark.kwargs.get("reason", "")).lower()
        if "cuda" in reason or "gpu" in reason:
            return True
    return False


def pytest_collection_modifyitems(config, items):
    # KVKERNELS_TESTS_GPU_FIRST=1 (bench/gpu_verify.sh): the tests that exercise a GPU run first, in their usual
    # order, then the rest. A GPU session's test stage has a time cap, and what CPU CI already runs is what may be cut
    # (the first GPU run's stage ran ~2000 tests in its 180 s, in file order). xdist hands tests out in this order.
    if os.environ.get("KVKERNELS_TESTS_GPU_FIRST") == "1":
        items.sort(key=lambda item: not exercises_gpu(item))  # stable: file order within each part
    # tests marked slow (real-model runs, the bigger Lloyd grids) stay out of `make test` unless asked for
    if slow_requested(config):
        return
    skip = pytest.mark.skip(reason="slow: run with `pytest -m slow` or KVKERNELS_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """KVKERNELS_FAILURE_LOG=path: append each failure's traceback to path as it happens. bench/gpu_verify.sh sets it:
    a test stage cut at its cap never prints pytest's failure section, and the first GPU run lost every traceback
    that way. Written by the controlling process only (xdist workers forward their reports to it)."""
    path = os.environ.get("KVKERNELS_FAILURE_LOG")
    if not path or not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    with open(path, "a") as f:
        f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n\n")
