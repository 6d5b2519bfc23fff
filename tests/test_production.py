"""Rundesk as production runs it: DEBUG off, gunicorn, WhiteNoise.

`check --deploy` passes with the settings the README's "Deploying" names
and fails without TLS; the server error page needs nothing that may have
failed; and in Chromium, the web server `make demo` starts (gunicorn on
static files collected with hashed names, against the test database) signs
an operator in, draws a run's timeline with plotly, serves each static file
compressed when asked, and answers an unknown address with the site's 404
page, never a DEBUG page.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from django.contrib.auth.hashers import make_password
from django.contrib.auth.models import User
from django.test import RequestFactory
from django.views.defaults import server_error
from playwright.sync_api import Browser, Page, expect

from dashboard.settings import process_role
from runs.management.commands.demo import site_environment, web_server
from tests.conftest import PASSWORD, ROOT, database_url, python
from tests.test_browser import completed_run

# The timeline and capture are flushed after every test: let them reach the
# database.
pytestmark = pytest.mark.django_db

SECRET_KEY = secrets.token_urlsafe(50)
# What Django's DEBUG pages (technical 404 and 500) say, and never a
# production page.
DEBUG_PAGE = "DEBUG = True"


ASYNC_UNSAFE = "DJANGO_ALLOW_ASYNC_UNSAFE"


def production(var_dir: Path, **extra: str) -> dict[str, str]:
    """The environment of a production process on the test database.  Not
    the browser tests' switch of Django's async guard (conftest.browser,
    set in this test process once one of them ran): `check --deploy`
    refuses it, as it should in production."""
    inherited = {name: value for name, value in os.environ.items() if name != ASYNC_UNSAFE}
    return {
        **inherited,
        "DEBUG": "0",
        "SECRET_KEY": SECRET_KEY,
        "DATABASE_URL": database_url(),
        "RUNDESK_VAR_DIR": str(var_dir),
        "PYTHONUNBUFFERED": "1",
        **extra,
    }


def check_deploy(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


# The production settings the README's "Deploying" section documents.
DEPLOYED = {
    "RUNDESK_TLS": "1",
    "ALLOWED_HOSTS": "rundesk.example.com",
    "CSRF_TRUSTED_ORIGINS": "https://rundesk.example.com",
    "CELERY_BROKER_URL": "redis://127.0.0.1:6379/0",
    "RUNDESK_BROKER_VISIBILITY_TIMEOUT": "7200",
}


def test_check_deploy_passes_with_the_documented_production_settings(tmp_path: Path):
    result = check_deploy(production(tmp_path, **DEPLOYED))
    assert result.returncode == 0, result.stderr
    assert "System check identified no issues" in result.stdout


def test_check_deploy_fails_without_tls(tmp_path: Path):
    plain = {name: value for name, value in DEPLOYED.items() if name != "RUNDESK_TLS"}
    result = check_deploy(production(tmp_path, **plain))
    assert result.returncode != 0
    for warning in ["W004", "W008", "W012", "W016"]:  # HSTS, redirect, both cookies
        assert f"security.{warning}" in result.stderr


def test_check_deploy_warns_of_the_filesystem_broker(tmp_path: Path):
    """Without CELERY_BROKER_URL the web's bundle exports and drills reach
    only a worker on the web's own machine."""
    local = {name: value for name, value in DEPLOYED.items() if name != "CELERY_BROKER_URL"}
    result = check_deploy(production(tmp_path, **local))
    assert result.returncode != 0
    assert "rundesk.W001" in result.stderr and "CELERY_BROKER_URL is not set" in result.stderr
    assert str(tmp_path / "celery-broker") in result.stderr


# A signed-in user's requests (a session cookie) through the whole
# middleware, in a process whose database does not answer.
SIGNED_IN = [("get", "/"), ("get", "/runs/1/"), ("post", "/login/"), ("post", "/runs/1/cancel/")]
SIGNED_IN_REQUESTS = f"""
import django
django.setup()
from django.test import Client
client = Client(raise_request_exception=False)
client.cookies["sessionid"] = "s" * 32
for method, path in {SIGNED_IN!r}:
    response = getattr(client, method)(path, HTTP_HOST="localhost")
    said = "The database did not answer" in response.content.decode()
    print(method, path, response.status_code, response.get("Cache-Control"), said)
"""


