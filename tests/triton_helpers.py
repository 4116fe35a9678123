"""What the Triton test files (test_triton.py, test_triton_lattice.py) share: where the kernels run, the skip that
applies when they cannot, and the placement of inputs as strided views.

The kernels run on CPU under TRITON_INTERPRET=1 (how CI tests them) or on a CUDA GPU; a test module applies
`pytestmark = TRITON_MARK`.
"""

import os
import zlib

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TRITON_MARK = pytest.mark.skipif(
    not INTERPRET and not torch.cuda.is_available(),
    reason="Triton kernels need a CUDA GPU, or TRITON_INTERPRET=1 to run on CPU",
)
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"

if INTERPRET or torch.cuda.is_available():
    import kvkernels.triton_kernels as tk
    from kvkernels.triton_kernels._common import interpreter_problem

    if DEVICE == "cpu" and interpreter_problem():  # .ci/run fails instead: CI must not lose these tests to a skip
        TRITON_MARK = pytest.mark.skip(reason=interpreter_problem())
else:
    tk = None  # the kernels cannot run here: TRITON_MARK skips every test that would use them

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def has_nvidia_backend() -> bool:
    """Whether this triton build can compile for NVIDIA GPUs (the AOT compile check and the roofline need it)."""
    try:
        from triton.backends import backends

        return "nvidia" in backends
    except ImportError:
        return False


NVIDIA_MARK = pytest.mark.skipif(not has_nvidia_backend(), reason="this triton build has no NVIDIA backend")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def seed_for(name: str) -> int:
    return zlib.crc32(name.encode())  # fixed per test id (hash() of a str changes between runs)


def strided(t: torch.Tensor, seed: int) -> torch.Tensor:
    """t as a narrowed view of a larger preallocated buffer full of garbage (NaN / random words): every dim gets a
    margin on both sides (the last keeps stride 1), so reads or writes outside the view corrupt the result."""
    big = [s + 3 for s in t.shape[:-1]] + [t.shape[-1] + 5]
    if t.dtype.is_floating_point:
        buf = torch.full(big, float("nan"), dtype=t.dtype)
    else:
        buf = torch.randint(-(2**31), 2**31 - 1, big, generator=gen(seed), dtype=torch.int64).to(t.dtype)
    view = buf.to(DEVICE)[tuple(slice(1, 1 + s) for s in t.shape[:-1]) + (slice(2, 2 + t.shape[-1]),)]
    view.copy_(t)
    return view


def place(t: torch.Tensor, as_strided: bool, seed: int) -> torch.Tensor:
    """t on DEVICE: a strided view (see strided) or a plain contiguous copy."""
    return strided(t, seed) if as_strided else t.to(DEVICE)
