#!/usr/bin/env bash
# Compile check of the CUDA backend without a GPU:
#   1. every csrc/cuda/*.cu with nvcc for sm_80, sm_87 and sm_90 (one nvcc call per file, -Xptxas -v, the
#      setup.py flags); fails on any compile error or any register spill (the GEMVs: spills are reported, and
#      make sass-budget fails on spills inside their hot loops), prints registers per kernel and arch;
#   2. the SASS of the GEMVs' vectorized instantiations uses 64/128-bit code loads (cuobjdump);
#   3. g++ -fsyntax-only of csrc/cuda/torch_bindings.cpp against the (CPU) torch headers.
# Skips (exit 0, with the reason) where nvcc or torch is absent. Two files compile at a time.
# The objects stay in $NVCC_CHECK_OBJ_DIR (default build/nvcc_check), each with a manifest (flags, archs, sha256 of
# the .cu and of every csrc header): bench/sass_budget.py reuses an object whose manifest still matches the sources
# instead of compiling it again (in CI, make sass-budget follows this script: ~10 minutes saved).
set -uo pipefail
cd "$(dirname "$0")/.."

NVCC="${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
PY="${PYTHON:-.venv/bin/python}"
ARCHS=(80 87 90)
JOBS="${NVCC_CHECK_JOBS:-2}"
# Same flags as setup.py's CUDAExtension (plus -Xptxas -v for the register / spill report).
FLAGS=(-std=c++17 -O3 --use_fast_math -lineinfo --expt-relaxed-constexpr -I csrc -Xptxas -v)
for a in "${ARCHS[@]}"; do FLAGS+=(-gencode "arch=compute_${a},code=sm_${a}"); done

# What an object is built from, read by bench/sass_budget.py (prebuilt_object) before it reuses the object:
# the flags, the archs, and the sha256 of the .cu ($1) and of every csrc header.
manifest() {
  echo "flags ${FLAGS[*]}"
  echo "archs ${ARCHS[*]}"
  find csrc -name '*.cuh' -o -name '*.h' | LC_ALL=C sort | xargs sha256sum "$1"
}
if [ "${1:-}" = "--manifest" ]; then  # tests/test_sass_budget.py: the manifest of one file, nothing compiled
  manifest "${2:?usage: nvcc_check.sh --manifest FILE.cu}"
  exit 0
fi

if [ ! -x "$NVCC" ]; then
  echo "nvcc_check: SKIP (no nvcc found; set NVCC=/path/to/nvcc to run the CUDA compile check)"
  exit 0
fi
echo "nvcc_check: $("$NVCC" --version | tail -n 2 | head -n 1)"

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
OBJ_DIR="${NVCC_CHECK_OBJ_DIR:-build/nvcc_check}"
rm -rf "$OBJ_DIR"
mkdir -p "$OBJ_DIR"
status=0

# Readable kernel names: demangled, namespaces and casts dropped, QuantMode values named.
DEMANGLE_SED='s/\(anonymous namespace\):://g; s/\(kvk::QuantMode\)0/sym/g; s/\(kvk::QuantMode\)1/asym/g;'
DEMANGLE_SED+=' s/\(kvk::QuantMode\)2/hybrid/g; s/kvk:://g; s/\(int\)//g; s/\(bool\)//g; s/\(.*$//; s/^void //'

# ---- 1. nvcc, two files at a time ------------------------------------------------------------------------------
compile() {  # $1 = .cu file; writes $OBJ_DIR/<name>.{o,log,manifest} and $WORK/<name>.rc
  local name rc
  name="$(basename "$1" .cu)"
  local start=$SECONDS
  manifest "$1" >"$WORK/$name.manifest"  # hashed before the compile reads the sources
  "$NVCC" "${FLAGS[@]}" -c "$1" -o "$OBJ_DIR/$name.o" >"$OBJ_DIR/$name.log" 2>&1
  rc=$?
  [ "$rc" = 0 ] && mv "$WORK/$name.manifest" "$OBJ_DIR/$name.manifest"
  echo "$rc" >"$WORK/$name.rc"
  echo $((SECONDS - start)) >"$WORK/$name.secs"
}

