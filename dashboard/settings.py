"""Rundesk settings, read from the environment.

Every value comes from an environment variable through a small helper that
fails loudly (ImproperlyConfigured) on a value it cannot read. With no
DATABASE_URL the project starts an embedded PostgreSQL under var/; with no
CELERY_BROKER_URL Celery uses kombu's filesystem transport under var/.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import ipaddress
import os
import sys
import urllib.parse
from pathlib import Path

import dj_database_url
from celery.schedules import crontab
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.core.exceptions import ImproperlyConfigured

from runs import durations
from runs.sql import application_name

BASE_DIR = Path(__file__).resolve().parent.parent


def env_str(name: str, default: str | None = None) -> str:
    """A setting's text; set but empty is unset (an empty folder setting
    would be the current folder: RUNDESK_CORPUS_DIR= would let runs read
    whatever is where the process starts)."""
    value = os.environ.get(name) or default
    if value is None:
        raise ImproperlyConfigured(f"{name} must be set")
    return value


VAR_DIR = Path(env_str("RUNDESK_VAR_DIR", str(BASE_DIR / "var")))


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    lowered = raw.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ImproperlyConfigured(f"{name} must be a boolean (1/0, true/false), got {raw!r}")


def env_list(name: str, default: str = "") -> list[str]:
    """A comma-separated list; blanks dropped."""
    return [item.strip() for item in os.environ.get(name, default).split(",") if item.strip()]


def env_float(name: str, default: float, *, minimum: float = 0.0, maximum: float = 1e9) -> float:
    """A number from `minimum` to `maximum` (a billion seconds is 31 years:
    more is a typo, and inf or nan would fail later, far from the setting)."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be a number, got {raw!r}") from None
    if not minimum <= value <= maximum:  # false for nan too
        raise ImproperlyConfigured(f"{name} must be from {minimum} to {maximum:g}, got {raw!r}")
    return value


def var_folder(*parts: str) -> Path:
    """A folder under RUNDESK_VAR_DIR, made if missing; one that cannot be
    made is a setting to fix, said as one."""
    folder = VAR_DIR.joinpath(*parts)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ImproperlyConfigured(
            f"RUNDESK_VAR_DIR: cannot make {folder}: {error.strerror or error}"
        ) from None
    return folder


def env_networks(name: str) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """A comma-separated list of addresses or networks (10.0.0.5, 10.0.0.0/8, ::1)."""
    networks = []
    for item in env_list(name):
        try:
            networks.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise ImproperlyConfigured(
                f"{name}: {item!r} is not an address or a network (10.0.0.0/8)"
            ) from None
    return networks


def env_duration(name: str) -> dt.timedelta | None:
    """A duration (runs/durations.py: 90d, 12h, P30D); None when unset."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return durations.parse(raw)
    except ValueError as error:
        raise ImproperlyConfigured(f"{name}: {error}") from None


def env_choice(name: str, default: str, choices: set[str]) -> str:
    value = os.environ.get(name) or default
    if value not in choices:
        raise ImproperlyConfigured(f"{name} must be one of {sorted(choices)}, got {value!r}")
    return value


def env_url(name: str) -> str:
    """An http(s) URL, or empty.  Other schemes (file:, ftp:) are refused:
    the tools open these URLs."""
    value = os.environ.get(name, "").strip()
    if value and not value.startswith(("http://", "https://")):
        raise ImproperlyConfigured(f"{name} must be an http:// or https:// URL, got {value!r}")
    if value and not urllib.parse.urlsplit(value).hostname:
        raise ImproperlyConfigured(f"{name} names no host: {value!r}")
    return value


def env_signing_key(name: str) -> bytes | None:
    """An Ed25519 private key, as its 32-byte seed: given as the base64 of
    those 32 bytes, or as a PEM private key (`openssl genpkey -algorithm
    ed25519`); None when unset."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    if raw.startswith("-----BEGIN"):
        try:
            key = serialization.load_pem_private_key(raw.encode(), password=None)
        except (ValueError, TypeError) as error:
            raise ImproperlyConfigured(f"{name} is not a PEM private key: {error}") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise ImproperlyConfigured(f"{name} must be an Ed25519 key, got {type(key).__name__}")
        return key.private_bytes_raw()
    return _base64_key(name, raw, "private key")


