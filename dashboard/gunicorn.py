"""gunicorn's configuration for the web tier:

    gunicorn -c dashboard/gunicorn.py --bind 127.0.0.1:8000

`WEB_CONCURRENCY` worker processes (2 unless set), each with four threads:
a page's htmx polls are short, and a thread-based worker is not killed for a
long bundle download (gunicorn's `timeout` then only says the worker hangs).
Anything else from the command line or `GUNICORN_CMD_ARGS`, which override
this file.  Static files are served by WhiteNoise inside Django.
"""

from __future__ import annotations

import os
from pathlib import Path

wsgi_app = "dashboard.wsgi:application"
# The project folder, whatever the folder gunicorn is started from.
chdir = str(Path(__file__).resolve().parent.parent)

_workers = os.environ.get("WEB_CONCURRENCY") or "2"
if not _workers.isdigit() or int(_workers) < 1:
    raise ValueError(f"WEB_CONCURRENCY must be a whole number of processes, got {_workers!r}")
workers = int(_workers)
worker_class = "gthread"
threads = 4
