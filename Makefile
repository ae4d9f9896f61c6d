# Two commands on a fresh clone:  `make run` (the main job)  and  `make test` (every test).
# Each sets itself up: Debian packages (scripts/setup-system), a venv in .venv, the native build.
PYTHON ?= /usr/bin/python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
NATIVE := native/.built
NATIVE_SOURCES := $(wildcard native/*.c native/*.h) native/build.py
# llama.cpp's kernels as llama-server's users get them from llama.cpp's own cmake defaults (native CPU flags,
# llamafile's batched kernels: 2x the prompt speed here; llama-cpp-python's build turns llamafile off unless asked);
# and, for the llama handler's deterministic=on, a build without llamafile, whose logits do not depend on how a
# step was batched (docs/MODEL.md, "Right on every CPU"); the same strings as
# edgepath.model.known_answer.LLAMA_CMAKE_ARGS and DETERMINISTIC_CMAKE_ARGS.
LLAMA_CMAKE_ARGS := -DGGML_LLAMAFILE=ON
DETERMINISTIC_CMAKE_ARGS := -DGGML_LLAMAFILE=OFF
DETERMINISTIC := .venv/.deterministic

.PHONY: run demo test test-fast lint build deterministic bench clean

# The editable install builds the cffi extensions too (setup.py); $(NATIVE) rebuilds them in place
# when a C source changes, without reinstalling.
$(STAMP): pyproject.toml bench/pyproject.toml setup.py scripts/setup-system scripts/install-llama
	scripts/setup-system
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q --upgrade pip
	scripts/install-llama $(PY) "$(LLAMA_CMAKE_ARGS)"  # llama.cpp builds once per machine (~5-15 min), cached
	$(PY) -m pip install -q -e '.[test,model]' -e ./bench  # the benchmarks: a distribution of their own
	$(PY) -m edgepath.model.known_answer  # the CPU and llama.cpp's build; fails on a build with other flags
	touch $@

$(NATIVE): $(STAMP) $(NATIVE_SOURCES)
	$(PY) -m edgepath.native.build
	touch $@

build: $(NATIVE)

# The deterministic=on build of llama.cpp (its libraries only, ~5-15 min once per machine): the tests need it,
# `make run` does not.
$(DETERMINISTIC): $(STAMP) scripts/install-llama
	scripts/install-llama --deterministic $(PY) "$(DETERMINISTIC_CMAKE_ARGS)"
	touch $@

deterministic: $(DETERMINISTIC)

run: build
	$(VENV)/bin/edgepath serve --transport quic

demo: build
	$(VENV)/bin/edgepath demo

test: build deterministic
	$(PY) -m pytest $(PYTEST_ARGS)

# The edit loop: everything but the multi-process, long-running tests (marked slow).
test-fast: build deterministic
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

bench: build
	mkdir -p out
	$(PY) -m pytest bench -q --benchmark-enable --benchmark-json=out/bench.json
	$(PY) -m edgepath.bench.report out/bench.json --doc docs/PERFORMANCE.md

lint: build
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	scripts/typecheck

clean:
	rm -rf $(VENV) $(NATIVE) $(DETERMINISTIC) native/_core*.so native/_verbs*.so build edgepath.egg-info
