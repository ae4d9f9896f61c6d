# Two commands on a fresh clone:  `make run` (the main job)  and  `make test` (every test).
# Each sets itself up: Debian packages (scripts/setup-system), a venv in .venv, the native build.
PYTHON ?= /usr/bin/python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
NATIVE := native/.built
NATIVE_SOURCES := $(wildcard native/*.c native/*.h) native/build.py
# llama.cpp without llamafile's batched kernels: a logit must not depend on how its step was batched
# (docs/MODEL.md, "Right on every CPU"); the same string as edgepath.model.known_answer.LLAMA_CMAKE_ARGS.
LLAMA_CMAKE_ARGS := -DGGML_LLAMAFILE=OFF
LLAMA := llama-cpp-python==0.3.36

.PHONY: run demo test test-fast lint build bench clean

# The editable install builds the cffi extensions too (setup.py); $(NATIVE) rebuilds them in place
# when a C source changes, without reinstalling.
$(STAMP): pyproject.toml setup.py scripts/setup-system
	scripts/setup-system
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q --upgrade pip
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=2 $(PY) -m pip install -q -e '.[test,bench,model]'  # model: llama.cpp builds (~5 min, cached after)
	@# pip reuses a wheel it built before whatever CMAKE_ARGS were then: rebuild it when its flags are not ours
	$(PY) -m edgepath.model.known_answer || { CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=2 \
	  $(PY) -m pip install -q --no-cache-dir --force-reinstall --no-deps '$(LLAMA)' && $(PY) -m edgepath.model.known_answer; }
	touch $@

$(NATIVE): $(STAMP) $(NATIVE_SOURCES)
	$(PY) -m edgepath.native.build
	touch $@

build: $(NATIVE)

run: build
	$(VENV)/bin/edgepath serve --transport quic

demo: build
	$(VENV)/bin/edgepath demo

test: build
	$(PY) -m pytest $(PYTEST_ARGS)

# The edit loop: everything but the multi-process, long-running tests (marked slow).
test-fast: build
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

bench: build
	mkdir -p out
	$(PY) -m pytest bench -q --benchmark-enable --benchmark-json=out/bench.json
	$(PY) -m edgepath.bench.report out/bench.json --readme README.md

lint: build
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	scripts/typecheck

clean:
	rm -rf $(VENV) $(NATIVE) native/_core*.so native/_verbs*.so build edgepath.egg-info
