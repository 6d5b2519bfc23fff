"""`bench --page-load`: cold page-to-chart time in Chromium, the time from
asking for a run page (or a lock incident's page) to its plotly chart on
screen, with an empty browser cache each time.

The pages are served as production serves them (the settings of the
command, WhiteNoise's hashed and compressed static files: `make bench`
collects them first) by Django's threaded development server on a port of
its own, from the small database of `bench --dashboard` (made or reused).
The browser is Debian's Chromium, driven by Playwright, signed in as a
viewer.  A console error fails the benchmark: a trace type missing from the
vendored plotly.js bundle shows as one, and a chart that never draws would
otherwise be timed as a timeout.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.core.servers.basehttp import ThreadedWSGIServer, WSGIRequestHandler
from django.core.wsgi import get_wsgi_application
from django.test import Client

from evidence.models import LockIncident
from runs.benchmarks.pages import SCALES, bench_database, seed
from runs.models import Run

CHROMIUM = "/usr/bin/chromium"
LOADS = 10  # cold loads per page
CHART = ".chart .main-svg"  # what plotly draws into the page's chart element
PATIENCE_MS = 30_000


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass


@contextmanager
def _server() -> Iterator[str]:
    """The site on a free port of 127.0.0.1 (an address ALLOWED_HOSTS
    accepts); its base URL."""
    server = ThreadedWSGIServer(("127.0.0.1", 0), _QuietHandler)
    server.set_app(get_wsgi_application())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _session_cookie() -> str:
    user, _ = User.objects.get_or_create(username="bench-viewer")
    client = Client(HTTP_HOST="127.0.0.1")
    client.force_login(user)
    return client.cookies[settings.SESSION_COOKIE_NAME].value


def _cold_loads(base: str, path: str, cookie: str) -> list[tuple[float, int]]:
    """Milliseconds from navigation to the chart, and the bytes of the
    page's HTML, LOADS times."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            return [_cold_load(browser, base + path, cookie) for _ in range(LOADS)]
        finally:
            browser.close()


def _cold_load(browser: Any, url: str, cookie: str) -> tuple[float, int]:
    """One load in a fresh browser context: no cache, no compiled scripts
    kept from an earlier load."""
    context = browser.new_context()
    try:
        context.add_cookies([{"name": settings.SESSION_COOKIE_NAME, "value": cookie, "url": url}])
        page = context.new_page()
        errors: list[str] = []
        page.on("console", lambda message: message.type == "error" and errors.append(message.text))
        page.on("pageerror", lambda error: errors.append(str(error)))
        start = time.perf_counter()
        response = page.goto(url, wait_until="commit")
        page.wait_for_selector(CHART, state="attached", timeout=PATIENCE_MS)
        elapsed = (time.perf_counter() - start) * 1000
        html_bytes = len(response.body()) if response else 0
    finally:
        context.close()
    if errors:
        raise RuntimeError(f"{url}: console errors: {errors}")
    return elapsed, html_bytes


def measure() -> list[dict[str, Any]]:
    with bench_database("rundesk_bench_small"):
        seed(*SCALES["small"])
        run = Run.objects.filter(actions__isnull=False).order_by("-pk").first()
        incident = LockIncident.objects.order_by("-pk").first()
        if run is None or incident is None:
            raise RuntimeError("the bench database has no run with actions or no lock incident")
        cookie = _session_cookie()
        pages = {"run page": f"/runs/{run.pk}/", "lock incident page": f"/locks/{incident.pk}/"}
        with _server() as base:
            timings = {name: _cold_loads(base, path, cookie) for name, path in pages.items()}
    return [
        {
            "page": name,
            "loads": len(loads),
            "p50_ms": round(statistics.median(ms for ms, _ in loads), 1),
            "max_ms": round(max(ms for ms, _ in loads), 1),
            "html_bytes": max(size for _, size in loads),
        }
        for name, loads in timings.items()
    ]
