"""Every Triton kernel variant the wrappers launch compiles to a cubin for sm_80 and sm_90 without spills.

The Triton tests run the kernels through TRITON_INTERPRET=1, which never invokes the compiler; this runs
tests/triton_aot/compile_check.py (TTIR -> PTX -> cubin with Triton's bundled ptxas, no GPU needed) so code that
only the interpreter accepts fails in CPU CI rather than on the first GPU. A self-test first shows that the check
reports a compile error and a register spill. CI compiles a subset of the launches that covers every combination of
three parameter values (a fault that needs four to meet can slip through); `pytest -m slow` compiles every launch.
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


def _check_sweep(*args: str) -> None:
    res = _run(*args)
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


def test_launches_covering_every_3_way_parameter_combination_compile_for_sm80_and_sm90():
    # 235 of the 520 launches (compile_check.covering): 491 s, cold Triton cache, 2 cores; all: ~1100 s
    _check_sweep("--cover", "3")


@pytest.mark.slow
def test_every_launched_variant_compiles_for_sm80_and_sm90():
    _check_sweep()


COVER_PROBE = """
import itertools, sys
sys.path.insert(0, sys.argv[1])
from compile_check import covering
grid = itertools.product((0, 1), repeat=3)
jobs = [{"key": ("k", (("A", a), ("B", b), ("C", c)), ("*fp16",), (), ())} for a, b, c in grid]
jobs += [{"key": ("other", (("A", 0),), ("*fp16",), (), ())}]
for n in (1, 2, 3):
    chosen = covering(jobs, n)
    mine = [dict(j["key"][1]) for j in chosen if j["key"][0] == "k"]
    pairs = {(p, q, m[p], m[q]) for m in mine for p in "ABC" for q in "ABC" if p < q}
    print(n, len(mine), len(pairs), sum(j["key"][0] == "other" for j in chosen))
"""


def test_covering_subset_holds_every_combination_of_the_asked_strength():
    # jobs: every combination of three binary parameters; a 1-way cover needs 2 of them, a 2-way cover all 12 value
    # pairs in fewer than 8 (4 suffice), a 3-way cover all 8; a kernel with one launch keeps it
    res = subprocess.run(
        [sys.executable, "-c", COVER_PROBE, str(SCRIPT.parent)],
        env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [tuple(map(int, line.split())) for line in res.stdout.splitlines()]
    assert rows[0][:2] == (1, 2) and rows[0][3] == 1
    assert rows[1][0] == 2 and 4 <= rows[1][1] < 8 and rows[1][2] == 12 and rows[1][3] == 1
    assert rows[2][:3] == (3, 8, 12) and rows[2][3] == 1