def env_public_keys(name: str) -> dict[str, bytes]:
    """Named Ed25519 public keys, `NAME=BASE64` pairs separated by commas
    (the line `verify_bundle --public-key` prints); each key as its 32 bytes."""
    keys: dict[str, bytes] = {}
    for item in env_list(name):
        key_name, _, key = item.partition("=")
        key_name = key_name.strip()
        if not key_name or not key.strip():
            raise ImproperlyConfigured(f"{name}: {item!r} is not NAME=PUBLIC_KEY")
        if key_name in keys:
            raise ImproperlyConfigured(f"{name}: the name {key_name!r} is given twice")
        keys[key_name] = _base64_key(name, key.strip(), f"public key {key_name!r}")
    return keys


def _base64_key(name: str, text: str, what: str) -> bytes:
    try:
        key = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ImproperlyConfigured(f"{name}: the {what} is not base64") from None
    if len(key) != 32:
        raise ImproperlyConfigured(f"{name}: the {what} must be 32 bytes (Ed25519), got {len(key)}")
    return key


def process_role() -> str:
    """Names this process in pg_stat_activity (application_name) so a lock
    graph can say who is who: rundesk:executor, rundesk:web, rundesk:worker."""
    if role := os.environ.get("RUNDESK_ROLE"):
        return role
    started = Path(sys.argv[0]) if sys.argv else Path()
    program = started.name
    # `celery ...`, or `python -m celery ...` (argv[0] is celery/__main__.py).
    if program == "celery" or (program == "__main__.py" and started.parent.name == "celery"):
        return "worker"
    if program == "manage.py" and len(sys.argv) > 1:
        return {"runserver": "web"}.get(sys.argv[1], sys.argv[1])
    if "pytest" in program:
        return "test"
    return "web"


def embedded_database_url() -> str:
    """Starts (or joins) the embedded PostgreSQL under var/postgres.

    pgserver keeps one server per data folder and stops it when the last
    process that asked for it exits, so `make demo`'s processes share one.
    """
    import json

    import pgserver

    pgdata = VAR_DIR / "postgres"
    var_folder()
    # pgserver counts the processes using the server in this file but never
    # forgets one that was killed; forget those, or the server never stops.
    handles = pgdata / ".handle_pids.json"
    if handles.exists():
        live = [pid for pid in json.loads(handles.read_text() or "[]") if _alive(pid)]
        handles.write_text(json.dumps(live))
    server = pgserver.get_server(pgdata, cleanup_mode="stop")
    return server.get_uri()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


DEBUG = env_bool("DEBUG", False)
SECRET_KEY = env_str("SECRET_KEY", "insecure-development-key-for-debug-only" if DEBUG else None)
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", "127.0.0.1,localhost")
# Origins (scheme://host[:port]) a form may be posted from besides the host
# itself: the public https:// address when a proxy in front rewrites Host.
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS")
# A refused form says which check failed (Django gives its own page no reason).
CSRF_FAILURE_VIEW = "dashboard.security.csrf_failure"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django.contrib.postgres",
    "django_htmx",
    "template_partials",
    "runs",
    "evidence",
    "dashboard",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    # Static files before anything that reads a session or the database.
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "dashboard.security.RequestSizeLimitMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "dashboard.security.SignInMiddleware",  # LoginRequiredMiddleware, as a browser needs it
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    "dashboard.security.ContentSecurityPolicyMiddleware",
    "dashboard.security.FormAddressMiddleware",
    "dashboard.security.PrivatePagesMiddleware",
    # Innermost: around the view alone.
    "dashboard.security.PageLockWaitsMiddleware",
]

ROOT_URLCONF = "dashboard.urls"
WSGI_APPLICATION = "dashboard.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "dashboard.context.inbox",
            ],
        },
    }
]

DATABASE_URL = os.environ.get("DATABASE_URL") or embedded_database_url()
PROCESS_ROLE = process_role()
try:
    DATABASES = {"default": dj_database_url.parse(DATABASE_URL, conn_max_age=60)}
