#!/usr/bin/env bash
# Build, test, sanitize and benchmark kvkernels on a CUDA machine without network, inside one 10-minute call.
#
#   bash bench/gpu_verify.sh OUTDIR
#
# Stages, each under `timeout` so the whole run ends within VERIFY_BUDGET_S (default 560 s):
#   1. build     KVKERNELS_CUDA=1 pip install --no-build-isolation --no-deps -e .  (only this GPU's arch)
#   2. tests     pytest tests -rs (CUDA tests included; hypothesis tests ignored with a note if it is missing)
#   3. sanitizer compute-sanitizer --tool memcheck over tests/test_cuda_kernels.py (SANITIZER_K narrows it)
#   4. demo      python -m kvkernels demo --device cuda (part 3, SmolLM2 on the CUDA kernels, into the summary)
#   5. bench     python -m kvkernels bench --out OUTDIR/bench (full sweep, stops starting cases on budget)
#   6. summary   pass/fail counts, sanitizer errors, top-line speedups -> OUTDIR/summary.txt (also printed)
# At most 8 files come back from the GPU machine, so OUTDIR holds exactly: summary.txt, tests.log,
# sanitizer.log, extra.tar.gz (build.log, junit.xml, demo.log, bench.log), bench/<device>-<date>.json, 3 PNGs.
#
# Env: PYTHON (python3), VERIFY_BUDGET_S (560), SANITIZER_K (pytest -k for stage 3), TORCH_CUDA_ARCH_LIST
# (default: the visible GPU's compute capability), MAX_JOBS (nproc).
set -uo pipefail

OUT=${1:?usage: bash bench/gpu_verify.sh OUTDIR}
mkdir -p "$OUT/bench"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WORK=$(mktemp -d)
SUMMARY="$WORK/summary.txt"
T0=$(date +%s)
BUDGET=${VERIFY_BUDGET_S:-560}
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
unset TRITON_INTERPRET  # real GPU: Triton compiles for the device

note() { echo "$*" | tee -a "$SUMMARY"; }
left() { echo $((T0 + BUDGET - $(date +%s))); }
# slot CAP RESERVE: seconds for the next stage, at most CAP, leaving RESERVE seconds for the stages after it
slot() {
  local t=$(($(left) - $2))
  ((t > $1)) && t=$1
  ((t < 5)) && t=5  # out of time: the stage gets 5 s and reports TIMED OUT rather than being silently dropped
  echo $t
}
stage() { echo; echo "=== $1 (t=$(($(date +%s) - T0)) s, $(left) s left) ==="; }
status_of() {  # exit code of `timeout` -> words
  case $1 in 0) echo ok ;; 124 | 137) echo "TIMED OUT" ;; *) echo "exit $1" ;; esac
}

stage "environment"
note "kvkernels gpu_verify  $(date -u +%Y-%m-%dT%H:%M:%SZ)  commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
note "gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader 2>/dev/null || echo 'nvidia-smi unavailable')"
note "$($PY -c 'import sys, torch; print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda, "| gpu visible", torch.cuda.is_available())' 2>&1)"
note "$($PY -c 'import triton; print("triton", triton.__version__)' 2>&1 | tail -1)"

stage "1. build"
CC=$($PY -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())' 2>/dev/null || echo 9.0)
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$CC} MAX_JOBS=${MAX_JOBS:-$(nproc)} KVKERNELS_CUDA=1
if [ -z "${CUDA_HOME:-}" ]; then  # torch guesses from `which nvcc`, wrong when nvcc is a wrapper outside the toolkit
  for d in "$(dirname "$(dirname "$(readlink -f "$(command -v nvcc || echo /nonexistent)")")")" /usr/local/cuda; do
    [ -f "$d/include/cuda_runtime.h" ] && export CUDA_HOME=$d && break
  done
fi
note "CUDA_HOME=${CUDA_HOME:-unset (torch will guess)}"
T=$(slot 240 330)
if [ -n "${VERIFY_SKIP_BUILD:-}" ]; then  # for dry runs of this script on a machine without CUDA
  echo "VERIFY_SKIP_BUILD set: not building" >"$WORK/build.log"
  rc=0
else
  timeout "$T" $PY -m pip install --no-build-isolation --no-deps -e . >"$WORK/build.log" 2>&1
  rc=$?
  if [ $rc -ne 0 ] && [ $rc -ne 124 ]; then  # e.g. pip refuses the environment: build in place instead
    echo "--- pip failed ($rc); trying setup.py build_ext --inplace" >>"$WORK/build.log"
    timeout "$(slot 200 330)" $PY setup.py build_ext --inplace >>"$WORK/build.log" 2>&1
    rc=$?
  fi
fi
note "build (arch $TORCH_CUDA_ARCH_LIST, ${T}s cap${VERIFY_SKIP_BUILD:+, SKIPPED}): $(status_of $rc)"
[ $rc -ne 0 ] && tail -n 15 "$WORK/build.log" | sed 's/^/  build| /' | tee -a "$SUMMARY"
note "backends: $($PY -c 'import kvkernels; print(kvkernels.backends())' 2>&1 | tail -1)"

