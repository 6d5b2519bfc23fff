"""The Celery app: `celery -A dashboard worker`.

Broker from CELERY_BROKER_URL (Redis or RabbitMQ in production), kombu's
filesystem transport under var/ otherwise (settings.py).
"""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dashboard.settings")

app = Celery("rundesk")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
