# Two commands do all set-up on a fresh machine:
#   make quickstart   create .venv, install, prepare the bundled Wikipedia sample, train, export, evaluate
#   make test         install the test extras, build the docs (mkdocs --strict, seconds), check the import
#                     contracts (lint-imports) and run the test suite
# The docs alone: make docs (into site/); preview: .venv/bin/mkdocs serve -a 127.0.0.1:8000
VENV ?= .venv
PY := $(VENV)/bin/python
SHARDS ?= runs/shards/enwiki-sample
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export DS_ACCELERATOR ?= cpu
export HF_HUB_OFFLINE ?= 1
export DS_BUILD_OPS := 0
# mkdocs-material prints a banner about its successor on every build unless this is set
export NO_MKDOCS_2_WARNING ?= 1

.PHONY: install install-test quickstart test docs clean

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
	$(PY) -m data_prep wiki --input data_prep/samples/*.bz2 --out $(SHARDS) --shard-size-mb 0.25
	rm -rf runs/quickstart
	$(PY) -m clsys.pretrain

# The docs first: fast, and a broken link, a page left out of the nav or a config field without a
# meaning (docs/hooks/config_reference.py) fails early. Never --quiet: it hides the warnings that --strict
# counts, and the build passes (tests/test_docs_build.py). Then the import contracts (pyproject.toml's
# [tool.importlinter], a second): which way imports may go between clsys's packages and data_prep.
test: install-test
	$(PY) -m mkdocs build --strict --site-dir site
	$(VENV)/bin/lint-imports --no-logo --no-cache
	$(PY) -m pytest -q -ra -n 2 tests

docs: install-test
	$(PY) -m mkdocs build --strict --site-dir site

clean:
	rm -rf runs site
