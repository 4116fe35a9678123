import os

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
