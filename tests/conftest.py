from __future__ import annotations

import functools
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from django.conf import global_settings
from django.conf import settings as django_settings
from django.contrib.auth.models import Group, Permission, User
from django.db import connection, connections, transaction
from django.test import Client, TransactionTestCase
from playwright.sync_api import Browser, Page, sync_playwright
from psycopg import sql

from evidence.capture import Copy, capture
from evidence.records import record_model_call, record_source
from runs import submission
from runs.harness import Journal, database_url
from runs.leases import Lease
from runs.models import Run, digest
from runs.timeline import timeline
from tests.faultruns import DOCS

ROOT = Path(__file__).resolve().parent.parent

# Production's password hash costs 0.6 s a user, and most tests make one: the
# tests hash with MD5 first, and keep production's hashers after it, so a
# password made for a production process (tests/test_production.py) is
# still made, and checked, the production way.
django_settings.PASSWORD_HASHERS = [
    "django.contrib.auth.hashers.MD5PasswordHasher",
    *global_settings.PASSWORD_HASHERS,
]


# -- one database per xdist worker, cloned from one migrated template ----------------


@pytest.fixture(scope="session")
def django_db_modify_db_settings_xdist_suffix() -> None:
    """The test database's name stays unsuffixed: under xdist it is the
    template that django_db_setup migrates once and clones per worker."""


@pytest.fixture(scope="session")
def django_db_setup(
    request: pytest.FixtureRequest,
    django_test_environment: None,
    django_db_blocker: object,
    django_db_modify_db_settings: None,
    django_db_keepdb: bool,
) -> Iterator[None]:
    """The test database: migrated as Django makes it; under xdist, the
    first worker migrates a template (test_<name>) once per run and each
    worker clones its own (test_<name>_gw0, ...) from it, so the workers
    share no table, lock or session.  The workers take turns on a session
    lock of the server's (an advisory lock in its maintenance database), and
    the template says which run made it (its comment: xdist's testrunuid)."""
    verbosity = request.config.option.verbose
    workerinput = getattr(request.config, "workerinput", None)
    creation = connection.creation
    with django_db_blocker.unblock():
        if workerinput is None:
            old_name = creation.create_test_db(
                verbosity, autoclobber=True, serialize=False, keepdb=django_db_keepdb
            )
        else:
            old_name, template = connection.settings_dict["NAME"], _template_name()
            run = workerinput["testrunuid"]
            with creation._nodb_cursor() as turns:
                turns.execute("SELECT pg_advisory_lock(hashtext(%s))", [template])
                try:
                    turns.execute(
                        "SELECT shobj_description(oid, 'pg_database') FROM pg_database"
                        " WHERE datname = %s",
                        [template],
                    )
                    made_by = turns.fetchone()
                    if made_by is None or made_by[0] != run:
                        creation.create_test_db(verbosity, autoclobber=True, serialize=False)
                        with connection.cursor() as cursor:
                            cursor.execute(
                                f"COMMENT ON DATABASE {connection.ops.quote_name(template)} IS %s",
                                [run],
                            )
                    connection.settings_dict["NAME"] = template
                    creation.clone_test_db(workerinput["workerid"], verbosity, autoclobber=True)
                finally:
                    turns.execute("SELECT pg_advisory_unlock(hashtext(%s))", [template])
            connection.settings_dict.update(
                creation.get_test_db_clone_settings(workerinput["workerid"])
            )
    yield
    if workerinput is not None or not django_db_keepdb:
        with django_db_blocker.unblock():
            _end_other_sessions(connection.settings_dict["NAME"])
            creation.destroy_test_db(old_name, verbosity)


def _end_other_sessions(database: str, timeout: float = 10.0) -> None:
    """Ends the sessions still on `database` (a writer thread's, a process a
    test left behind) and waits until they are gone: the database is
    dropped next, and a DROP DATABASE refuses one that has any."""
    connection.close()
    deadline = time.monotonic() + timeout
    with connection.creation._nodb_cursor() as cursor:
        while True:
            cursor.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE datname = %s AND pid <> pg_backend_pid()",
                [database],
            )
            if cursor.fetchone()[0] == 0 or time.monotonic() > deadline:
                return
            time.sleep(0.05)


