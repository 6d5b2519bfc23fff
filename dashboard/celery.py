"""The Celery app: `celery -A dashboard worker`.

Broker from CELERY_BROKER_URL (Redis or RabbitMQ in production), kombu's
filesystem transport under var/ otherwise (settings.py, dashboard/broker.py).
"""

from __future__ import annotations

import gc
import os

from celery import Celery, signals
from kombu.transport import TRANSPORT_ALIASES

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dashboard.settings")

# `filesystem://` in every process of the project (web, worker, beat, a
# benchmark's sender): kombu's transport with messages that appear whole.
TRANSPORT_ALIASES["filesystem"] = "dashboard.broker:Transport"

app = Celery("rundesk")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@signals.worker_init.connect
@signals.worker_process_init.connect
def leave_start_up_out_of_collections(**_: object) -> None:
    """A worker's start-up heap (Django, the agents) lives as long as the
    process: garbage collections leave it out, as the executor's do
    (runs/management/commands/executor.py)."""
    gc.freeze()
