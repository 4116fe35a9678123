set -x
echo "CC=${CC:-} CXX=${CXX:-} PATH=$PATH"
which gcc g++ c++; ls /usr/bin/g++* /usr/bin/gcc-* 2>/dev/null; gcc --version | head -1; g++ --version | head -1; /usr/bin/g++ --version | head -1
export TORCH_CUDA_ARCH_LIST=9.0a KVKERNELS_CUDA=1 PYTHONUNBUFFERED=1
SYSCXX=$(ls /usr/bin/g++ /usr/bin/g++-1* 2>/dev/null | head -1); SYSCC=${SYSCXX/g++/gcc}
mkdir -p /tmp/sys && cp -r csrc kvkernels triton_kernels setup.py pyproject.toml diag /tmp/sys/
(cd /tmp/sys && CC=$SYSCC CXX=$SYSCXX MAX_JOBS=8 timeout 140 python3 setup.py build_ext --inplace > $OUT/build_sys.log 2>&1; echo "sys build rc $?" >> $OUT/build_sys.log) &
(MAX_JOBS=8 timeout 140 python3 -m pip install --no-build-isolation --no-deps -e . > $OUT/build_def.log 2>&1; echo "default build rc $?" >> $OUT/build_def.log)
tail -1 $OUT/build_def.log
timeout 20 python3 diag/repro_err.py 2>&1 | tail -30
timeout 40 python3 -X faulthandler bench/attention_step.py --device cuda --tokens 32768 --batch 8 --presets innerq_base kivi2 --no-steps 2>&1 | tail -40
wait
tail -3 $OUT/build_sys.log
PYTHONPATH=/tmp/sys timeout 20 python3 /tmp/sys/diag/repro_err.py 2>&1 | tail -30
timeout 30 python3 -X faulthandler -m kvkernels bench --out /tmp/b --budget-s 15 --no-progress --no-plots 2>&1 | tail -40