def _template_name() -> str:
    """test_<name>: what Django names the test database."""
    return connection.creation._get_test_db_name()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that start real processes first, in their files' order:
    xdist's workers share the rest, short ones, at the end, instead of one
    worker finishing a 20-second test while the other has nothing left."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """xdist's controller drops the template its workers cloned (on a
    connection of its own: the controller is not let use Django's)."""
    config = session.config
    if getattr(config, "workerinput", None) is not None or not config.getoption("numprocesses", 0):
        return
    params = {**connection.get_connection_params(), "dbname": "postgres"}
    with psycopg.connect(**params, autocommit=True) as maintenance:
        maintenance.execute(
            sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(_template_name()))
        )


# -- what a transactional test leaves is emptied, narrowly --------------------------

# What migrate made that no test changes: Django's flush empties these too,
# then makes every content type and permission again (a third of a second
# a test, on two cores); here they are kept.
KEPT_TABLES = frozenset({"django_content_type", "auth_permission"})


@functools.cache
def _emptied_tables(alias: str) -> tuple[str, ...]:
    tables = connections[alias].introspection.django_table_names(
        only_existing=True, include_views=False
    )
    return tuple(sorted(set(tables) - KEPT_TABLES))


@functools.cache
def _superuser(alias: str) -> bool:
    with connections[alias].cursor() as cursor:
        cursor.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
        return cursor.fetchone()[0]


def _empty_tables_that_got_rows(test: TransactionTestCase) -> None:
    """A transactional test's teardown: the tables that got rows are
    emptied, the others are left as they are, and content types and
    permissions are kept; what Django's flush leaves is the same, at a
    fraction of its cost.  A test that asks for more (available apps,
    serialized rollback, reset sequences) gets Django's own flush.
    Emptied by DELETE, in one transaction that first locks them as a
    TRUNCATE would (a write still in flight ends first): a TRUNCATE makes
    new files for each table it empties and each that references one,
    ~120 ms a test, where deleting a test's few rows takes a few.  The
    triggers that keep rows immutable, and the foreign keys' checks, are
    off for that transaction (session_replication_role, which only a
    superuser may set; another user's tests truncate)."""
    if test.available_apps is not None or test.serialized_rollback or test.reset_sequences:
        _flush_everything(test)
        return
    for alias in test._databases_names(include_mirrors=False):
        conn = connections[alias]
        quote = conn.ops.quote_name
        with conn.cursor() as cursor:
            cursor.execute(
                " UNION ALL ".join(
                    f"SELECT %s WHERE EXISTS (SELECT FROM {quote(table)})"
                    for table in _emptied_tables(alias)
                ),
                _emptied_tables(alias),
            )
            filled = [quote(table) for (table,) in cursor.fetchall()]
            if not filled:
                continue
            if not _superuser(alias):
                cursor.execute(f"TRUNCATE {', '.join(filled)} CASCADE")
                continue
            with transaction.atomic(using=alias):
                cursor.execute("SET LOCAL session_replication_role = replica")
                cursor.execute(f"LOCK TABLE {', '.join(filled)} IN EXCLUSIVE MODE")
                for table in filled:
                    cursor.execute(f"DELETE FROM {table}")


_flush_everything = TransactionTestCase._fixture_teardown
TransactionTestCase._fixture_teardown = _empty_tables_that_got_rows


@pytest.fixture
def evidence() -> tuple[Run, Lease, Copy]:
    """A leased run with one source and one model call, its copy not saved
    yet (tests/test_capture.py, tests/test_capture_retry.py)."""
    run = submission.submit(question="q", documents=DOCS[:1])
    lease = Lease.claim(run.pk, "owner")
    assert lease is not None
    read = {"path": DOCS[0], "sha256": "ab" * 32, "bytes": 10, "text": "x"}
    read_id = lease.record_boundary(
        step_key="read:0", kind="read_document", effect_class="read", input={"path": DOCS[0]}
    )
    lease.record_receipt(read_id, read)
    record_source(run.pk, read_id, DOCS[0], read["sha256"], read["bytes"])
    call_id = lease.record_boundary(
        step_key="summarize:0", kind="model_call", effect_class="read", input={"m": 1}
    )
    lease.record_receipt(call_id, {"provider": "offline", "text": "summary"})
    model_call = record_model_call(
        run.pk, call_id, "offline", digest({"m": 1}), digest({"text": "summary"}), [DOCS[0]]
    )
    return run, lease, Copy(run.pk, model_call, "input", "output")