except (ValueError, KeyError) as error:
    raise ImproperlyConfigured(f"DATABASE_URL is not a database address: {error}") from None
if DATABASES["default"]["ENGINE"] != "django.db.backends.postgresql":
    raise ImproperlyConfigured("DATABASE_URL must point at PostgreSQL: Rundesk relies on its locks")
# Django's PostgreSQL backend, whose pooled connections are taken again
# cheaply (a run takes one per action): runs/postgresql/base.py.
DATABASES["default"]["ENGINE"] = "runs.postgresql"
DATABASES["default"].setdefault("OPTIONS", {}).update(
    application_name=application_name(PROCESS_ROLE),
    # Django's own (client-side binding) cursors never prepare; this lets the
    # lease's per-step statements (runs/leases.py) be prepared once per
    # connection.  A transaction-mode pooler needs PgBouncer >= 1.21.
    prepare_threshold=5,
)
# The process's connections (issue 39): one pool per process, shared by all
# its threads (runs in flight, the lease renewal, the timeline, capture,
# the lock sampler), RUNDESK_DB_POOL_SIZE connections at most.  A thread
# takes one for its statements and gives it back (runs.sql.release_connection)
# before it waits; 0 turns the pool off (a connection per thread, Django's
# default).  docs/DESIGN.md, "The executor's model", says why it cannot
# deadlock.  The test process itself runs without one by default: the test
# databases are made, cloned and switched under it, and a pool made for one
# would go on serving another (the executors and workers it starts have
# theirs).
RUNDESK_DB_POOL_SIZE = int(
    env_float(
        # pytest's processes, xdist's workers too (whose program is not pytest).
        "RUNDESK_DB_POOL_SIZE",
        0 if "pytest" in sys.modules else 16,
        minimum=0,
        maximum=10_000,
    )
)
# How long a thread waits for a pooled connection before its statement fails.
RUNDESK_DB_POOL_TIMEOUT = env_float("RUNDESK_DB_POOL_TIMEOUT", 10.0, minimum=0.1)
if RUNDESK_DB_POOL_SIZE:
    DATABASES["default"]["CONN_MAX_AGE"] = 0  # the pool keeps them instead
    DATABASES["default"]["OPTIONS"]["pool"] = {
        "min_size": 1,
        "max_size": RUNDESK_DB_POOL_SIZE,
        "timeout": RUNDESK_DB_POOL_TIMEOUT,
        "name": application_name(PROCESS_ROLE),
    }
# Behind PgBouncer in transaction mode (RUNDESK_DB_TRANSACTION_POOLER=1): a
# transaction may run on any server connection, so nothing may be kept on
# one between transactions -- no prepared statement (PgBouncer < 1.21
# cannot route them), no session setting (the code sets none).
RUNDESK_DB_TRANSACTION_POOLER = env_bool("RUNDESK_DB_TRANSACTION_POOLER", False)
if RUNDESK_DB_TRANSACTION_POOLER:
    DATABASES["default"]["OPTIONS"]["prepare_threshold"] = None
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "needs-you"
LOGOUT_REDIRECT_URL = "login"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
# plotly.js is vendored in static/vendor/ (`make plotly`), not from a CDN.
STATICFILES_DIRS = [BASE_DIR / "static"]
# `manage.py collectstatic` copies them here; WhiteNoise serves them from here
# (from the finders, as they are on disk, when DEBUG).
STATIC_ROOT = VAR_DIR / "static"
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    # Without DEBUG: content-hashed names (cached forever) with gzip and
    # brotli copies, read from STATIC_ROOT's manifest, so collectstatic must
    # have run.  With DEBUG (development, the tests) the plain names, found
    # where they are: nothing to collect first.
    "staticfiles": {
        "BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"
        if DEBUG
        else "whitenoise.storage.CompressedManifestStaticFilesStorage"
    },
}
# Decided by the environment, not by the DEBUG the test runner turns off:
# tests serve from the finders and never look for STATIC_ROOT.
WHITENOISE_USE_FINDERS = WHITENOISE_AUTOREFRESH = DEBUG
WHITENOISE_KEEP_ONLY_HASHED_FILES = True

