"""The real CUDA kernels, run on the CPU through a host emulation of the CUDA execution model.

tests/cuda_emu/build.sh compiles csrc/cuda/{gemv_inner_q,gemv_kivi,gemv_lattice,quantize,aqua_reconstruct,
decode_attention}.cu with g++
(AddressSanitizer + UBSan) after rewriting their launches (tests/cuda_emu/emu.h: one thread per CUDA thread,
barriers for __syncthreads and shuffles). driver.cpp runs the launchers (planning, split-K, workspace, T chunks,
vector-load selection) on random data with odd shapes and strided views, against a double-precision reference. This
is how CPU CI checks the kernels' index math and synchronisation; tests/test_cuda_kernels.py checks them on a GPU.
"""

import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EMU = ROOT / "tests" / "cuda_emu"
CUDA_INCLUDE = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include"
SOURCES = [
    EMU / "emu.h",
    EMU / "driver.cpp",
    EMU / "prep.sh",
    EMU / "build.sh",
    *sorted((ROOT / "csrc").rglob("*.[ch]*")),
]

pytestmark = [
    pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found"),
    pytest.mark.skipif(shutil.which("perl") is None, reason="perl not found (tests/cuda_emu/prep.sh needs it)"),
    pytest.mark.skipif(not (CUDA_INCLUDE / "cuda_fp16.h").exists(), reason=f"CUDA headers not found in {CUDA_INCLUDE}"),
]


@pytest.fixture(scope="module")
def driver() -> Path:
    # build once per source state: build/cuda_emu/<hash of every input>/drv (build/ is git-ignored)
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES)).hexdigest()[:16]
    out = ROOT / "build" / "cuda_emu" / digest
    drv = out / "drv"
    if not drv.exists():
        proc = subprocess.run(["bash", str(EMU / "build.sh"), str(out)], capture_output=True, text=True)
        assert proc.returncode == 0, f"emulation build failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return drv


@pytest.mark.parametrize(
    "which",
    ["decode", "iq", "kivi", "q", "lattice", "aqua", "attn", "append"],
    ids=[
        "mma_decoders",
        "gemv_inner_q",
        "gemv_kivi",
        "quantize_groups_into",
        "gemv_lattice",
        "aqua_reconstruct",
        "decode_attention_fused",
        "static_append",
    ],  # fmt: skip
)
def test_cuda_kernel_under_emulation(driver, which):
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=0", UBSAN_OPTIONS="print_stacktrace=1")
    env.pop("KVKERNELS_ATTENTION_PREFETCH", None)  # the kernels' defaults (the prefetch count is checked below)
    proc = subprocess.run([str(driver), which], capture_output=True, text=True, timeout=600, env=env)
    log = proc.stdout + proc.stderr
    summary = re.search(
        r"cases (\d+) fails (\d+) shuffles_after_exit (\d+) bad_mask (\d+) bad_async_copies (\d+) prefetches (\d+)", log
    )
    assert summary, f"no summary line (crash or sanitizer report?):\n{log[-6000:]}"
    cases, fails, late_shuffles, bad_masks, bad_copies, prefetches = map(int, summary.groups())
    assert cases > 0
    if which == "decode_attention_fused":  # the store tiles' L2 prefetches ran, each address checked by ASan
        assert prefetches > 0, log[-6000:]
    # bad_copies: cp.async with a misaligned address or an invalid size, a fault on the GPU (tests/cuda_emu/emu.h)
    assert (fails, late_shuffles, bad_masks, bad_copies) == (0, 0, 0, 0), log[-6000:]
    assert proc.returncode == 0 and "runtime error" not in log and "ERROR: AddressSanitizer" not in log, log[-6000:]