@pytest.fixture
def file_syncs(monkeypatch) -> list[tuple[str, str]]:
    """What the process links and syncs, in order: ("link", target) and
    ("fsync", the synced file or folder); both still done."""
    done: list[tuple[str, str]] = []
    link, fsync = os.link, os.fsync

    def linked(source, target, *args, **kwargs):
        link(source, target, *args, **kwargs)
        done.append(("link", str(target)))

    def synced(fd):
        fsync(fd)
        done.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))

    monkeypatch.setattr(os, "link", linked)
    monkeypatch.setattr(os, "fsync", synced)
    return done


@pytest.fixture(scope="session", autouse=True)
def _stop_timeline(django_db_setup: None, django_db_blocker: object) -> Iterator[None]:
    """The timeline and capture threads hold connections to the test
    database: close them before the database is dropped."""
    yield
    timeline.stop()
    capture.stop()


@pytest.fixture(autouse=True)
def _timeline_written() -> Iterator[None]:
    """Each test's events and capture gaps are written before the next test
    starts (the next one may not be allowed to touch the database)."""
    yield
    timeline.flush()
    capture.flush()
    if len(capture.retries):
        # Copies a test's contention kept to be tried again end with it (as
        # at shutdown: gaps that say so), not in a later test.
        capture.stop()


@pytest.fixture(autouse=True)
def _no_write_left_in_flight(request: pytest.FixtureRequest) -> Iterator[None]:
    """A fault plan's late write (outcome "late") stays in flight for its
    stall_ms, and may outlive the test that saw what it needed of it: its
    backend then holds its locks while the tables are emptied for the next
    test, and the two deadlock.  Up to 30 s, it is waited for."""
    yield
    marker = request.node.get_closest_marker("django_db")
    if marker is None or not marker.kwargs.get("transaction"):
        return  # a test in a transaction: its tables are rolled back, not emptied
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE datname = current_database()"
                " AND wait_event = 'PgSleep' AND pid <> pg_backend_pid())"
            )
            if not cursor.fetchone()[0]:
                return
        time.sleep(0.05)


@pytest.fixture
def short_settle(settings: object) -> None:
    """Unanswered writes are asked about for 1.5 s, not the default 5."""
    settings.RUNDESK_SETTLE_SECONDS = 1.5


# -- who is signed in ------------------------------------------------------------

PASSWORD = "a-long-password-1"


def make_user(name: str, *, operator: bool = False) -> User:
    """A user of the viewers group, or of the operators group (which has the
    operator permission, runs.operate_run), as migration 0005 makes them;
    transactional tests empty the tables between tests, so made again here."""
    group, _ = Group.objects.get_or_create(name="operators" if operator else "viewers")
    if operator:
        group.permissions.add(Permission.objects.get(codename="operate_run"))
    user = User.objects.create_user(name, password=PASSWORD)
    user.groups.add(group)
    return User.objects.get(pk=user.pk)  # permissions are cached per instance


def signed_in(user: User, **client_options: object) -> Client:
    """A test client signed in as `user`."""
    client = Client(**client_options)
    client.force_login(user)
    return client


@pytest.fixture
def operator_name() -> str:
    """The operator's user name: a module whose pages name the operator
    overrides this fixture."""
    return "operator"


@pytest.fixture
def operator_user(operator_name: str) -> User:
    """A user with the operator permission."""
    return make_user(operator_name, operator=True)


@pytest.fixture
def operator(operator_user: User) -> Client:
    """A client signed in as the operator."""
    return signed_in(operator_user)