SESSION_COOKIE_HTTPONLY = True
X_FRAME_OPTIONS = "DENY"
SECURE_REFERRER_POLICY = "same-origin"
SECURE_CROSS_ORIGIN_OPENER_POLICY = "same-origin"
# Behind TLS (RUNDESK_TLS=1; `check --deploy` passes): cookies only over
# https, plain http redirected, HSTS, and the scheme the proxy in front says
# the client used (X-Forwarded-Proto, which that proxy must set itself and
# never pass on from the client).  Off, the site answers plain http: the demo.
RUNDESK_TLS = env_bool("RUNDESK_TLS", False)
CSRF_COOKIE_SECURE = SESSION_COOKIE_SECURE = RUNDESK_TLS
SECURE_SSL_REDIRECT = RUNDESK_TLS
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https") if RUNDESK_TLS else None
SECURE_HSTS_SECONDS = int(env_float("SECURE_HSTS_SECONDS", 31_536_000)) if RUNDESK_TLS else 0
SECURE_HSTS_INCLUDE_SUBDOMAINS = SECURE_HSTS_SECONDS > 0
SECURE_HSTS_PRELOAD = SECURE_HSTS_SECONDS > 0
# The largest request body accepted at all (a log upload: 5 MB and its form).
MAX_REQUEST_BYTES = 6 * 1024 * 1024
DATA_UPLOAD_MAX_MEMORY_SIZE = MAX_REQUEST_BYTES

# The level of Rundesk's own log lines (its three apps).
RUNDESK_LOG_LEVEL = env_choice(
    "RUNDESK_LOG_LEVEL", "INFO", {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}
)
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "loggers": {
        **{
            app: {"handlers": ["console"], "level": RUNDESK_LOG_LEVEL}
            for app in ("runs", "evidence", "dashboard")
        },
        # Django logs to the console only with DEBUG by default (and mails a
        # 500 to ADMINS otherwise): a server error's traceback belongs in the
        # web process's log, where 500.html says it is.
        "django": {"handlers": ["console"], "level": "INFO"},
        # The connection pool's warnings (a database it cannot reach, a
        # connection that died in use) in the same form, with their time;
        # its INFO lines are one per connection taken.
        "psycopg": {"handlers": ["console"], "level": "WARNING"},
    },
}

# Celery: Redis or RabbitMQ in production, kombu's filesystem transport otherwise.
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL") or "filesystem://"
CELERY_BROKER_FOLDER = VAR_DIR / "celery-broker"
if CELERY_BROKER_URL == "filesystem://":
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(CELERY_BROKER_FOLDER),
        "data_folder_out": str(CELERY_BROKER_FOLDER),
        "processed_folder": str(VAR_DIR / "celery-processed"),
        "control_folder": str(VAR_DIR / "celery-control"),
        "store_processed": False,
    }
    # kombu's filesystem transport expects its folder to exist.
    var_folder("celery-broker")
