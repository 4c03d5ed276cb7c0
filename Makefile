# hisparse-jax: `make demo` and `make test` set everything up on a fresh machine.
SHELL := /bin/bash
VENV := .venv
ORACLE_VENV := .venv-oracle
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip -q --disable-pip-version-check
# The transformers oracle (test-only) runs on CPU torch 2.13.0 in its own Python 3.11 venv.
# (accelerate: transformers' loader of FP8 block-quantized checkpoints, which it dequantizes on a CPU)
ORACLE_PKGS := torch==2.13.0 transformers==5.24.0 accelerate==1.16.0 safetensors numpy

.PHONY: demo test test-fast test-asan lint format oracle proto bench clean

$(VENV)/.installed: pyproject.toml CMakeLists.txt $(wildcard xla_ffi/*)
	@py=""; for c in python3.12 python3.13 python3.14 python3; do \
	  if command -v $$c >/dev/null 2>&1 && $$c -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then py=$$c; break; fi; \
	done; \
	if [ -z "$$py" ] && command -v pyenv >/dev/null 2>&1 && [ -x "$$(pyenv prefix 3.12 2>/dev/null)/bin/python3.12" ]; then py="$$(pyenv prefix 3.12)/bin/python3.12"; fi; \
	if [ -z "$$py" ]; then echo "error: hisparse-jax needs Python >= 3.12 (jax >= 0.12 requires it); none found. Install one (e.g. 'pyenv install 3.12') and run make again." >&2; exit 1; fi; \
	if [ ! -x $(PY) ]; then echo "creating $(VENV) with $$($$py --version)"; $$py -m venv $(VENV); fi
	$(PIP) install -U pip
	$(PIP) install "scikit-build-core>=0.10" "nanobind>=2.4" "jaxlib>=0.11.2,<0.12.2" "cmake>=3.24" ninja
	$(PIP) install --no-build-isolation -e '.[test]'
	@touch $@

# Rebuilt when ORACLE_PKGS change (the package list is kept beside the stamp); otherwise made once.
ORACLE_INSTALLED_PKGS := $(shell cat $(ORACLE_VENV)/.packages 2>/dev/null)
$(ORACLE_VENV)/.installed: $(if $(filter-out $(ORACLE_PKGS),$(ORACLE_INSTALLED_PKGS))$(filter-out $(ORACLE_INSTALLED_PKGS),$(ORACLE_PKGS)),FORCE)
	@py=""; if command -v pyenv >/dev/null 2>&1 && [ -x "$$(pyenv prefix 3.11 2>/dev/null)/bin/python3.11" ]; then py="$$(pyenv prefix 3.11)/bin/python3.11"; \
	elif command -v python3.11 >/dev/null 2>&1; then py=python3.11; fi; \
	if [ -z "$$py" ]; then echo "error: the transformers oracle needs Python 3.11 (the machine's CPU torch 2.13.0 wheel is for 3.11)" >&2; exit 1; fi; \
	rm -rf $(ORACLE_VENV); $$py -m venv $(ORACLE_VENV)
	$(ORACLE_VENV)/bin/pip -q --disable-pip-version-check install $(ORACLE_PKGS)
	@echo "$(ORACLE_PKGS)" > $(ORACLE_VENV)/.packages
	@touch $@

FORCE:

oracle: $(ORACLE_VENV)/.installed

demo: $(VENV)/.installed
	@bash scripts/demo.sh

# Two workers, one test module each at a time (module fixtures run once). tests/conftest.py puts the longest
# modules first; --no-loadscope-reorder keeps that order (xdist would otherwise sort modules by test count,
# which left a 4-test module of benchmark runs for the end of the run). A worker that dies ends the run
# (--max-worker-restart 0): under --dist loadfile, xdist's replacement worker can wait forever for work.
PYTEST_WORKERS ?= 2
PYTEST_XDIST := -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder --max-worker-restart 0
test: $(VENV)/.installed $(ORACLE_VENV)/.installed
	$(PY) -m pytest -q $(PYTEST_XDIST) --durations=30 tests

# ruff: the lint rules and formatting of pyproject.toml ([tool.ruff]); `make format` rewrites the tree in place.
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(VENV)/.installed
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# Everything but the transformers oracle comparison.
test-fast: $(VENV)/.installed
	env -u CI HISPARSE_ORACLE_PYTHON=/nonexistent $(PY) -m pytest -q $(PYTEST_XDIST) tests

# Every benchmark of BENCHMARKS.md, results in benchmarks/results/ (about 30 minutes on 2 cores).
RESULTS := benchmarks/results
bench: $(VENV)/.installed $(ORACLE_VENV)/.installed
	@start=$$(date +%s); set -e; \
	$(PY) benchmarks/swap_in.py --out $(RESULTS)/swap_in_cpu; \
	$(PY) benchmarks/miss_rate.py --out $(RESULTS)/miss_rate_calibrated_64k; \
	$(PY) benchmarks/miss_rate.py --context 16384 --out $(RESULTS)/miss_rate_calibrated_16k; \
	$(PY) benchmarks/miss_rate.py --trace-model synthetic --context 16384 --steps 1000 --out $(RESULTS)/miss_rate; \
	$(PY) benchmarks/miss_rate.py --trace-model synthetic --context 65536 --steps 500 --out $(RESULTS)/miss_rate_64k; \
	$(PY) benchmarks/record_trace.py --out $(RESULTS)/topk_trace.npz; \
	$(PY) benchmarks/miss_rate.py --trace $(RESULTS)/topk_trace.npz --out $(RESULTS)/miss_rate_recorded; \
	$(PY) benchmarks/long_context.py --out $(RESULTS)/long_context; \
	$(PY) benchmarks/throughput.py --out $(RESULTS)/throughput; \
	$(PY) benchmarks/vs_transformers.py --out $(RESULTS)/vs_transformers; \
	$(PY) benchmarks/step_floor.py --steps 80 --out $(RESULTS)/step_floor; \
	$(PY) benchmarks/residency.py --out $(RESULTS)/residency; \
	$(PY) benchmarks/prefetch.py --batches 1,8,64 --steps 24 --out $(RESULTS)/prefetch; \
	$(PY) benchmarks/prefetch.py --batches 1,8,64 --steps 24 --depth 1024 --out $(RESULTS)/prefetch_depth1024; \
	$(PY) benchmarks/server_load.py --out $(RESULTS)/server_load; \
	$(PY) benchmarks/connection_flood.py --out $(RESULTS)/connection_flood; \
	$(PY) benchmarks/moe.py --ep 8 --out $(RESULTS)/moe; \
	$(PY) benchmarks/kv_dtype.py --out $(RESULTS)/kv_dtype; \
	$(PY) benchmarks/sharded_load.py --out $(RESULTS)/sharded_load; \
	$(PY) benchmarks/disaggregation.py --out $(RESULTS)/disaggregation; \
	echo "make bench: $$(( $$(date +%s) - start )) s"

proto: $(VENV)/.installed
	$(PIP) install 'grpcio-tools==1.85.1'
	$(PY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. hisparse_jax/proto/hisparse.proto

clean:
	rm -rf build $(VENV) $(ORACLE_VENV)

# The CPU handlers built with AddressSanitizer + UBSan, run under the kernel tests
# (reference comparison, bad input, out-of-range positions). Any report aborts the run.
ASAN_BUILD := build/asan
test-asan: $(VENV)/.installed
	$(VENV)/bin/cmake -S . -B $(ASAN_BUILD) -G Ninja -DHISPARSE_ASAN=ON -DHISPARSE_CUDA=OFF \
	  -DCMAKE_BUILD_TYPE=Debug -DPython_EXECUTABLE=$(abspath $(PY)) > $(ASAN_BUILD).log
	$(VENV)/bin/cmake --build $(ASAN_BUILD) --target _ffi_cpu >> $(ASAN_BUILD).log
	HISPARSE_FFI_CPU_LIB=$$(ls $(ASAN_BUILD)/_ffi_cpu*.so) \
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
	  $(PY) -m pytest -q -p no:cacheprovider tests/test_swap_in_kernel.py
