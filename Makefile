# Two entry points: `make demo` and `make test`. Both build .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
BUILD_DEPS := scikit-build-core nanobind jax==0.10.2 jaxlib==0.10.2
SOURCES := pyproject.toml constraints.txt CMakeLists.txt $(wildcard csrc/*) \
	pz_sparsecore/device/kernels/abi_version.h

.PHONY: demo test test-newest test-asan cuda-check lint bench bench-dlrm bench-large docs readme-figure clean

$(STAMP): $(SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(BUILD_DEPS)
	$(PY) -m pip install -q --no-build-isolation -c constraints.txt -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m pz_sparsecore shakespeare --report reports/shakespeare

# A worker that dies (a crash in a compiled library) ends the run at once,
# naming the test it ran: pytest-xdist 3.8's loadgroup scheduler can wait
# forever for work after replacing a crashed worker.
XDIST := -n 2 --dist loadgroup --max-worker-restart=0

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q $(XDIST)

# The second tested environment: Python 3.12 (from pyenv, or set
# PYTHON_NEWEST) with the newest jax the ranges allow
# (constraints-newest.txt), in .venv-newest, built against that jax. It runs
# the tests of the jax API surface (NEWEST_TESTS): the program compilations,
# the layers, the kernels' lowering, the trainer, checkpoints and compat.
PYTHON_NEWEST ?= $(shell pyenv prefix 3.12 2>/dev/null || \
	echo $(HOME)/.pyenv/versions/3.12.1)/bin/python
VENV_NEWEST := .venv-newest
PY_NEWEST := $(VENV_NEWEST)/bin/python
STAMP_NEWEST := $(VENV_NEWEST)/.installed
NEWEST_TESTS := tests/test_programs.py tests/test_lookup.py \
	tests/test_embed.py tests/test_training.py tests/test_exchange.py \
	tests/test_jit.py tests/test_inplace.py tests/test_kernels.py \
	tests/test_kernel_fuzz.py tests/test_checkpoint.py \
	tests/test_checkpoint_faults.py tests/test_checkpoint_integrity.py \
	tests/test_checkpoint_steps.py tests/test_checkpoint_multiprocess.py \
	tests/test_checkpoint_delta.py \
	tests/test_replication.py tests/test_minibatching_layer.py \
	tests/test_pipelining.py tests/test_compat.py tests/test_compat_device.py \
	tests/test_compat_input_preprocessing.py tests/test_compat_proto.py \
	tests/test_compat_lowering.py tests/test_spec_proto.py \
	tests/test_bad_input.py tests/test_table_dtypes_layer.py \
	tests/test_hashed_map.py tests/test_hashed_tables.py \
	tests/test_hashed_lookup.py tests/test_any_batch.py \
	tests/test_interaction.py tests/test_buffer_alignment.py

$(STAMP_NEWEST): $(SOURCES) constraints-newest.txt
	test -x $(PY_NEWEST) || $(PYTHON_NEWEST) -m venv $(VENV_NEWEST)
	$(PY_NEWEST) -m pip install -q --upgrade pip
	$(PY_NEWEST) -m pip install -q scikit-build-core nanobind \
		-c constraints-newest.txt jax jaxlib
	$(PY_NEWEST) -m pip install -q --no-build-isolation \
		-c constraints-newest.txt -e ".[dev]"
	touch $(STAMP_NEWEST)

test-newest: $(STAMP_NEWEST)
	$(PY_NEWEST) -c "import sys, jax; print('test-newest: Python', \
		sys.version.split()[0], 'jax', jax.__version__)"
	$(PY_NEWEST) -m pytest -q $(XDIST) -p no:cacheprovider \
		$(NEWEST_TESTS)

# The kernel and ragged-reader tests against the kernels and the reader
# built with AddressSanitizer and UndefinedBehaviorSanitizer: a separate
# CMake build (not pip's), loaded through PZSC_FFI_LIBRARY and
# PZSC_RAGGED_LIBRARY, with the sanitizer runtimes preloaded into the
# uninstrumented Python. Any finding fails the target and is printed (the
# reports go to $(ASAN_BUILD)/report.*).
ASAN_BUILD := build/asan
SANITIZE := -fsanitize=address,undefined -fno-omit-frame-pointer \
	-fno-sanitize-recover=undefined
SANITIZER_LOG := $(abspath $(ASAN_BUILD))/report
# libubsan also pulls in libstdc++ before ASan starts (it intercepts throws).
SANITIZER_RUNTIMES = $(shell $(CXX) -print-file-name=libasan.so) \
	$(shell $(CXX) -print-file-name=libubsan.so)

test-asan: $(STAMP)
	cmake -S . -B $(ASAN_BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo \
		-DPython_EXECUTABLE=$(abspath $(PY)) \
		-DCMAKE_CXX_FLAGS="$(SANITIZE)" \
		-DCMAKE_SHARED_LINKER_FLAGS="$(SANITIZE)"
	cmake --build $(ASAN_BUILD) -j 2
	rm -f $(SANITIZER_LOG).*
	LD_PRELOAD="$(SANITIZER_RUNTIMES)" \
	ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:log_path=$(SANITIZER_LOG) \
	UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1:log_path=$(SANITIZER_LOG) \
	PZSC_FFI_LIBRARY="$$(ls $(abspath $(ASAN_BUILD))/_pzsc_ffi*.so)" \
	PZSC_RAGGED_LIBRARY="$$(ls $(abspath $(ASAN_BUILD))/_pzsc_ragged*.so)" \
	$(PY) -m pytest -q -n 2 -p no:cacheprovider \
		tests/test_kernel_fuzz.py tests/test_kernels.py tests/test_sample_order.py \
		tests/test_ragged_input.py tests/test_table_dtypes.py \
		|| { cat $(SANITIZER_LOG).* 2>/dev/null; exit 1; }
	@if ls $(SANITIZER_LOG).* >/dev/null 2>&1; then \
		cat $(SANITIZER_LOG).*; exit 1; fi
	@echo "test-asan: no sanitizer findings"

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: $(STAMP)
	$(PY) -m pip install -q torch==2.13.0 fbgemm-gpu-cpu==1.8.0
	# Upstream's preprocessor, for the side-by-side rows only (its pybind
	# module needs none of its dependencies): never a dependency of ours.
	$(PY) -m pip install -q --no-deps jax-tpu-embedding==0.1.0
	$(PY) benchmarks/preprocess.py
	$(PY) benchmarks/minibatching.py
	$(PY) benchmarks/kernels.py
	$(PY) benchmarks/train_step.py
	$(PY) benchmarks/lookup.py
	$(PY) benchmarks/exchange_bytes.py
	$(PY) benchmarks/pipeline.py
	$(PY) benchmarks/jit_paths.py
	$(PY) benchmarks/table_dtypes.py

# The 26-table DLRM against TorchRec (benchmarks/dlrm.py). TorchRec and the
# modules its import needs, without their dependencies (torch and FBGEMM's
# CPU build are pinned above).
TORCHREC := torchrec==1.8.0 tensordict==0.15.3 pyvers==0.2.3 \
	cloudpickle==3.1.3 pyre-extensions==0.0.32 typing-inspect mypy-extensions
bench-dlrm: $(STAMP)
	$(PY) -m pip install -q torch==2.13.0 fbgemm-gpu-cpu==1.8.0
	$(PY) -m pip install -q --no-deps $(TORCHREC)
	$(PY) benchmarks/dlrm.py

# 24M x 64 float32 rows with Adagrad (about 12 GiB of free memory), then
# 100M x 64 bfloat16 rows with row-wise Adagrad (about 15 GiB).
bench-large: $(STAMP)
	$(PY) benchmarks/large_table.py
	$(PY) benchmarks/large_table.py --rows 100000000 --dtype bfloat16 \
	  --optimizer rowwise_adagrad

# The README's picture (docs/images/shakespeare.png) from the demo's run:
# its shard map and heat map, drawn in headless Chromium.
readme-figure: demo
	$(PY) docs/readme_figure.py reports/shakespeare docs/images/shakespeare.png

docs: $(STAMP)
	$(VENV)/bin/sphinx-build -W --keep-going -b html docs docs/_build/html

clean:
	rm -rf build $(VENV) $(VENV_NEWEST)

# Compiles the CUDA handlers (and the module registering them) with warnings
# as errors for the project's own sources, for every architecture the CUDA
# build targets; no GPU needed. Skipped, saying so, where nvcc is missing.
# CI runs it (.ci/run). The object files stay in build/cuda-check, apart from
# the pip build.
CUDA_CHECK_BUILD := build/cuda-check
cuda-check: $(STAMP)
	@if ! command -v nvcc >/dev/null 2>&1; then \
		echo "cuda-check: no nvcc on this machine, CUDA sources not compiled"; \
		exit 0; fi; \
	cmake -S . -B $(CUDA_CHECK_BUILD) -DCMAKE_BUILD_TYPE=Release \
		-DPython_EXECUTABLE=$(abspath $(PY)) -DPZSC_CUDA=ON \
		-DCMAKE_CXX_FLAGS="-Wall -Wextra -Werror" \
		-DCMAKE_CUDA_FLAGS="-Werror all-warnings -Xcompiler=-Wall,-Wextra,-Werror" \
		>/dev/null && \
	cmake --build $(CUDA_CHECK_BUILD) -j 2 && \
	echo "cuda-check: CUDA handlers compiled without warnings"