else:
    # Redis and SQS hand an unacknowledged task to another worker after this
    # many seconds.  A run is driven in one task, acknowledged when it ends
    # (acks_late), so this must outlast the longest run: a copy handed out
    # meanwhile finds the run leased and gives up, but holds a worker while
    # it waits to look again.  Long costs nothing: a task lost with its
    # worker is not waited for, beat's sweep requeues the run and hands it
    # out again.  (RabbitMQ ignores it: its consumer_timeout plays this part.)
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "visibility_timeout": env_float("RUNDESK_BROKER_VISIBILITY_TIMEOUT", 6 * 3600, minimum=60)
    }
    if CELERY_BROKER_URL.startswith(("redis://", "rediss://", "redis+socket://", "sentinel://")):
        # A Redis that holds the connection open and never answers (a dead
        # link, a half-open connection, a frozen server) held every publish
        # for ever -- Celery beat's included, and with it the sweep, without
        # a word.  Its client now waits this long for an answer, then
        # Celery's publish retries take over, and the caller says the
        # hand-over failed.  (AMQP's wait is broker_connection_timeout.)
        broker_timeout = env_float("RUNDESK_BROKER_TIMEOUT", 10.0, minimum=0.1, maximum=3600)
        CELERY_BROKER_TRANSPORT_OPTIONS |= {
            "socket_timeout": broker_timeout,
            "socket_connect_timeout": broker_timeout,
        }
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_IGNORE_RESULT = True
# Celery beat runs the sweep (runs/sweep.py): with only Celery workers, it is
# what requeues a run whose worker died, ends abandoned cancels, settles
# unknown outcomes and resumes settled runs.  `celery worker -B` embeds it.
RUNDESK_SWEEP_SECONDS = env_float("RUNDESK_SWEEP_SECONDS", 5.0, minimum=0.1)
# A queued run no worker took for this long is handed out again (its task
# may have been lost with a worker; a task for a run already taken is a no-op).
RUNDESK_REDELIVER_SECONDS = env_float("RUNDESK_REDELIVER_SECONDS", 60.0, minimum=1.0)
# A process started by a fault drill (runs/drills.py) for its lab drives
# the drill's runs, and nothing else; every other process never drives a
# drill's run (it would deliver the drill's report to this installation's
# receiver).  The lab's Celery workers take their tasks from a queue of
# their own.
RUNDESK_DRILL_LAB = env_bool("RUNDESK_DRILL_LAB", False)
RUNDESK_DRILL_QUEUE = "rundesk-drills"
CELERY_TASK_DEFAULT_QUEUE = RUNDESK_DRILL_QUEUE if RUNDESK_DRILL_LAB else "celery"
CELERY_BEAT_SCHEDULE = {
    "rundesk-sweep": {"task": "runs.tasks.sweep", "schedule": RUNDESK_SWEEP_SECONDS},
}
CELERY_BEAT_SCHEDULE_FILENAME = str(VAR_DIR / "celerybeat-schedule")
# Beat runs the sweep in its own process rather than queue it behind the runs.
CELERY_BEAT_SCHEDULER = "runs.tasks:SweepingScheduler"

# How often a run saves a checkpoint: every this many steps or seconds,
# whichever comes first (runs/checkpoints.py).  The receipts are the facts; a
# checkpoint spares a resumed run recomputing its agent's state, and costs
# two writes (the last read's receipt on its own, then the state).  Every 5 s
# it costs a fast run under 1% of its commits (bench --json), and a run whose
# model calls take seconds one checkpoint every few actions: at one after
# every action (0.5 s), such a run made three writes a step instead of one,
# and a thousand of them in flight spent a third of the executor's CPU on
# checkpoints (bench --capacity).
RUNDESK_CHECKPOINT_EVERY = int(env_float("RUNDESK_CHECKPOINT_EVERY", 100, minimum=1))
RUNDESK_CHECKPOINT_SECONDS = env_float("RUNDESK_CHECKPOINT_SECONDS", 5.0, minimum=0.0)

# The installed agents, by name: the import path of each one's Agent class
# (runs/registry.py, docs/AGENTS.md).  RUNDESK_AGENTS in the environment
# adds to them or replaces one ("name=package.module:Class,...";
# "name=" uninstalls one): an agent of your own package is installed
# without editing this file.
RUNDESK_AGENTS = {
    "research": "runs.agents.research:ResearchAgent",
    "support": "runs.agents.support:SupportAgent",
    # The support agent whose replies wait for a person's approval
    # (runs/approvals.py); it declares no drill input, so drills skip it.
    "support-approved": "runs.agents.support:ApprovedSupportAgent",
}
for _entry in env_list("RUNDESK_AGENTS"):
    _name, _, _path = _entry.partition("=")
    if not _name.strip():
        raise ImproperlyConfigured(f"RUNDESK_AGENTS: {_entry!r} is not name=package.module:Class")
    RUNDESK_AGENTS[_name.strip()] = _path.strip()
RUNDESK_AGENTS = {name: path for name, path in RUNDESK_AGENTS.items() if path}

