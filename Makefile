PYTHON ?= python3
PIP := $(PYTHON) -m pip install -q --disable-pip-version-check

.PHONY: install demo test bench

install:
	$(PIP) -e '.[test]'

## demo: install, fetch the default model (once), and stream a generation with statistics
demo: install
	viasd generate

## test: install and run the whole test suite, one worker per core (fetches the zoo models it needs once into the cache)
test: install
	$(PYTHON) -m pytest -q -n auto --dist worksteal

bench:
	$(PIP) -e '.[test]'
	$(PYTHON) benchmarks/core.py
