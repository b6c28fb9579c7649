#!/bin/bash
# One call on a GPU machine (benchmarks/README.md, "On a GPU machine"): build the CUDA
# extension, run the GPU tests, the CUDA build's CPU-side tests and the CUDA benchmark.
# Logs and results go to $1 (default: $OUT, else ./gpu-logs). About 6 minutes on an
# H100 with 16 cores; each step has its own time limit so the call ends inside 10 min.
# GPU_CHECK_SUITE=1 instead runs, after the build, the whole suite but the slow tests on
# the CUDA build (4 pytest-xdist workers, which the image has; about 6 minutes), one line
# per test as it ends, so that a run cut off at its limit still names its failures (-q
# prints them only in its closing summary: the first such run, 2026-11-27, lost them).
set -u
out=${1:-${OUT:-gpu-logs}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
# The system compiler: a CXX that links its own libstdc++ archive into _C.so crashes
# the first time an error message formats a number (docs/architecture.md, "CUDA").
export CXX=${PYCOMM_CXX:-/usr/bin/g++} CC=${PYCOMM_CC:-/usr/bin/gcc}
python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name(0))"
rm -rf build pycomm/_C*.so
PYCOMM_BUILD_CUDA=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16} \
  python3 setup.py build_ext --inplace > "$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
python3 -c "import pycomm; assert pycomm.built_with_cuda() and pycomm.cuda_available(); print('pycomm CUDA build OK')" || exit 1
if [ "${GPU_CHECK_SUITE:-0}" = 1 ]; then
  timeout ${GPU_CHECK_SUITE_S:-480} python3 -m pytest -v -p no:cacheprovider -n 4 --timeout 240 \
    -m "not slow" tests/ > "$out/suite.log" 2>&1
  echo "suite: exit $?"; grep -E " (FAILED|ERROR) " "$out/suite.log" | head -40; tail -1 "$out/suite.log"
  exit 0
fi
timeout 150 python3 -m pytest -q -rs -p no:cacheprovider --timeout 100 -m gpu tests/ 2>&1 | tee "$out/gpu_tests.log" | tail -15
timeout 60 python3 benchmarks/kernels_cuda.py --quick > "$out/kernels_quick.txt" 2>&1; echo "kernels_cuda --quick: exit $?"
timeout 150 python3 benchmarks/kernels_cuda.py --allreduce-timeout 100 --json "$out/kernels_cuda.json" \
  > "$out/kernels_cuda.txt" 2>&1; echo "kernels_cuda: exit $?"
timeout 200 python3 -m pytest -q -p no:cacheprovider --timeout 100 tests/kernels/test_kernels.py tests/kernels/test_cuda_build.py \
  tests/backend/test_collectives.py tests/hooks/test_hooks.py tests/hooks/test_hooks_unused.py tests/backend/test_errors.py 2>&1 \
  | tee "$out/cpu_tests.log" | tail -5