@pytest.fixture
def viewer() -> Client:
    """A client signed in as a viewer: reads every page, decides nothing."""
    return signed_in(make_user("viewer"))


@pytest.fixture
def staff() -> Client:
    """A client signed in as a superuser, for the admin."""
    return signed_in(User.objects.create_superuser("admin", password=PASSWORD))


@pytest.fixture
def journal(tmp_path: Path, settings: object) -> Journal:
    path = tmp_path / "tool-journal.jsonl"
    settings.RUNDESK_TOOL_JOURNAL = str(path)
    return Journal(path)


# The decision table's and resume's tests look for a checkpoint after the
# actions they break or resume from: here one is due after every action
# (the production cadence, every 100 steps or 0.5 s, has its own tests in
# test_checkpoints.py and test_one_commit_per_step.py, and is what bench
# measures).
CHECKPOINT_EVERY = 1


@pytest.fixture(autouse=True)
def _checkpoint_every_action(settings: object) -> None:
    settings.RUNDESK_CHECKPOINT_EVERY = CHECKPOINT_EVERY


@pytest.fixture(autouse=True)
def _outbox(tmp_path: Path, settings: object) -> Path:
    settings.RUNDESK_OUTBOX_DIR = tmp_path / "outbox"
    return settings.RUNDESK_OUTBOX_DIR


@pytest.fixture
def process_env(tmp_path: Path, journal: Journal) -> dict[str, str]:
    """Environment for a real executor or worker process on the test database."""
    env = {
        **os.environ,
        "DATABASE_URL": database_url(),
        "DEBUG": "1",
        "RUNDESK_VAR_DIR": str(tmp_path / "var"),
        "RUNDESK_TOOL_JOURNAL": str(journal.path),
        "RUNDESK_OUTBOX_DIR": str(tmp_path / "outbox"),
        "RUNDESK_CORPUS_DIR": str(django_settings.RUNDESK_CORPUS_DIR),
        "RUNDESK_LEASE_SECONDS": "2",
        "RUNDESK_CHECKPOINT_EVERY": str(CHECKPOINT_EVERY),
        "RUNDESK_POLL_SECONDS": "0.2",
        "PYTHONUNBUFFERED": "1",
    }
    return env


def manage(*args: str, env: dict[str, str], **kwargs: object) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(ROOT / "manage.py"), *args],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def python(
    code: str, env: dict[str, str], timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """`python -c code` in the project's folder, its output captured."""
    return subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# -- a real browser ---------------------------------------------------------------

CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(scope="session")
def browser() -> Iterator[Browser]:
    """Debian's Chromium, started once per test process (an xdist worker)
    by the first test that asks, for every browser test after it."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs Debian's chromium")
    # Playwright's sync API keeps an event loop running on this thread from
    # now on; the ORM calls the tests make (between browser steps, and in
    # the tests after) are plain sync code: Rundesk has no async code for
    # Django's guard to protect.
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            yield browser
            browser.close()
    finally:
        del os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"]


@pytest.fixture
def page(browser: Browser, live_server, operator_user: User) -> Iterator[Page]:
    """Chromium signed in as the operator: with the session cookie a sign-in
    gives (the sign-in form itself, in a browser, is
    tests/test_browser_needs_you.py's; through it, each test took a second
    more)."""
    context = browser.new_context(base_url=live_server.url, viewport={"width": 1280, "height": 900})
    session = signed_in(operator_user).cookies[django_settings.SESSION_COOKIE_NAME].value
    context.add_cookies(
        [{"name": django_settings.SESSION_COOKIE_NAME, "value": session, "url": live_server.url}]
    )
    page = context.new_page()
    page.problems = []  # type: ignore[attr-defined]
    page.on(
        "console",
        lambda message: message.type == "error" and page.problems.append(message.text),  # type: ignore[attr-defined]
    )
    page.on("pageerror", lambda error: page.problems.append(str(error)))  # type: ignore[attr-defined]
    yield page
    assert page.problems == []  # type: ignore[attr-defined]  # console errors, CSP refusals
    context.close()
