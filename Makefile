# Rundesk.  `make demo` and `make test` work on a fresh machine: they create
# .venv and install from pyproject.toml.  With no DATABASE_URL an embedded
# PostgreSQL starts under var/.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)
# Browser tests drive Debian's Chromium (never a downloaded browser).
CHROMIUM := /usr/bin/chromium

# Local runs only: production sets DEBUG=0 and its own SECRET_KEY.
export DEBUG ?= 1

.PHONY: install demo test lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	rm -f $(VENV)/.installed-*
	touch $@

$(CHROMIUM):
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium

demo: install
	$(PY) manage.py demo

test: install $(CHROMIUM)
	$(PY) -m pytest

lint: install
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

bench: install
	$(PY) manage.py bench --json

clean:
	rm -rf var/outbox var/celery-broker var/celery-processed
