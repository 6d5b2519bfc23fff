# Rundesk.  `make demo` and `make test` work on a fresh machine: they create
# .venv and install from pyproject.toml.  With no DATABASE_URL an embedded
# PostgreSQL starts under var/.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)
# Browser tests drive Debian's Chromium (never a downloaded browser).
CHROMIUM := /usr/bin/chromium
PGBOUNCER := /usr/sbin/pgbouncer
# tests/test_metrics.py checks /metrics with Debian's promtool (package prometheus).
PROMTOOL := /usr/bin/promtool

# Tests and tools run with DEBUG; the demo and the benchmarks run as
# production does (below).
export DEBUG ?= 1

# The demo's secret key: made once, readable by its owner only, kept.
SECRET_KEY_FILE := var/secret-key
# collectstatic's manifest: remade when a static file or the installed
# packages (the admin's files) change.
STATIC_MANIFEST := var/static/staticfiles.json
PRODUCTION := DEBUG=0 SECRET_KEY="$$(cat $(SECRET_KEY_FILE))"

.PHONY: install static demo test lint bench clean plotly

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

# tests/test_pgbouncer.py runs the executor behind Debian's PgBouncer.
$(PGBOUNCER):
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq pgbouncer

# tests/test_metrics.py checks /metrics with promtool.
$(PROMTOOL):
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus

$(SECRET_KEY_FILE): | $(STAMP)
	mkdir -p $(@D)
	umask 077 && $(PY) -c 'import secrets; print(secrets.token_urlsafe(50))' > $@.new
	mv $@.new $@

$(STATIC_MANIFEST): $(STAMP) $(shell find static -type f) | $(SECRET_KEY_FILE)
	$(PRODUCTION) $(PY) manage.py collectstatic --noinput --verbosity 0

static: $(STATIC_MANIFEST)

demo: install static
	$(PRODUCTION) $(PY) manage.py demo

# The suite's processes mostly wait (on PostgreSQL, brokers, workers they
# start): on two cores, three test processes finish it soonest; each has a
# database of its own (tests/conftest.py).  TEST_WORKERS=0 runs it in one.
TEST_WORKERS ?= 3

# The tests' own var/ (their Celery broker folder above all): the tasks the
# runs they make runnable are handed over with never reach the demo's worker.
test: install $(CHROMIUM) $(PGBOUNCER) $(PROMTOOL)
	rm -rf var/test
	RUNDESK_VAR_DIR=$(CURDIR)/var/test $(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal

lint: install
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

# bench --page-load drives Debian's Chromium, as the browser tests do.
bench: install static $(CHROMIUM)
	$(PY) -m pip install --quiet -e '.[test,bench]'
	$(PRODUCTION) $(PY) manage.py migrate --verbosity 0
	$(PRODUCTION) $(PY) manage.py bench --all --json --markdown docs/BENCHMARKS.md

# The plotly.js the pages load: the official partial bundle with the trace
# types the charts draw (scatter, bar; pie comes with it), of the plotly.js
# version the installed plotly package was built for.  The vendored file is
# committed; this updates it, and the two places that name it.
PLOTLY_JS_VERSION := 4.1.1

plotly:
	tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	(cd "$$tmp" && npm pack --silent plotly.js-basic-dist-min@$(PLOTLY_JS_VERSION) >/dev/null && tar xzf *.tgz) && \
	rm -f static/vendor/plotly-basic-*.min.js static/vendor/plotly-basic-*.LICENSE && \
	cp "$$tmp/package/plotly-basic.min.js" static/vendor/plotly-basic-$(PLOTLY_JS_VERSION).min.js && \
	cp "$$tmp/package/LICENSE" static/vendor/plotly-basic-$(PLOTLY_JS_VERSION).LICENSE
	sed -i 's/plotly-basic-[0-9.]*[0-9]\.min\.js/plotly-basic-$(PLOTLY_JS_VERSION).min.js/' \
		templates/base.html evidence/bundle_report.py

clean:
	rm -rf var/outbox var/celery-broker var/celery-processed var/static