# The research agent.
RUNDESK_CORPUS_DIR = Path(
    env_str("RUNDESK_CORPUS_DIR", str(BASE_DIR / "runs" / "agents" / "sample_corpus"))
)
RUNDESK_OUTBOX_DIR = Path(env_str("RUNDESK_OUTBOX_DIR", str(VAR_DIR / "outbox")))
RUNDESK_DELIVERY_URL = env_url("RUNDESK_DELIVERY_URL")
RUNDESK_DELIVERY_TIMEOUT = env_float("RUNDESK_DELIVERY_TIMEOUT", 10.0, minimum=0.1)
# The support agent: its tickets and knowledge-base articles, the SMTP
# server its replies go through and the helpdesk whose tickets it updates.
# Unset, both are the addresses `make demo` starts its local receivers at.
RUNDESK_SUPPORT_DIR = Path(
    env_str("RUNDESK_SUPPORT_DIR", str(BASE_DIR / "runs" / "agents" / "support_samples"))
)
RUNDESK_SMTP_URL = env_str("RUNDESK_SMTP_URL", "smtp://127.0.0.1:8025")
try:
    _smtp = urllib.parse.urlsplit(RUNDESK_SMTP_URL)
    _smtp_port = _smtp.port
except ValueError as _error:
    raise ImproperlyConfigured(f"RUNDESK_SMTP_URL: {_error}") from None
if _smtp.scheme != "smtp" or not _smtp.hostname or _smtp.path not in ("", "/"):
    raise ImproperlyConfigured(
        f"RUNDESK_SMTP_URL must be smtp://host:port, got {RUNDESK_SMTP_URL!r}"
    )
RUNDESK_HELPDESK_URL = env_url("RUNDESK_HELPDESK_URL") or "http://127.0.0.1:8026/"
RUNDESK_SUPPORT_FROM = env_str("RUNDESK_SUPPORT_FROM", "support@rundesk.example")
# Every real tool execution is appended here (one JSON line), outside any
# database transaction: drills and tests count executions from it.
RUNDESK_TOOL_JOURNAL = os.environ.get("RUNDESK_TOOL_JOURNAL", "")

RUNDESK_MODEL_PROVIDER = env_choice("RUNDESK_MODEL_PROVIDER", "offline", {"offline", "openai"})
RUNDESK_MODEL_URL = env_url("RUNDESK_MODEL_URL")
RUNDESK_MODEL = os.environ.get("RUNDESK_MODEL", "")
RUNDESK_MODEL_API_KEY = os.environ.get("RUNDESK_MODEL_API_KEY", "")
RUNDESK_MODEL_TIMEOUT = env_float("RUNDESK_MODEL_TIMEOUT", 60.0, minimum=0.1)
if RUNDESK_MODEL_PROVIDER == "openai" and not (RUNDESK_MODEL_URL and RUNDESK_MODEL):
    raise ImproperlyConfigured(
        "RUNDESK_MODEL_PROVIDER=openai needs RUNDESK_MODEL_URL and RUNDESK_MODEL"
    )

# This installation's name, written into the investigation bundles it
# exports (evidence/bundles.py); the host name when empty.
RUNDESK_INSTALLATION = env_str("RUNDESK_INSTALLATION", "")
# Bundles exported from the run page (evidence/tasks.py): where their files
# are written, and how long each is offered for download before the export
# task removes it.
RUNDESK_BUNDLE_DIR = Path(env_str("RUNDESK_BUNDLE_DIR", str(VAR_DIR / "bundles")))
RUNDESK_BUNDLE_KEEP_HOURS = env_float("RUNDESK_BUNDLE_KEEP_HOURS", 24.0, minimum=0.01)
# The key this installation signs its bundles' manifests with (Ed25519,
# evidence/bundle_signing.py); when unset, one derived from SECRET_KEY, so
# every process of the installation signs with the same key.  And the
# public keys of other installations whose bundles are authenticated here
# (`verify_bundle`, `open_bundle`), by name.
RUNDESK_BUNDLE_SIGNING_KEY = env_signing_key("RUNDESK_BUNDLE_SIGNING_KEY")
RUNDESK_BUNDLE_TRUSTED_KEYS = env_public_keys("RUNDESK_BUNDLE_TRUSTED_KEYS")
# How often beat removes expired bundle files and fails exports whose task
# was lost (evidence/tasks.py: sweep_bundles).
RUNDESK_BUNDLE_SWEEP_SECONDS = env_float("RUNDESK_BUNDLE_SWEEP_SECONDS", 300.0, minimum=1.0)
CELERY_BEAT_SCHEDULE["rundesk-bundles"] = {
    "task": "evidence.tasks.sweep_bundles",
    "schedule": RUNDESK_BUNDLE_SWEEP_SECONDS,
}

