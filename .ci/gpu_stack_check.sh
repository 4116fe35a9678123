#!/usr/bin/env bash
# The GPU machines' software stack, reproduced on a CPU machine, with kvkernels checked against it.
#
#   bash .ci/gpu_stack_check.sh            (or: make gpu-stack-check)
#
# The lent GPU machines run Python 3.12, torch 2.11.0+cu130, triton 3.6, transformers 5.17, numpy 2.5 and nvcc 13.
# PyPI's torch 2.11.0 for Linux is that same +cu130 build, and it imports without a GPU, so this script:
#   1. creates $VENV (Python 3.12) with those versions (about 3 GB of wheels the first time, reused after);
#   2. builds the whole extension from a copy of the tree with KVKERNELS_CUDA=1 (kernels + torch bindings, sm_90);
#   3. checks that the CUDA kernels are registered with the dispatcher;
#   4. runs the test suite with TRITON_INTERPRET=1, including the Triton compile check with triton 3.6 (under
#      numpy >= 2.4 triton 3.6's interpreter cannot run the Triton kernels: those tests skip, with that reason;
#      compiled Triton on a GPU is unaffected);
#   5. dry-runs bench/gpu_verify.sh on the build (the GPU-only stages report that there is no GPU).
# Not part of CI (the downloads): run it when setup.py, the bindings or the dependency pins change, so the first
# GPU session does not spend its minutes on a build error.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${VENV:-$ROOT/build/gpu-stack-venv}
if [ -z "${PY312:-}" ]; then  # the first python3.12 that runs (a pyenv shim can exist and still refuse to run)
  for c in "$(command -v python3.12 || true)" /root/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12; do
    [ -n "$c" ] && [ -x "$c" ] && "$c" -c 'import sys' 2>/dev/null && PY312=$c && break
  done
fi
PY312=${PY312:-}
start=$(date +%s)
stage() { echo; echo "=== $1 ($(($(date +%s) - start))s) ==="; }

stage "1. environment: $VENV"
if [ ! -x "$VENV/bin/python" ]; then
  [ -n "$PY312" ] || { echo "gpu_stack_check: no python3.12 found (set PY312=/path/to/python3.12)"; exit 2; }
  "$PY312" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check torch==2.11.0 triton==3.6.0 transformers==5.17.0 \
  numpy==2.5.2 pytest hypothesis pytest-benchmark matplotlib tqdm ninja setuptools wheel
"$VENV/bin/python" -c 'import sys, torch, triton, transformers, numpy
print("python", sys.version.split()[0], "| torch", torch.__version__, "| triton", triton.__version__,
      "| transformers", transformers.__version__, "| numpy", numpy.__version__)'

stage "2. KVKERNELS_CUDA=1 build of a copy of the tree"
SRC=$(mktemp -d)
trap 'rm -rf "$SRC"' EXIT
git ls-files -co --exclude-standard | tar -cf - -T - | tar -xf - -C "$SRC"
if [ -z "${CUDA_HOME:-}" ]; then  # as gpu_verify.sh: torch's guess from a wrapper nvcc can miss the headers
  for d in "$(dirname "$(dirname "$(readlink -f "$(command -v nvcc || echo /nonexistent)")")")" /usr/local/cuda; do
    [ -f "$d/include/cuda_runtime.h" ] && export CUDA_HOME=$d && break
  done
fi
(cd "$SRC" && KVKERNELS_CUDA=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-$(nproc)} \
  "$VENV/bin/python" -m pip install -q --no-build-isolation --no-deps -e . >"$SRC/build.log" 2>&1) ||
  { tail -n 30 "$SRC/build.log"; echo "gpu_stack_check: FAIL (build)"; exit 1; }
echo "built $(ls "$SRC"/kvkernels/_C*.so)"

stage "3. CUDA kernels registered"
(cd "$SRC" && "$VENV/bin/python" -c '
import torch, kvkernels
from kvkernels import ops
print(kvkernels.backends())
print("CUDA tensors are served by:", ops.CUDA_IMPL)  # "cuda" = compiled kernel registered by kvkernels._C
# storage ops of the lattice format (fwht, quantize, dequantize) have no compiled CUDA kernel: Triton serves them
triton_by_design = {"fwht", "lattice_quantize", "lattice_dequantize"}
missing = [op for op, impl in ops.CUDA_IMPL.items() if impl != "cuda" and op not in triton_by_design]
assert not missing, f"no compiled CUDA kernel for {missing}"')

stage "4. tests (TRITON_INTERPRET=1): ${GPU_STACK_TESTS:=tests}"
# GPU_STACK_TESTS: the test paths (default the whole suite, ~30+ minutes on 2 cores; e.g. "tests/test_ops.py")
# shellcheck disable=SC2086
(cd "$SRC" && TRITON_INTERPRET=1 "$VENV/bin/python" -m pytest $GPU_STACK_TESTS -q -rs -p no:cacheprovider)

stage "5. bench/gpu_verify.sh dry run (build reused)"
(cd "$SRC" && VERIFY_SKIP_BUILD=1 PYTHON="$VENV/bin/python" bash bench/gpu_verify.sh "$SRC/verify" | tail -n 30)

stage "gpu_stack_check: PASS"
