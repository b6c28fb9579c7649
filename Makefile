# The README's two commands: `make demo` and `make test`. Both install what
# they need first (torch 2.13.0 CPU build, then pycomm built against it).
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install demo test test-fast bench check-cuda clean asan-build test-asan docs test-integrations fuzz fuzz-build

# `make install` does nothing when nothing it depends on changed: the stamp is newer than
# the C++ sources, setup.py and this file, and the extension is in place. Otherwise pip
# installs the requirements and builds pycomm; setup.py keeps the objects in build/temp-*/
# so only what changed is recompiled (through ccache where installed).
DEPS := torch==2.13.0 pybind11 ninja numpy pytest pytest-xdist scikit-learn pyyaml tqdm matplotlib
STAMP := build/install.stamp
SOURCES := $(shell find csrc -name '*.cc' -o -name '*.h' -o -name '*.cu') setup.py pyproject.toml Makefile

install: $(STAMP)

$(STAMP): $(SOURCES)
	@# OpenSSL's libcrypto headers (csrc/transport/hmac.cc); apt only when they are missing.
	@test -f /usr/include/openssl/evp.h || { SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq libssl-dev; }
	$(PIP) install --quiet $(DEPS)
	@# setup.py imports torch: with autoload off, a stale install of pycomm (its folder gone)
	@# cannot stop torch from loading while the new one is built.
	@# ccache (where torch finds it) keyed without this folder's path, so another clone or
	@# worktree of the same sources reuses the objects instead of compiling for minutes.
	CCACHE_BASEDIR=$(CURDIR) CCACHE_NOHASHDIR=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0 \
	  $(PIP) install --quiet --no-build-isolation -e .
	@mkdir -p $(dir $@) && touch $@

# A missing extension (make clean, a fresh clone), a python without pycomm installed, or
# one whose installed pycomm is another checkout's (an editable install of a folder since
# moved or deleted: torch's backend autoload then fails every `import torch`) always
# rebuilds, whatever the stamp says. Checked from / so that this folder is not on the path.
ifneq ($(shell cd / && $(PYTHON) -c "import pycomm._C, pycomm; assert pycomm.__file__.startswith('$(CURDIR)/')" 2>/dev/null && echo ok),ok)
.PHONY: $(STAMP)
endif

demo: install
	$(PYTHON) -m pycomm.demo

# The suite in two parts: all but the `serial` tests on PYTEST_WORKERS pytest-xdist workers
# (a file per worker at a time, the longest files first: tests/conftest.py), then the serial
# ones alone (they count what the scheduler or the clock did). Both parts run; either
# failing fails the target. 3 workers on 2 cores: many tests wait on processes, timeouts
# or the network (benchmarks/results/suite_durations.md compares 2 and 3).
# PYTEST_WORKERS=0 runs the first part in one process.
PYTEST_WORKERS ?= 3
PYTEST_PARALLEL = -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder
# $(1): ANDed with each part's marker ("not slow and "), $(2): the test paths, $(3): an
# environment for python. A serial part that selects nothing (pytest's exit code 5: no
# serial test among the paths) is not a failure.
define run_suite
	@status=0; \
	echo 'python -m pytest -q --durations=25 $(PYTEST_PARALLEL) -m "$(1)not serial" $(2)'; \
	$(3) $(PYTHON) -m pytest -q --durations=25 $(PYTEST_PARALLEL) -m "$(1)not serial" $(2) || status=1; \
	echo 'python -m pytest -q --durations=10 -m "$(1)serial" $(2)'; \
	$(3) $(PYTHON) -m pytest -q --durations=10 -m "$(1)serial" $(2); rc=$$?; \
	[ $$rc = 0 ] || [ $$rc = 5 ] || status=1; \
	exit $$status
endef

# The C++ test programs and the loopback module link pycomm._C's own torch-free objects
# where they are up to date (tests/cpp_build.py) instead of compiling them again.
test: install
	$(call run_suite,,tests,PYCOMM_TEST_EXTENSION_OBJECTS=auto)

test-fast: install
	$(call run_suite,not slow and ,tests,PYCOMM_TEST_EXTENSION_OBJECTS=auto)

bench: install
	$(PYTHON) -m pycomm.bench -n 2 -b 8 -e 64M -f 4