# Alerts (runs/alerts.py): when a run starts waiting for an operator, once
# per item, email to the `operators` group and/or a JSON POST to this URL,
# sent by the sweep.  A failed send is tried again after RETRY seconds,
# doubling each time up to RETRY_MAX.
RUNDESK_ALERT_URL = env_url("RUNDESK_ALERT_URL")
RUNDESK_ALERT_TIMEOUT = env_float("RUNDESK_ALERT_TIMEOUT", 5.0, minimum=0.1)
RUNDESK_ALERT_RETRY_SECONDS = env_float("RUNDESK_ALERT_RETRY_SECONDS", 30.0, minimum=0.1)
RUNDESK_ALERT_RETRY_MAX_SECONDS = env_float(
    "RUNDESK_ALERT_RETRY_MAX_SECONDS", 3600.0, minimum=RUNDESK_ALERT_RETRY_SECONDS
)
# Where the dashboard is reached, for links in alerts.
RUNDESK_SITE_URL = env_str("RUNDESK_SITE_URL", "http://127.0.0.1:8000").rstrip("/")
EMAIL_BACKEND = env_str(
    "EMAIL_BACKEND",
    "django.core.mail.backends.console.EmailBackend"
    if DEBUG
    else "django.core.mail.backends.smtp.EmailBackend",
)
EMAIL_HOST = env_str("EMAIL_HOST", "localhost")
EMAIL_PORT = int(env_float("EMAIL_PORT", 25, minimum=1, maximum=65535))
EMAIL_TIMEOUT = env_float("EMAIL_TIMEOUT", 10.0, minimum=0.1)
DEFAULT_FROM_EMAIL = env_str("DEFAULT_FROM_EMAIL", "rundesk@localhost")

# Leases: an owner renews every LEASE_SECONDS / 3; a run whose lease expired
# is taken by another executor with a higher epoch.
RUNDESK_LEASE_SECONDS = env_float("RUNDESK_LEASE_SECONDS", 15.0, minimum=1.0)
RUNDESK_POLL_SECONDS = env_float("RUNDESK_POLL_SECONDS", 1.0, minimum=0.05)
# The core an executor keeps its threads on (runs/cores.py): `auto`, `off`,
# or a core number.
RUNDESK_EXECUTOR_CORE = env_str("RUNDESK_EXECUTOR_CORE", "auto").strip().lower()
if RUNDESK_EXECUTOR_CORE not in ("auto", "off") and not RUNDESK_EXECUTOR_CORE.isdigit():
    raise ImproperlyConfigured(
        f"RUNDESK_EXECUTOR_CORE must be auto, off or a core number, got {RUNDESK_EXECUTOR_CORE!r}"
    )
# How long the runtime keeps asking about a write whose COMMIT got no answer
# (runs/outcomes.py) before it leaves the outcome unknown for an operator.
RUNDESK_SETTLE_SECONDS = env_float("RUNDESK_SETTLE_SECONDS", 5.0, minimum=0.0)
# Evidence capture (evidence/capture.py): queue capacity, the size cap of each
# field of a copy (beyond 16 times the cap a copy is not made: a gap), and the
# lock timeout of its transactions.
RUNDESK_CAPTURE_QUEUE = int(env_float("RUNDESK_CAPTURE_QUEUE", 1000, minimum=1))
RUNDESK_CAPTURE_MAX_BYTES = int(env_float("RUNDESK_CAPTURE_MAX_BYTES", 65536, minimum=256))
RUNDESK_CAPTURE_LOCK_TIMEOUT_MS = int(env_float("RUNDESK_CAPTURE_LOCK_TIMEOUT_MS", 50, minimum=1))
# Capture's retry queue (evidence/retries.py): records that could not take
# their lock, kept to be tried again with backoff, bounded in records and
# bytes (0 records: never tried again), and how many tries each gets.
RUNDESK_CAPTURE_RETRY_QUEUE = int(env_float("RUNDESK_CAPTURE_RETRY_QUEUE", 1000, minimum=0))
RUNDESK_CAPTURE_RETRY_BYTES = int(
    env_float("RUNDESK_CAPTURE_RETRY_BYTES", 16 * 1024 * 1024, minimum=0)
)
RUNDESK_CAPTURE_RETRY_TRIES = int(env_float("RUNDESK_CAPTURE_RETRY_TRIES", 8, minimum=1))
# Lock-wait sampling in the executor (evidence/locks.py), while runs are active.
RUNDESK_LOCK_SAMPLE_SECONDS = env_float("RUNDESK_LOCK_SAMPLE_SECONDS", 0.5, minimum=0.05)