files=(csrc/cuda/*.cu)
if [ ! -e "${files[0]}" ]; then
  echo "nvcc_check: no csrc/cuda/*.cu files"
else
  running=0
  for f in "${files[@]}"; do
    compile "$f" &
    running=$((running + 1))
    if [ "$running" -ge "$JOBS" ]; then
      wait -n
      running=$((running - 1))
    fi
  done
  wait
fi

for f in "${files[@]}"; do
  [ -e "$f" ] || continue
  name="$(basename "$f" .cu)"
  log="$OBJ_DIR/$name.log"
  rc="$(cat "$WORK/$name.rc")"
  echo
  echo "== $f  ($(cat "$WORK/$name.secs")s, sm_${ARCHS[*]// /, sm_})"
  if [ "$rc" != 0 ]; then
    grep -E "error|Error" "$log" | head -n 40
    echo "FAIL: $f does not compile (nvcc exit $rc)"
    status=1
    continue
  fi
  grep -E "warning" "$log" | grep -v "ptxas info" | head -n 20
  # ptxas -v prints, per kernel and arch: "Compiling entry function 'NAME' for 'sm_XX'", then a line with
  # "N bytes spill stores, M bytes spill loads" and one with "Used R registers". Table: kernel x arch.
  awk -v archs="${ARCHS[*]}" '
    /Compiling entry function/ {
      match($0, /function '\''[^'\'']+'\''/); fn = substr($0, RSTART + 10, RLENGTH - 11)
      match($0, /for '\''sm_[0-9]+'\''/); arch = substr($0, RSTART + 8, RLENGTH - 9)
      if (!(fn in seen)) { seen[fn] = 1; order[++n] = fn }
      next
    }
    /bytes spill stores/ && fn != "" {
      match($0, /[0-9]+ bytes spill stores/); st = substr($0, RSTART, RLENGTH) + 0
      match($0, /[0-9]+ bytes spill loads/); ld = substr($0, RSTART, RLENGTH) + 0
      if (st > 0 || ld > 0) { spill[fn, arch] = st "/" ld; nspill++ }
    }
    /Used [0-9]+ registers/ && fn != "" {
      match($0, /Used [0-9]+ registers/); regs[fn, arch] = substr($0, RSTART + 5, RLENGTH - 15) + 0
    }
    END {
      na = split(archs, A, " ")
      for (i = 1; i <= n; i++) {
        line = order[i]
        for (j = 1; j <= na; j++) {
          k = order[i] SUBSEP A[j]
          line = line "\t" ((k in regs) ? regs[k] : "-") ((k in spill) ? " SPILL(" spill[k] ")" : "")
        }
        print line
      }
      print "#kernels " n " spills " (nspill + 0)
    }' "$log" >"$WORK/$name.table"
  summary="$(tail -n 1 "$WORK/$name.table")"
  printf '  %-72s %s\n' "kernel (registers per arch)" "$(printf 'sm_%s  ' "${ARCHS[@]}")"
  head -n -1 "$WORK/$name.table" | while IFS=$'\t' read -r fn r80 r87 r90; do
    pretty="$(echo "$fn" | c++filt 2>/dev/null | sed -E "$DEMANGLE_SED")"
    printf '  %-72s %-6s %-6s %-6s\n' "${pretty:0:72}" "$r80" "$r87" "$r90"
  done
  nspill="$(echo "$summary" | awk '{print $4}')"
  nk="$(echo "$summary" | awk '{print $2}')"
  if [ "$nspill" != 0 ] && [[ "$name" == gemv_* ]]; then
    # The GEMVs run at a 128-register cap (2 CTAs/SM); a few spilled bytes in a CTA's staging are cheap, in a hot
    # loop they are not: make sass-budget fails on any LDL/STL inside an sm_90 hot loop.
    echo "  note: $nk kernels x ${#ARCHS[@]} archs, $nspill pairs spill outside their hot loops (gated by make sass-budget)"
  elif [ "$nspill" != 0 ]; then
    echo "FAIL: $f has $nspill kernel/arch pairs with register spills"
    status=1
  else
    echo "  ok: $nk kernels x ${#ARCHS[@]} archs, no spills"
  fi
done

# ---- 2. wide code loads in the SASS ------------------------------------------------------------------------------
# The GEMVs' VEC=true instantiations (picked at run time when code rows are 16-byte aligned) exist to read codes
# with 64/128-bit loads. A change that made the compiler split them into 32-bit loads would cost bandwidth, not
# correctness, so no test would notice: read the SASS. VEC is the last template argument: gemv_kivi's bool
# (mangled "Lb1EEE"), gemv_inner_q's int LOADS (1 "Li1EEE": 16-byte loads to registers; 2 "Li2EEE": the cp.async
# ring, whose codes must arrive by 16-byte LDGSTS; 3 "Li3EEE": the ring's head_dim-64 key kernel, 8-byte LDGSTS);
# gemv_kivi's ring (LOADS 2) at 8 columns per lane ("Li8ELi2EEE": 64-column stores) copies 8-byte code pieces.
# gemv_lattice has no VEC variants (its register loads are 32-bit by design, and its "Lb1EEE" is another bool); its
# keys' ring kernels (gemv_lattice_k_kernel<..., true>) must copy their code rows with 16- or 8-byte LDGSTS.
echo
CUOBJDUMP="$(command -v cuobjdump || ls "$(dirname "$(readlink -f "$NVCC")")/cuobjdump" \
  .venv/lib/python3*/site-packages/triton/backends/nvidia/bin/cuobjdump 2>/dev/null | head -n 1)"
