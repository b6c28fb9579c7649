# The README's two commands: `make demo` and `make test`. Both install what
# they need first (torch 2.13.0 CPU build, then pycomm built against it).
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install demo test test-fast bench check-cuda clean

install:
	$(PIP) install --quiet torch==2.13.0 pybind11 ninja numpy pytest scikit-learn pyyaml tqdm matplotlib
	$(PIP) install --quiet --no-build-isolation -e .

demo: install
	$(PYTHON) -m pycomm.demo

test: install
	$(PYTHON) -m pytest -q tests

test-fast: install
	$(PYTHON) -m pytest -q -m "not slow" tests

bench: install
	$(PYTHON) -m pycomm.bench -n 2 -b 8 -e 64M -f 4

# Compile check of the CUDA kernels (no GPU needed; tests/test_kernels.py runs the same).
NVCC ?= nvcc
check-cuda:
	@for f in csrc/kernels/cuda/*.cu; do \
	  echo "nvcc $$f"; \
	  $(NVCC) -std=c++17 -arch=sm_90 -ccbin g++ -Xcompiler -Wall -Icsrc -c $$f -o /dev/null || exit 1; \
	done

clean:
	rm -rf build *.egg-info pycomm/_C*.so