def test_a_signed_in_user_is_told_the_database_is_down_not_a_server_error(tmp_path: Path):
    """Reading who is signed in reads the session from the database: with
    a session cookie, every page and form was a 500 while it was down."""
    gone = f"postgres://postgres@127.0.0.1:{free_port()}/gone"
    env = production(
        tmp_path,
        DATABASE_URL=gone,
        DJANGO_SETTINGS_MODULE="dashboard.settings",
        # Production's pool, which waits this long for a connection it
        # cannot make before the page can say so (10 s by default).
        RUNDESK_DB_POOL_TIMEOUT="1",
    )
    result = python(SIGNED_IN_REQUESTS, env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"{method} {path} 503 private, no-store True" for method, path in SIGNED_IN
    ]


def test_tls_switch_and_broker_visibility_timeout_reach_django_and_celery(tmp_path: Path):
    shown = subprocess.run(
        [
            sys.executable,
            "-c",
            "import django; django.setup(); "
            "from django.conf import settings as s; from dashboard.celery import app; "
            "print(s.SESSION_COOKIE_SECURE, s.CSRF_COOKIE_SECURE, s.SECURE_SSL_REDIRECT, "
            "s.SECURE_PROXY_SSL_HEADER, s.SECURE_HSTS_SECONDS, s.CSRF_TRUSTED_ORIGINS, "
            "app.conf.broker_transport_options, app.conf.worker_prefetch_multiplier, "
            "app.conf.task_acks_late)",
        ],
        cwd=ROOT,
        env=production(tmp_path, DJANGO_SETTINGS_MODULE="dashboard.settings", **DEPLOYED),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip() == (
        "True True True ('HTTP_X_FORWARDED_PROTO', 'https') 31536000 "
        "['https://rundesk.example.com'] {'visibility_timeout': 7200.0, "
        "'socket_timeout': 10.0, 'socket_connect_timeout': 10.0} 1 True"
    )


@pytest.mark.parametrize(
    ("argv", "role"),
    [
        (["/srv/.venv/bin/celery", "-A", "dashboard", "worker"], "worker"),
        # `python -m celery`, as the demo starts it: its connections said "web".
        (["/srv/.venv/lib/python3.11/site-packages/celery/__main__.py", "worker"], "worker"),
        (["/srv/app/manage.py", "executor"], "executor"),
        (["/srv/.venv/bin/gunicorn", "dashboard.wsgi"], "web"),
        (["/srv/app/__main__.py"], "web"),
    ],
)
def test_each_process_names_its_role_in_pg_stat_activity(monkeypatch, argv, role):
    monkeypatch.delenv("RUNDESK_ROLE", raising=False)
    monkeypatch.setattr(sys, "argv", argv)
    assert process_role() == role


def test_without_debug_a_secret_key_is_required(tmp_path: Path):
    env = production(tmp_path)
    del env["SECRET_KEY"]
    result = check_deploy(env)
    assert result.returncode != 0
    assert "SECRET_KEY must be set" in result.stderr


@pytest.mark.parametrize(
    ("setting", "value", "said"),
    [
        ("SECRET_KEY", "", "SECRET_KEY must be set"),
        ("RUNDESK_LEASE_SECONDS", "nan", "RUNDESK_LEASE_SECONDS must be from 1.0 to 1e+09"),
        ("RUNDESK_LEASE_SECONDS", "inf", "RUNDESK_LEASE_SECONDS must be from 1.0 to 1e+09"),
        ("RUNDESK_CAPTURE_LOCK_TIMEOUT_MS", "1e12", "RUNDESK_CAPTURE_LOCK_TIMEOUT_MS must be"),
        ("EMAIL_PORT", "70000", "EMAIL_PORT must be from 1 to 65535"),
        ("RUNDESK_LOG_LEVEL", "LOUD", "RUNDESK_LOG_LEVEL must be one of"),
        ("DATABASE_URL", "garbage", "DATABASE_URL is not a database address"),
        ("RUNDESK_DELIVERY_URL", "http://", "RUNDESK_DELIVERY_URL names no host"),
        ("RUNDESK_CORPUS_DIR", "/nonexistent/corpus", "rundesk.E001) RUNDESK_CORPUS_DIR"),
    ],
)
def test_a_setting_no_run_could_work_with_is_refused_naming_it(
    tmp_path: Path, setting, value, said
):
    result = check_deploy(production(tmp_path, **DEPLOYED, **{setting: value}))
    assert result.returncode != 0
    assert said in result.stderr


def test_an_empty_folder_setting_is_its_default_never_the_current_folder(tmp_path: Path):
    shown = subprocess.run(
        [
            sys.executable,
            "-c",
            "import django; django.setup(); from django.conf import settings as s; "
            "print(s.RUNDESK_CORPUS_DIR, s.RUNDESK_OUTBOX_DIR.name, s.RUNDESK_BUNDLE_DIR.name)",
        ],
        cwd=tmp_path,
        env=production(
            tmp_path,
            DJANGO_SETTINGS_MODULE="dashboard.settings",
            PYTHONPATH=str(ROOT),
            RUNDESK_CORPUS_DIR="",
            RUNDESK_OUTBOX_DIR="",
            RUNDESK_BUNDLE_DIR="",
        ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.split() == [
        str(ROOT / "runs" / "agents" / "sample_corpus"),
        "outbox",
        "bundles",
    ]


def test_the_server_error_page_stands_alone():
    """Rendered with no context: it names no URL, static file or user."""
    response = server_error(RequestFactory().get("/runs/1/"))
    assert response.status_code == 500
    page = response.content.decode()
    assert "<h1>Server error</h1>" in page and "web server's log" in page
    assert "/static/" not in page and DEBUG_PAGE not in page


# -- the production web server in Chromium ----------------------------------------


@dataclass
class Site:
    url: str
    log: Path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory, django_db_setup: None) -> Iterator[Site]:
    """gunicorn as `make demo` starts it, with DEBUG off, on static files
    collected with hashed names and compressed copies."""
    var_dir = tmp_path_factory.mktemp("production") / "var"
    collected = subprocess.run(
        [sys.executable, "manage.py", "collectstatic", "--noinput", "--verbosity", "0"],
        cwd=ROOT,
        env=production(var_dir),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert collected.returncode == 0, collected.stderr
    port = free_port()
    log = var_dir / "web.log"
    env = production(var_dir, RUNDESK_ROLE="web", WEB_CONCURRENCY="1", **site_environment(port))
    with log.open("w") as output:
        server = subprocess.Popen(web_server(port), env=env, stdout=output, stderr=output)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not answers(url + "/login/"):
            assert server.poll() is None, f"gunicorn stopped:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"gunicorn did not answer:\n{log.read_text()}"
            time.sleep(0.2)
        yield Site(url, log)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:  # refused, reset, or not yet answering (a loaded machine): not yet
        return False


def visit(page: Page, path: str, status: int) -> None:
    response = page.goto(path)
    assert response is not None and response.status == status, path
    assert DEBUG_PAGE not in page.content(), path


HASHED = {
    "css": re.compile(r"/static/css/rundesk\.[0-9a-f]{12}\.css$"),
    "htmx": re.compile(r"/static/vendor/htmx-2\.0\.11\.min\.[0-9a-f]{12}\.js$"),
    "plotly": re.compile(r"/static/vendor/plotly-basic-[0-9.]+\.min\.[0-9a-f]{12}\.js$"),
}


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_the_production_server_serves_pages_static_files_and_its_own_404(
    site: Site, browser: Browser, operator_user: User
):
    run = completed_run()
    context = browser.new_context(base_url=site.url)
    page = context.new_page()
    static: dict[str, int] = {}
    page.on("response", lambda r: "/static/" in r.url and static.setdefault(r.url, r.status))

    # Signed out, an unknown address: the site's 404 page, in its layout.
    visit(page, "/nope/", 404)
    expect(page.locator("h1")).to_have_text("Not found")
    expect(page.locator("main code")).to_have_text("/nope/")

    # From here on no page is an error (the 404s above and below are, and
    # Chromium says so on the console).
    problems: list[str] = []
    page.on("console", lambda m: m.type == "error" and problems.append(m.text))
    page.on("pageerror", lambda error: problems.append(str(error)))
    visit(page, "/login/", 200)
    # gunicorn checks it with production's hashers, the tests' cheap one not among them.
    operator_user.password = make_password(PASSWORD, hasher="pbkdf2_sha256")
    operator_user.save(update_fields=["password"])
    page.fill("input[name=username]", operator_user.get_username())
    page.fill("input[name=password]", PASSWORD)
    page.click("button[type=submit]")
    expect(page.locator("h1")).to_have_text("Needs you")  # where sign-in lands
    page.get_by_role("link", name="Runs", exact=True).click()
    expect(page.locator("h1")).to_have_text("Runs")
    page.locator("#run-rows tr", has_text="Which fund is cheapest").locator("a").first.click()
    expect(page.locator("#run-live > h1")).to_contain_text(f"Run {run.pk}")
    # plotly.js loaded and drew the timeline.
    expect(page.locator("#chart-timeline svg.main-svg").first).to_be_visible()
    expect(page.locator("#chart-timeline .bars path").first).to_be_attached()
    assert DEBUG_PAGE not in page.content()
    assert problems == []  # console errors, CSP refusals

    visit(page, f"/runs/{run.pk + 1000}/", 404)
    expect(page.locator("main h1")).to_have_text("Not found")
    expect(page.locator("#nav-inbox")).to_be_visible()  # signed in: the whole layout
    context.close()

    assert static and all(status == 200 for status in static.values()), static
    for name, pattern in HASHED.items():
        assert any(pattern.search(url) for url in static), f"{name} not loaded by hashed name"
    for name in ["css", "plotly"]:
        assert_served_compressed(next(url for url in static if HASHED[name].search(url)))
    assert "Traceback" not in site.log.read_text()


def assert_served_compressed(url: str) -> None:
    """The copy the client asks for, cached for good (its name changes with
    its content)."""
    sizes = {}
    for encoding in ["br", "gzip", "identity"]:
        request = urllib.request.Request(url, headers={"Accept-Encoding": encoding})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200
            assert response.headers.get("Content-Encoding") == (
                None if encoding == "identity" else encoding
            )
            assert "immutable" in response.headers["Cache-Control"]
            sizes[encoding] = len(response.read())
    assert sizes["br"] < sizes["identity"] and sizes["gzip"] < sizes["identity"]


def test_every_log_line_has_its_time_level_and_logger(tmp_path: Path):
    """Rundesk's own warnings (evidence capture's, the dashboard's, not only
    the runtime's) and the connection pool's read alike: time, level,
    logger.  The pool's: a connection that died in use, given back to an
    executor's pool."""
    code = (
        "import django; django.setup()\n"
        "import logging\n"
        "from django.db import connection\n"
        "for name in ('runs.executor', 'evidence.capture', 'dashboard.metrics'):\n"
        "    logging.getLogger(name).warning('a warning')\n"
        "connection.ensure_connection()\n"
        "connection.connection.close()  # the connection dies in use\n"
        "connection.close()  # given back to the pool, which discards it\n"
    )
    env = production(tmp_path, RUNDESK_ROLE="executor", RUNDESK_DB_POOL_SIZE="2")
    done = python(code, env)
    assert done.returncode == 0, done.stderr
    when = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"
    for logger, message in [
        ("runs.executor", "a warning"),
        ("evidence.capture", "a warning"),
        ("dashboard.metrics", "a warning"),
        ("psycopg.pool", "discarding closed connection"),
    ]:
        line = rf"^{when} WARNING {re.escape(logger)}: {message}"
        assert re.search(line, done.stderr, re.M), (logger, done.stderr)