stage "2. tests"
# The CPU stand-ins for a GPU (the CUDA emulator build, the Triton ahead-of-time compile) take minutes of this
# budget and check nothing the real run below does not check better: CPU CI runs them.
IGNORE=(--ignore=tests/test_cuda_emulated.py --ignore=tests/test_triton_compile.py)
note "not run here (CPU CI runs them): ${IGNORE[*]}"
if ! $PY -c 'import hypothesis' 2>/dev/null; then
  HYP=()
  for f in $(grep -lE '^\s*(import hypothesis|from hypothesis)' tests/*.py 2>/dev/null); do HYP+=("--ignore=$f"); done
  note "hypothesis is not installed: ignored ${HYP[*]:-nothing}"
  IGNORE+=("${HYP[@]}")
fi
TIMEOUT_ARGS=()
$PY -c 'import pytest_timeout' 2>/dev/null && TIMEOUT_ARGS=(--timeout=120)
T=$(slot 180 220)
timeout "$T" $PY -m pytest tests -rs -q -p no:cacheprovider --junitxml="$WORK/junit.xml" \
  "${TIMEOUT_ARGS[@]}" "${IGNORE[@]}" >"$OUT/tests.log" 2>&1
rc=$?
note "tests (${T}s cap): $(status_of $rc) | $(grep -E '^(=+ )?[0-9]+ (passed|failed|error)' "$OUT/tests.log" | tail -1)"

stage "3. compute-sanitizer memcheck"
SAN=$(command -v compute-sanitizer || ls "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer" /usr/local/cuda/bin/compute-sanitizer 2>/dev/null | head -1 || true)
if [ ! -f tests/test_cuda_kernels.py ]; then
  note "sanitizer: skipped (tests/test_cuda_kernels.py does not exist yet)" | tee "$OUT/sanitizer.log"
elif [ -z "$SAN" ]; then
  note "sanitizer: skipped (compute-sanitizer not found)" | tee "$OUT/sanitizer.log"
else
  T=$(slot 120 150)
  K_ARGS=()
  [ -n "${SANITIZER_K:-}" ] && K_ARGS=(-k "$SANITIZER_K")
  # no caching allocator: out-of-bounds accesses inside a cached block would be invisible to memcheck
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$T" "$SAN" --tool memcheck --print-limit 30 \
    $PY -m pytest tests/test_cuda_kernels.py -q -p no:cacheprovider "${K_ARGS[@]}" >"$OUT/sanitizer.log" 2>&1
  rc=$?
  errs=$(grep -oE 'ERROR SUMMARY: [0-9]+' "$OUT/sanitizer.log" | awk '{s += $3} END {print s + 0}')
  note "sanitizer (${T}s cap${SANITIZER_K:+, -k $SANITIZER_K}): $(status_of $rc) | memcheck errors: $errs |" \
    "$(grep -E '[0-9]+ (passed|failed)' "$OUT/sanitizer.log" | tail -1)"
fi

stage "4. demo"
# the README's demo on the GPU: part 3 (SmolLM2 generate() and perplexity with each cache) on the CUDA kernels,
# or the line saying why it was skipped (the model packages are not installed there)
T=$(slot 90 90)
timeout "$T" $PY -m kvkernels demo --device cuda --no-progress >"$WORK/demo.log" 2>&1
rc=$?
note "demo --device cuda (${T}s cap): $(status_of $rc)"
[ $rc -ne 0 ] && tail -n 5 "$WORK/demo.log" | sed 's/^/  demo| /' | tee -a "$SUMMARY"
awk '/^(3a\. |\[3\. )/, 0' "$WORK/demo.log" | cut -c1-160 | sed 's/^/  demo| /' | tee -a "$SUMMARY"

stage "5. bench"
T=$(slot 600 20)
BUDGET_S=$((T - 45))
((BUDGET_S < 10)) && BUDGET_S=10
timeout "$T" $PY -m kvkernels bench --out "$OUT/bench" --budget-s "$BUDGET_S" --no-progress >"$WORK/bench.log" 2>&1
rc=$?
note "bench (${T}s cap, case budget ${BUDGET_S}s): $(status_of $rc)"
tail -n 40 "$WORK/bench.log"

stage "6. summary"
$PY - "$WORK/junit.xml" "$OUT/bench" >>"$SUMMARY" 2>&1 <<'EOF'
import glob, json, os, sys
import xml.etree.ElementTree as ET

junit, bench_dir = sys.argv[1], sys.argv[2]
if os.path.exists(junit):
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    c = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    passed = c["tests"] - c["failures"] - c["errors"] - c["skipped"]
    print(f"pytest: {passed} passed, {c['failures']} failed, {c['errors']} errors, {c['skipped']} skipped")
    bad = [f"{tc.get('classname')}::{tc.get('name')}" for s in suites for tc in s.iter("testcase")
           if tc.find("failure") is not None or tc.find("error") is not None]
    for name in bad[:12]:
        print(f"  FAILED {name}")
    if len(bad) > 12:
        print(f"  ... and {len(bad) - 12} more (tests.log)")
else:
    print("pytest: no junit xml (timed out or did not start); see tests.log")
files = sorted(glob.glob(os.path.join(bench_dir, "*.json")))
if not files:
    print("bench: no JSON written")
else:
    from kvkernels.bench import topline

    res = json.load(open(files[-1]))
    print(f"bench: {len(res['results'])} cases, {len(res['skipped'])} skipped, copy bandwidth "
          f"{res['copy_bandwidth']['GBps']:.0f} GB/s, {os.path.basename(files[-1])}")
    for line in topline(res):
        print("  " + line)
EOF
tar -czf "$OUT/extra.tar.gz" -C "$WORK" $(cd "$WORK" && ls build.log junit.xml demo.log bench.log 2>/dev/null)
note "total $(($(date +%s) - T0)) s; files: $(cd "$OUT" && find . -type f | sort | tr '\n' ' ')"
cp "$SUMMARY" "$OUT/summary.txt"
echo
echo "================ summary ================"
cat "$OUT/summary.txt"
