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
# The longest request line (method, address, query) gunicorn reads; a longer
# one gets its bare "414 URI Too Long", never a page of the site's.  Said
# here, not left to its default, because the list pages' search box is
# sized to stay inside it (dashboard/params.py SEARCH_MAX): a longer search
# from elsewhere that still fits reaches the page, which says it is too long.
limit_request_line = 4094