if [ -z "$CUOBJDUMP" ]; then
  echo "== wide loads: SKIP (no cuobjdump in PATH, next to nvcc, or in the venv's triton)"
else
  for o in "$OBJ_DIR"/gemv_*.o; do
    [ -e "$o" ] || continue
    "$CUOBJDUMP" -sass "$o" | awk '
      /code for sm_/ { arch = $3 }
      /Function : / { fn = $3; lat = fn ~ /gemv_lattice/
                      if (!lat && fn ~ /L[bi]1EEE/) { vec[fn " " arch] = 1 }
                      if (fn ~ /gemv_kivi_kernel.*Li8ELi2EEE/) { ring64[fn " " arch] = 1 }
                      else if (fn ~ /Li2EEE/) { ring[fn " " arch] = 1 }
                      if (fn ~ /Li3EEE/) { ring64[fn " " arch] = 1 }
                      if (fn ~ /gemv_lattice_k_kernel.*Lb1EEEv/) { ringany[fn " " arch] = 1 } }
      /LDG\.E\.(64|128)/ { wide[fn " " arch] = 1 }
      /LDGSTS.*\.128/ { async[fn " " arch] = 1 }
      /LDGSTS.*\.64/ { async64[fn " " arch] = 1 }
      END {
        for (k in vec) { n++; if (!(k in wide)) { print "NARROW " k; bad++ } }
        for (k in ring) { n++; if (!(k in async)) { print "NARROW " k; bad++ } }
        for (k in ring64) { n++; if (!(k in async64)) { print "NARROW " k; bad++ } }
        for (k in ringany) { n++; if (!(k in async) && !(k in async64)) { print "NARROW " k; bad++ } }
        print "#vec " n + 0 " narrow " bad + 0
      }' >"$WORK/wide.txt"
    summary="$(tail -n 1 "$WORK/wide.txt")"
    name="$(basename "$o" .o)"
    if [ "$(echo "$summary" | awk '{print $2}')" = 0 ]; then
      echo "FAIL: $name: no VEC=true instantiation found in the SASS (has the template changed?)"
      status=1
    elif [ "$(echo "$summary" | awk '{print $4}')" != 0 ]; then
      grep NARROW "$WORK/wide.txt" | c++filt | sed -E "$DEMANGLE_SED" | head -n 20
      echo "FAIL: $name: VEC=true kernels without 64/128-bit code loads (or ring kernels without 16- / 8-byte LDGSTS)"
      status=1
    else
      echo "== wide loads: $name: all $(echo "$summary" | awk '{print $2}') VEC / ring kernel/arch pairs use LDG.E.64/128 / LDGSTS.128 (.64)"
    fi
  done
fi

# ---- 3. syntax check of the torch binding -----------------------------------------------------------------------
echo
BINDING=csrc/cuda/torch_bindings.cpp
if [ ! -e "$BINDING" ]; then
  echo "== $BINDING: absent"
elif ! TORCH_INC="$("$PY" -c 'import torch.utils.cpp_extension as c; print(" ".join("-I" + p for p in
    c.include_paths()))' 2>/dev/null)"; then
  echo "== $BINDING: SKIP syntax check (no torch in $PY)"
else
  # CPU torch wheels ship the c10/cuda headers but not the build-generated cuda_cmake_macros.h; stub it.
  mkdir -p "$WORK/stub/c10/cuda/impl"
  echo '#define C10_CUDA_BUILD_SHARED_LIBS' >"$WORK/stub/c10/cuda/impl/cuda_cmake_macros.h"
  CUDA_INC="$(dirname "$(dirname "$(readlink -f "$NVCC")")")/include"
  [ -e "$CUDA_INC/cuda_runtime.h" ] || CUDA_INC=/usr/local/cuda/include
  # shellcheck disable=SC2086
  if g++ -std=c++17 -fsyntax-only -Wall -Wno-unknown-pragmas -I csrc $TORCH_INC -I "$WORK/stub" -I "$CUDA_INC" \
      $(python3-config --includes 2>/dev/null) "$BINDING" >"$WORK/binding.log" 2>&1; then
    echo "== $BINDING: g++ syntax check ok"
    grep -A2 "torch_bindings.cpp:[0-9]*:[0-9]*: warning" "$WORK/binding.log" | head -n 20
  else
    grep -E "error" "$WORK/binding.log" | head -n 40
    echo "FAIL: $BINDING does not pass the g++ syntax check"
    status=1
  fi
fi

echo
if [ "$status" = 0 ]; then echo "nvcc_check: PASS"; else echo "nvcc_check: FAIL"; fi
exit "$status"
