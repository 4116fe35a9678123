"""bench/triton_budget.py, the static roofline of the Triton GEMVs, on one launch: it must record the wrapper's launch,
compile it to a cubin (no GPU), find the steady-state loop in the SASS and count it.

Skipped where this triton build has no NVIDIA backend (as tests/test_triton_compile.py) or no cuobjdump.
"""

import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from triton_helpers import NVIDIA_MARK

pytest.importorskip("triton", reason="triton is not installed")
# the tool compiles: it must import triton with the interpreter off. Under TRITON_INTERPRET=1 (make test, CI) the
# tests below run in a pytest subprocess without it (test_in_a_compiling_process).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

ROOT = Path(__file__).resolve().parents[1]


pytestmark = NVIDIA_MARK


def test_in_a_compiling_process():
    if not INTERPRETED:
        pytest.skip("not interpreted: the tests below run in this process")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "2 passed" in r.stdout, r.stdout[-2000:]  # not skipped there


@pytest.fixture(scope="module")
def tb():
    if INTERPRETED:
        pytest.skip("run by test_in_a_compiling_process, without TRITON_INTERPRET=1")
    spec = importlib.util.spec_from_file_location("triton_budget", ROOT / "bench" / "triton_budget.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["triton_budget"] = mod
    spec.loader.exec_module(mod)
    if not mod.cc.cuobjdump_path():
        pytest.skip("no cuobjdump")
    return mod


def test_records_every_config_of_a_preset(tb):
    launches = [ln for ln in tb.record(4) if ln.preset == "kivi2"]
    gemvs = {ln.gemv for ln in launches}
    assert gemvs == {"scores", "output"}
    gemv_kivi = importlib.import_module("kvkernels.triton_kernels.gemv_kivi")  # the module (the package exports the op)

    # every autotune config the pruning keeps at 8 query rows is a launch of its own, with the config's tile and warps
    out = [ln for ln in launches if ln.gemv == "output"]
    kept = gemv_kivi._prune(gemv_kivi._CONFIGS, {"QP": 8})
    assert len(out) == len(kept) == len(gemv_kivi._CONFIGS) - 1  # the 16-row config serves 64 query rows only
    assert {ln.constexprs["BLOCK_R"] for ln in out} == {c.kwargs["BLOCK_R"] for c in kept}
    assert [c.kwargs["BLOCK_R"] for c in gemv_kivi._prune(gemv_kivi._CONFIGS, {"QP": 64})] == [16]
    assert all(ln.constexprs["BITS"] == 2 and ln.constexprs["QP"] == 8 for ln in out)


def test_one_launch_parses_a_loop(tb):
    ln = next(ln for ln in tb.record(4) if ln.preset == "innerq_asym4" and ln.gemv == "output")
    row = tb.analyse(ln, 90)
    c = row.m["counts"]
    assert row.regs > 0 and row.spill == 0
    # the default tile of the value GEMV at head_dim 128: 128 rows x 2 sub-chunks of L stacked into 256 MMA rows on a
    # warpgroup (wgmma; 2 whole rows a thread)
    assert (ln.constexprs["BLOCK_M"], row.warps, ln.constexprs["M_CAP"]) == (256, 4, 128)
    # the loop of the tensor-core kernel: its MMAs (expected_mma counts them, so a loop read as unrolled would be
    # caught), code loads, the x-sums' shuffles only, no local memory
    assert row.m["mma"] == tb.expected_mma(ln.kernel, ln.constexprs, row.warps, 90) > 0 and row.unroll == 1
    # an iteration is VALS = 64 values of L: one stacked chunk of 2 x 32 (one group each), its x-sums (the zero term)
    assert ln.constexprs["VALS"] == 64 and ln.constexprs["BK"] == 32 and tb.inner_q_stack(ln.constexprs) == 2
    # (triton 3.9, CI's: 16 shuffles; 3.6, the GPU machines': 20, the same loop laid out with 4 more)
    import triton

    shfl_bound = 2 * 8 if tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 9) else 2 * 8 + 8
    assert row.m["shfl"] <= shfl_bound and row.m["local_memory_in_loop"] == 0
    assert 20 < c["issue"] < 4000
    # bytes of one iteration: 256 tile rows x 32 values x 4 bits + fp16 scale and zero per tile row (one group each)
    nbytes, tile = tb.tile_bytes("_gemv_inner_q_kernel", {**ln.constexprs})
    assert nbytes == ln.constexprs["BLOCK_M"] * (32 * 4 / 8 + 4 * 1) and tile == "128 rows x 64 values"
    assert row.m["instr_per_byte"] == pytest.approx(c["issue"] * 32 * row.warps / nbytes)
