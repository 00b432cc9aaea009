# Two commands do all set-up on a fresh machine:
#   make quickstart   create .venv, install, prepare the bundled Wikipedia sample, train, export, evaluate
#   make test         install the test extras and run the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
SHARDS ?= runs/shards/enwiki-sample
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export DS_ACCELERATOR ?= cpu
export HF_HUB_OFFLINE ?= 1
export DS_BUILD_OPS := 0

.PHONY: install install-test quickstart test clean

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build; an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[test]'
	touch $@

quickstart: install
	$(PY) -m data_prep wiki --input data_prep/samples/*.bz2 --out $(SHARDS) --shard-size-mb 4
	rm -rf runs/quickstart
	$(PY) -m clsys.pretrain

test: install-test
	$(PY) -m pytest -q -ra tests

clean:
	rm -rf runs
