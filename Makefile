# Two commands on a fresh clone:  `make run` (the main job)  and  `make test` (every test).
# Each sets itself up: Debian packages (scripts/setup-system), a venv in .venv, the native build.
PYTHON ?= /usr/bin/python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
NATIVE := native/.built
NATIVE_SOURCES := $(wildcard native/*.c native/*.h) native/build.py

.PHONY: run demo test test-fast lint build bench clean

# The editable install builds the cffi extensions too (setup.py); $(NATIVE) rebuilds them in place
# when a C source changes, without reinstalling.
$(STAMP): pyproject.toml setup.py scripts/setup-system
	scripts/setup-system
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q --upgrade pip
	CMAKE_BUILD_PARALLEL_LEVEL=2 $(PY) -m pip install -q -e '.[test,bench,model]'  # model: llama.cpp builds (~5 min, cached after)
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
