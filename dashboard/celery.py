"""The Celery app: `celery -A dashboard worker`.

Broker from CELERY_BROKER_URL (Redis or RabbitMQ in production), kombu's
filesystem transport under var/ otherwise (settings.py, dashboard/broker.py).
"""

from __future__ import annotations

import logging
import os

from celery import Celery, signals
from django.conf import settings
from kombu.transport import TRANSPORT_ALIASES

from runs import heap

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dashboard.settings")

# `filesystem://` in every process of the project (web, worker, beat, a
# benchmark's sender): kombu's transport with messages that appear whole.
TRANSPORT_ALIASES["filesystem"] = "dashboard.broker:Transport"

app = Celery("rundesk")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@signals.worker_init.connect
@signals.worker_process_init.connect
def collect_for_runs(**_: object) -> None:
    """A worker drives runs as the executor does: its collections are set
    the same way (runs/heap.py)."""
    heap.collect_for_runs()


@signals.after_setup_logger.connect
def one_line_each(**_: object) -> None:
    """Celery has given the root logger its handler.  The loggers that
    settings.LOGGING gives one of their own (Rundesk's, Django's, the
    connection pool's) write each line there, once, not a second time
    through the root's."""
    for name in settings.LOGGING["loggers"]:
        logging.getLogger(name).propagate = False
