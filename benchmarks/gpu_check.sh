#!/bin/bash
# One call on a GPU machine (benchmarks/README.md, "On a GPU machine"): build the CUDA
# extension, run the GPU tests, the CUDA build's CPU-side tests and the CUDA benchmark.
# Logs and results go to $1 (default: $OUT, else ./gpu-logs). About 6 minutes on an
# H100 with 16 cores; each step has its own time limit so the call ends inside 10 min.
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
timeout 150 python3 -m pytest -q -rs -p no:cacheprovider --timeout 100 -m gpu tests/ 2>&1 | tee "$out/gpu_tests.log" | tail -15
timeout 60 python3 benchmarks/kernels_cuda.py --quick > "$out/kernels_quick.txt" 2>&1; echo "kernels_cuda --quick: exit $?"
timeout 150 python3 benchmarks/kernels_cuda.py --allreduce-timeout 100 --json "$out/kernels_cuda.json" \
  > "$out/kernels_cuda.txt" 2>&1; echo "kernels_cuda: exit $?"
timeout 200 python3 -m pytest -q -p no:cacheprovider --timeout 100 tests/test_kernels.py tests/test_cuda_build.py \
  tests/test_collectives.py tests/test_hooks.py tests/test_errors.py 2>&1 | tee "$out/cpu_tests.log" | tail -5
