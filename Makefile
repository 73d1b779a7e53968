PYTHON ?= python3
PIP := $(PYTHON) -m pip install -q --disable-pip-version-check

.PHONY: install demo test bench browser

install:
	$(PIP) -e '.[test]'

## demo: install, fetch the default model (once), and stream a generation with statistics
demo: install
	viasd generate

## test: install, lint (ruff) and type-check (mypy) the code, then run the whole test suite, one worker per core
## (fetches the zoo models it needs once into the cache)
test: install browser
	$(PYTHON) -m ruff check src tests benchmarks
	$(PYTHON) -m mypy
	$(PYTHON) -m pytest -q -n auto --dist worksteal

## browser: Debian's chromium and chromium-driver, for the chat page's test (tests/server/test_page.py), installed
## when missing and running as root with apt-get; elsewhere that test skips, saying why
browser:
	@if command -v chromedriver >/dev/null && { command -v chromium || command -v chromium-browser; } >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "make: installing chromium and chromium-driver (apt-get) for tests/server/test_page.py"; \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; } >/dev/null \
	    || echo "make: apt-get could not install chromium: tests/server/test_page.py will skip"; \
	else echo "make: no chromium/chromedriver (and not root with apt-get): tests/server/test_page.py will skip"; fi

bench:
	$(PIP) -e '.[test]'
	$(PYTHON) benchmarks/core.py
