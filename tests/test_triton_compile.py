"""Every Triton kernel variant the wrappers launch compiles to a cubin for sm_80 and sm_90 without spills.

The Triton tests run the kernels through TRITON_INTERPRET=1, which never invokes the compiler; this runs
tests/triton_aot/compile_check.py (TTIR -> PTX -> cubin with Triton's bundled ptxas, no GPU needed) so code that
only the interpreter accepts fails in CPU CI rather than on the first GPU. A self-test first shows that the check
reports a compile error and a register spill.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from triton_helpers import NVIDIA_MARK

triton = pytest.importorskip("triton", reason="triton is not installed")

SCRIPT = Path(__file__).resolve().parent / "triton_aot" / "compile_check.py"


pytestmark = NVIDIA_MARK


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9 warns when unset; 1 is its (and 3.6's) default
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--targets", "80,90", *args], env=env, capture_output=True, text=True
    )


def test_check_reports_planted_faults():
    res = _run("--self-test")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "arange's range must be a power of 2" in res.stdout
    assert "register spills" in res.stdout


def test_every_launched_variant_compiles_for_sm80_and_sm90(tmp_path):
    res = _run("--json", str(tmp_path / "variants.json"))
    failures = [line for line in res.stdout.splitlines() if line.startswith("FAIL")]
    assert res.returncode == 0 and not failures, "\n".join(failures) or (res.stdout + res.stderr)[-4000:]
    # the sweep must cover all four kernels and every bit width, or it checks less than it claims
    for name in ("_gemv_inner_q_kernel", "_gemv_kivi_kernel", "_quantize_kernel", "_dequantize_kernel"):
        for bits in (1, 2, 3, 4):
            assert f"{name} BITS={bits} " in res.stdout, f"{name} with {bits} bits was not compiled"
    for bits in (1, 2, 3, 4):  # decode_attention_fused: keys and values at every bit width
        for which in ("KBITS", "VBITS"):
            assert f"_attention_split_kernel {which}={bits} " in res.stdout or (
                which == "VBITS" and f" VBITS={bits} " in res.stdout
            ), f"_attention_split_kernel with {which}={bits} was not compiled"
    assert "_merge_kernel " in res.stdout
