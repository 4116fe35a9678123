"""bench/gpu_verify.sh on this CPU machine (VERIFY_SKIP_BUILD: the dry run): its logic must fail loudly, never
silently, before a GPU session spends device minutes on it. The GPU-only stages report that they cannot run here;
the test stage is pointed at one small test file."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_verify.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="bash not found")


def _run(tmp_path, **env) -> tuple[subprocess.CompletedProcess, str]:
    full = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    full.update(VERIFY_SKIP_BUILD="1", PYTHON=sys.executable, VERIFY_COMMIT="abc1234", **env)
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(SCRIPT), str(out)], env=full, capture_output=True, text=True, timeout=300)
    summary = (out / "summary.txt").read_text() if (out / "summary.txt").exists() else ""
    return proc, summary


def test_dry_run_reports_every_selected_stage(tmp_path):
    proc, summary = _run(
        tmp_path, VERIFY_STAGES="tests,memcheck,racecheck,generate", VERIFY_TESTS="tests/test_format_kivi.py"
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "commit abc1234" in summary and "stages tests,memcheck,racecheck,generate" in summary
    assert "tests (" in summary and " passed" in summary
    assert "pytest: " in summary and " 0 failed" in summary  # read back from the junit file
    for tool in ("memcheck", "racecheck", "synccheck"):  # no compute-sanitizer here: said, not silently dropped
        assert f"{tool}: skipped (compute-sanitizer not found)" in summary or f"{tool} (" in summary
    assert "generate_step (" in summary  # ran and failed (no GPU), reported with its exit status
    assert "demo --device" not in summary and "bench (" not in summary  # not selected
    files = sorted(p.name for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert len(files) <= 8 and "summary.txt" in files and "extra.tar.gz" in files, files


def test_a_test_stage_cut_at_its_cap_still_counts(tmp_path):
    # VERIFY_BUDGET_S leaves the test stage its 5-second floor: pytest is killed, the per-test lines are counted
    proc, summary = _run(
        tmp_path,
        VERIFY_STAGES="tests",
        VERIFY_TESTS="tests/test_fused_attention.py tests/test_static_cache.py",  # ~20 s
        VERIFY_BUDGET_S="228",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "TIMED OUT" in summary and "PARTIAL (cut at the cap): " in summary, summary
    assert "pytest: no junit xml" in summary


def test_gpu_tests_are_collected_first(tmp_path):
    """KVKERNELS_TESTS_GPU_FIRST=1 (the test stage sets it): the tests that exercise a GPU come first, each part in
    file order, nothing dropped; without it the order is pytest's."""

    def collected(first: bool) -> list[str]:
        env = {k: v for k, v in os.environ.items() if k != "KVKERNELS_TESTS_GPU_FIRST"}
        if first:
            env["KVKERNELS_TESTS_GPU_FIRST"] = "1"
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider", "tests/test_fused_attention.py"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return [line for line in proc.stdout.splitlines() if "::" in line]

    plain, ordered = collected(False), collected(True)
    assert sorted(plain) == sorted(ordered) and plain != ordered
    gpu = [n for n in plain if "cuda" in n.lower()]  # test_cuda_*: skipped on CPU, first on a GPU
    assert gpu and ordered[: len(gpu)] == gpu, ordered[: len(gpu) + 2]
    assert ordered[len(gpu) :] == [n for n in plain if n not in gpu]


def test_unknown_stage_is_an_error(tmp_path):
    proc, _ = _run(tmp_path, VERIFY_STAGES="build,benchmark")
    assert proc.returncode == 2 and "unknown stage 'benchmark'" in proc.stderr


def _filter(name: str) -> str:
    """The -k expression the script assembles in NAME='...' and NAME+='...' lines."""
    parts = re.findall(rf"^{name}\+?='([^']*)'", SCRIPT.read_text(), flags=re.M)
    assert parts, f"no {name} in {SCRIPT}"
    return "".join(parts)


def _selected(k: str) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "tests/test_cuda_kernels.py", "--collect-only", "-q"]
    proc = subprocess.run([*cmd, "-k", f"({k}) and not graph"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    return [ln.split("::")[1] for ln in proc.stdout.splitlines() if "::" in ln]


@pytest.mark.parametrize(
    "name,families,most",
    [
        ("MEMCHECK_K", ("inner_q", "kivi", "lattice", "aqua", "decode_attention_fused_shapes",
                        "decode_attention_fused_layouts", "decode_attention_fused_device_lengths",
                        "decode_attention_fused_store_tiles[", "decode_attention_fused_store_tiles_device_lengths",
                        "decode_attention_fused_kivi_tiles[", "quantize", "dequantize", "static_append"), 166),
        ("RACE_K", ("inner_q", "kivi", "lattice", "aqua", "decode_attention_fused_layouts",
                    "decode_attention_fused_masks", "decode_attention_fused_store_tiles[",
                    "decode_attention_fused_kivi_tiles[", "static_append"), 25),
    ],
)  # fmt: skip
def test_sanitizer_filters_select_every_kernel_family(name, families, most):
    # the test ids are the parametrize ids: a filter written against ids that do not exist selects nothing, silently
    tests = _selected(_filter(name))
    assert 0 < len(tests) <= most, len(tests)
    for family in families:
        assert any(family in t for t in tests), f"{name} selects no {family} test"
    assert not any("graph" in t for t in tests)