# Bulk actions (runs/bulk.py): the most runs one job may act on; a larger
# selection is refused at its dry run.  Beat hands out again, every
# RUNDESK_BULK_SWEEP_SECONDS, a job no worker has moved for a minute (its
# worker died, or its task was lost).
RUNDESK_BULK_MAX_RUNS = int(env_float("RUNDESK_BULK_MAX_RUNS", 1000, minimum=1, maximum=100000))
RUNDESK_BULK_SWEEP_SECONDS = env_float("RUNDESK_BULK_SWEEP_SECONDS", 30.0, minimum=1.0)
CELERY_BEAT_SCHEDULE["rundesk-bulk"] = {
    "task": "runs.tasks.redeliver_bulk_jobs",
    "schedule": RUNDESK_BULK_SWEEP_SECONDS,
}
# Retention (runs/retention.py, `manage.py purge_runs`): beat removes, once a
# day at RUNDESK_PURGE_HOUR (UTC), the runs that ended longer than
# RUNDESK_PURGE_AFTER ago (90d, 12h, P30D) with every row of theirs, but
# those with an open item; unset (the default), nothing is ever removed.
# With RUNDESK_PURGE_BUNDLE_DIR, each run's bundle is written there first,
# and a run whose bundle fails is kept.
RUNDESK_PURGE_AFTER = env_duration("RUNDESK_PURGE_AFTER")
RUNDESK_PURGE_HOUR = int(env_float("RUNDESK_PURGE_HOUR", 3, minimum=0, maximum=23))
_purge_bundles = os.environ.get("RUNDESK_PURGE_BUNDLE_DIR", "").strip()
RUNDESK_PURGE_BUNDLE_DIR = Path(_purge_bundles) if _purge_bundles else None
if RUNDESK_PURGE_AFTER is not None:
    CELERY_BEAT_SCHEDULE["rundesk-purge"] = {
        "task": "runs.tasks.purge_runs",
        "schedule": crontab(minute=0, hour=RUNDESK_PURGE_HOUR),
    }

# /metrics for Prometheus (dashboard/metrics.py): a scrape sends
# `Authorization: Bearer RUNDESK_METRICS_TOKEN` and/or comes from an address
# of RUNDESK_METRICS_ALLOW (IPs or networks, comma-separated; the address
# the server sees: a proxy's, behind one).  Neither set: no /metrics (404).
# Durations are of the runs ended in the last RUNDESK_METRICS_WINDOW_SECONDS.
RUNDESK_METRICS_TOKEN = env_str("RUNDESK_METRICS_TOKEN", "").strip()
if RUNDESK_METRICS_TOKEN and len(RUNDESK_METRICS_TOKEN) < 16:
    # A scraper's password, sent on every scrape: short ones are guessed.
    raise ImproperlyConfigured("RUNDESK_METRICS_TOKEN must be at least 16 characters")
RUNDESK_METRICS_ALLOW = env_networks("RUNDESK_METRICS_ALLOW")
RUNDESK_METRICS_WINDOW_SECONDS = env_float(
    "RUNDESK_METRICS_WINDOW_SECONDS", 300.0, minimum=10.0, maximum=86400.0
)
