"""Which backends this install has: the compiled extension, its CUDA kernels, Triton, and the reference."""

import importlib
import os

import torch

_C = None
_C_ERROR: str | None = None
try:  # the compiled extension holds every op schema; without it only kvkernels.reference works
    _C = importlib.import_module("kvkernels._C")
except ImportError as e:  # pragma: no cover - exercised only on broken installs
    _C_ERROR = str(e)

HAS_C = _C is not None


def _has_cuda_kernel(op: str) -> bool:
    return HAS_C and torch._C._dispatch_has_kernel_for_dispatch_key(f"kvkernels::{op}", "CUDA")


# Read before kvkernels.ops registers Triton or reference kernels for CUDA, so this is the compiled build.
HAS_CUDA_KERNELS = _has_cuda_kernel("gemv_inner_q")

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def backends() -> dict[str, str]:
    """Each backend and whether it can run here, with the reason when it cannot.

    reference: pure PyTorch, always there (CPU fallback, the spec).
    cpp:       the compiled kvkernels._C (op schemas + C++ CPU storage ops).
    cuda:      compiled CUDA kernels, needs a CUDA build of the extension and a visible GPU.
    triton:    Triton kernels on a GPU, or on CPU under TRITON_INTERPRET=1 (how CI tests them).
    """
    out = {"reference": "available"}
    out["cpp"] = "available" if HAS_C else f"missing: kvkernels._C failed to import ({_C_ERROR})"
    if not HAS_CUDA_KERNELS:
        out["cuda"] = "missing: extension built without CUDA kernels (needs a CUDA torch and CUDA_HOME)"
    elif not torch.cuda.is_available():
        out["cuda"] = "built, but no CUDA device is visible"
    else:
        out["cuda"] = "available"
    if not HAS_TRITON:
        out["triton"] = "missing: pip install triton"
    elif torch.cuda.is_available():
        out["triton"] = "available"
    elif TRITON_INTERPRET:
        from kvkernels.triton_kernels._common import interpreter_problem

        problem = interpreter_problem()
        out["triton"] = f"unusable: {problem}" if problem else "available (CPU interpreter, TRITON_INTERPRET=1)"
    else:
        out["triton"] = "installed, no GPU: set TRITON_INTERPRET=1 to run it on CPU"
    return out


def require_c(op: str) -> None:
    if not HAS_C:
        raise RuntimeError(
            f"kvkernels.{op}: the compiled extension kvkernels._C is not importable ({_C_ERROR}); "
            "rebuild with `pip install --no-build-isolation -e .`, or call kvkernels.reference."
            f"{op} directly"
        )