# Compile check of the CUDA kernels (no GPU needed; tests/kernels/test_kernels.py runs the same).
NVCC ?= nvcc
check-cuda:
	@for f in csrc/kernels/cuda/*.cu; do \
	  echo "nvcc $$f"; \
	  $(NVCC) -std=c++17 -arch=sm_90 -ccbin g++ -Xcompiler -Wall -Icsrc -c $$f -o /dev/null || exit 1; \
	done

# Sanitizers (docs/development.md, "Sanitizers"): pycomm._C built with ASan + UBSan into build-asan/
# (never over the normal build), staged as a copy of the package in build-asan/pkg,
# then the failure-path, fuzz and C++ transport tests run against it. python itself is
# not sanitized: the ASan runtime is preloaded (every spawned rank inherits it) and
# leak detection is off (CPython leaks by design). Reports go to build-asan/logs,
# and tests/conftest.py fails the test during which one appears; abort_on_error also
# kills the process that hit it. The C++ test programs, the loopback module and the
# fuzz targets are built sanitized by the tests themselves (PYCOMM_TEST_SANITIZE), on the
# sanitized extension's torch-free objects (PYCOMM_TEST_EXTENSION_OBJECTS).
SANITIZE ?= address,undefined
ASAN_DIR := $(CURDIR)/build-asan
CXX_ASAN ?= g++
ASAN_ENV = LD_PRELOAD="$$($(CXX_ASAN) -print-file-name=libasan.so) $$($(CXX_ASAN) -print-file-name=libubsan.so)" \
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:log_path=$(ASAN_DIR)/logs/asan \
	UBSAN_OPTIONS=halt_on_error=1:abort_on_error=1:print_stacktrace=1:log_path=$(ASAN_DIR)/logs/ubsan \
	PYCOMM_SANITIZER_LOGS=$(ASAN_DIR)/logs PYCOMM_TEST_SANITIZE=$(SANITIZE) \
	PYCOMM_TEST_BUILD_DIR=$(ASAN_DIR)/cpp PYCOMM_TEST_EXTENSION_OBJECTS=$(ASAN_DIR)/temp PYTHONPATH=$(ASAN_DIR)/pkg PYTHONSAFEPATH=1 \
	PYCOMM_TEST_START_METHOD=spawn
# Everything that exercises failure paths: killed and silent ranks, usage errors,
# runtime errors, the fuzz targets, the TCP transport and bootstrap alone (C++), the
# shared-memory arena's failure cases, the algorithms over loopback, the placement
# program (the tree credits and the sharded posting). Left out: the test of where the
# scheduler puts crowded ranks, which counts placements per call and misses its margin
# at the sanitizers' speed (it checks no memory). CI runs all of it after `make test`
# (.ci/run). It runs like `make test`: on the xdist workers, then the serial tests alone
# (each worker's processes log to a folder of their own: tests/conftest.py).
ASAN_TESTS ?= tests/backend/test_failures.py tests/backend/test_errors.py tests/backend/test_fuzz.py tests/transport/test_transport_cpp.py \
	tests/transport/test_bootstrap_cpp.py tests/transport/test_bounds_cpp.py tests/transport/test_wire_integrity.py \
	tests/transport/test_shm.py tests/algorithms/test_algorithms.py tests/transport/test_placement_cpp.py \
	--deselect tests/transport/test_shm.py::test_crowded_ranks_spread_over_their_cpus

asan-build: install
	CCACHE_BASEDIR=$(CURDIR) CCACHE_NOHASHDIR=1 PYCOMM_SANITIZE=$(SANITIZE) \
	  $(PYTHON) setup.py build_ext --build-temp $(ASAN_DIR)/temp --build-lib $(ASAN_DIR)/lib
	rm -rf $(ASAN_DIR)/pkg $(ASAN_DIR)/logs
	mkdir -p $(ASAN_DIR)/pkg $(ASAN_DIR)/logs
	cp -r pycomm $(ASAN_DIR)/pkg/
	rm -f $(ASAN_DIR)/pkg/pycomm/_C*.so
	find $(ASAN_DIR)/pkg -name __pycache__ -prune -exec rm -rf {} +
	cp $(ASAN_DIR)/lib/pycomm/_C*.so $(ASAN_DIR)/pkg/pycomm/
	$(ASAN_ENV) $(PYTHON) -c "import pycomm._C as c, sys; f = c.__file__; print('sanitized pycomm._C:', f); \
	  sys.exit(0 if f.startswith('$(ASAN_DIR)/pkg/') else 'not the sanitized build')"

test-asan: asan-build
	$(call run_suite,,$(ASAN_TESTS),$(ASAN_ENV))

# The documentation site (mkdocs.yml; docs/development.md, "This documentation"):
# --strict turns every warning (a broken link, a page missing from the nav's
# files, a docstring mkdocstrings cannot render) into a failure. mkdocstrings reads
# the sources without importing them, so no build of pycomm._C is needed.
DOCS_PIP := mkdocs==1.6.1 mkdocs-material==9.8.1 mkdocstrings==1.0.8 mkdocstrings-python==2.0.11
docs:
	$(PIP) install --quiet $(DOCS_PIP)
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict --site-dir site

# The recipes of docs/integrations.md (Accelerate, the transformers Trainer, Lightning,
# Ray Train, DeepSpeed, torchrun elastic), each on 2 processes against gloo. The clients
# go into a venv of their own over the system's packages (torch, pycomm), pinned in
# tests/integrations/constraints.txt; the main suite does not collect tests/integrations.
INTEGRATIONS_VENV := $(CURDIR)/.venv-integrations
test-integrations: install
	test -x $(INTEGRATIONS_VENV)/bin/python || $(PYTHON) -m venv --system-site-packages $(INTEGRATIONS_VENV)
	$(INTEGRATIONS_VENV)/bin/python -m pip install --quiet -r tests/integrations/requirements.txt \
	  -c tests/integrations/constraints.txt
	@# DeepSpeed builds its CPU shared-memory op at its first init_process_group; two ranks
	@# building it at once on a fresh machine could outlast the store's wait. Built once here.
	DS_ACCELERATOR=cpu $(INTEGRATIONS_VENV)/bin/python -c "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder as B; B().load()"
	PYCOMM_INTEGRATIONS=1 $(INTEGRATIONS_VENV)/bin/python -m pytest -q --durations=20 tests/integrations

# libFuzzer (docs/development.md, "Fuzzing"): every target in tests/fuzz/ built with
# -fsanitize=fuzzer,address,undefined against the torch-free layers (csrc/transport,
# csrc/algorithms, csrc/kernels/cpu; objects in build-fuzz/obj, rebuilt when a source or
# a header it includes changes), then each run for FUZZ_SECONDS from its committed
# seeds (tests/fuzz/corpus/<target>/) plus what earlier runs here found
# (build-fuzz/corpus/<target>/). Any crash, sanitizer report, leak, hang past
# FUZZ_TIMEOUT s or invariant the harness checks fails the target; the input that
# did it is saved as build-fuzz/crashes/<target>-*. clang comes from apt when missing.
FUZZ_CXX ?= clang++
FUZZ_SECONDS ?= 30
FUZZ_TIMEOUT ?= 30
FUZZ_DIR := build-fuzz
# Each target with its longest input (-max_len).
FUZZ_RUNS := fuzz_frames:4096 fuzz_coo_allreduce:4096 fuzz_wire:4096 fuzz_coo:1024 fuzz_sparse:1024 \
	fuzz_alltoall_splits:256
FUZZ_TARGETS := $(foreach run,$(FUZZ_RUNS),$(firstword $(subst :, ,$(run))))
FUZZ_FLAGS := -std=c++17 -g1 -O1 -fno-omit-frame-pointer -fno-sanitize-recover=all -pthread -Icsrc -MMD -MP
FUZZ_LIB_SOURCES := $(sort $(wildcard csrc/transport/*.cc csrc/algorithms/*.cc csrc/kernels/cpu/*.cc))
FUZZ_LIB_OBJECTS := $(patsubst csrc/%.cc,$(FUZZ_DIR)/obj/%.o,$(FUZZ_LIB_SOURCES))
FUZZ_BINARIES := $(addprefix $(FUZZ_DIR)/bin/,$(FUZZ_TARGETS))
FUZZ_CCACHE := $(shell command -v ccache 2>/dev/null)
.SECONDARY: $(FUZZ_LIB_OBJECTS)

fuzz-build: $(FUZZ_BINARIES)

fuzz: fuzz-build
	@mkdir -p $(FUZZ_DIR)/crashes
	@for run in $(FUZZ_RUNS); do \
	  t=$${run%%:*}; echo "== $$t: $(FUZZ_SECONDS) s"; mkdir -p $(FUZZ_DIR)/corpus/$$t; \
	  $(FUZZ_DIR)/bin/$$t -max_total_time=$(FUZZ_SECONDS) -timeout=$(FUZZ_TIMEOUT) -rss_limit_mb=2048 \
	    -max_len=$${run##*:} -print_final_stats=1 -artifact_prefix=$(FUZZ_DIR)/crashes/$$t- \
	    $(FUZZ_DIR)/corpus/$$t tests/fuzz/corpus/$$t > $(FUZZ_DIR)/$$t.log 2>&1; \
	  rc=$$?; grep -E '^#[0-9]+[[:space:]]+(INITED|DONE)|^stat::(number_of_executed_units|average_exec_per_sec|new_units_added|peak_rss_mb)|^Done' $(FUZZ_DIR)/$$t.log; \
	  if [ $$rc -ne 0 ]; then tail -60 $(FUZZ_DIR)/$$t.log; echo "fuzz: $$t failed (log $(FUZZ_DIR)/$$t.log)"; exit 1; fi; \
	done

$(FUZZ_DIR)/.clang:
	@command -v $(FUZZ_CXX) >/dev/null || { SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq clang; }
	@test -f /usr/include/openssl/evp.h || { SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq libssl-dev; }
	@mkdir -p $(dir $@) && touch $@

$(FUZZ_DIR)/obj/%.o: csrc/%.cc | $(FUZZ_DIR)/.clang
	@mkdir -p $(dir $@)
	$(FUZZ_CCACHE) $(FUZZ_CXX) $(FUZZ_FLAGS) -fsanitize=fuzzer-no-link,address,undefined -c $< -o $@

$(FUZZ_DIR)/bin/%: tests/fuzz/%.cc $(FUZZ_LIB_OBJECTS) | $(FUZZ_DIR)/.clang
	@mkdir -p $(dir $@)
	$(FUZZ_CXX) $(FUZZ_FLAGS) -MF $@.d -fsanitize=fuzzer,address,undefined $< $(FUZZ_LIB_OBJECTS) -lcrypto -o $@

-include $(wildcard $(FUZZ_DIR)/obj/*/*.d $(FUZZ_DIR)/obj/*/*/*.d $(FUZZ_DIR)/bin/*.d)

clean:
	rm -rf build build-asan build-fuzz site *.egg-info pycomm/_C*.so
