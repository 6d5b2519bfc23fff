"""kombu's filesystem transport, with messages that appear whole.

kombu's own transport creates a message's file under its final name, then
writes it: a worker polling the folder in between takes the file, reads it
empty, and dies of the JSON error (a race seen with four workers on one
folder).  Here a message is written under a name no queue reads, then
renamed into place, which on one filesystem is atomic.  A file that is not
a message all the same (left by another program, or cut short by a full
disk) is logged and skipped, not fatal: beat's sweep requeues a run whose
task was lost (runs/sweep.py).

dashboard/celery.py makes this the transport of `filesystem://`.
"""

from __future__ import annotations

import logging
import os
import uuid
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps

logger = logging.getLogger(__name__)

# Appended to a message's name while it is written: `Channel._get` takes only
# names that end in ".<queue>.msg".
PARTIAL = ".partial"


class Channel(filesystem.Channel):
    def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:
        # kombu's naming: the time first, so the folder sorts oldest first.
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        path = os.path.join(self.data_folder_out, name)
        try:
            with open(path + PARTIAL, "wb") as f:
                f.write(str_to_bytes(dumps(payload)))
            os.replace(path + PARTIAL, path)
        except OSError as exc:
            raise ChannelError(f"Cannot add file {path!r} to directory") from exc

    def _get(self, queue: str) -> Any:
        # kombu has removed a file from the folder before it parses it, so a
        # file that does not parse is gone and the next one is read.
        while True:
            try:
                return super()._get(queue)
            except ValueError as exc:
                logger.error("queue %s: skipped a message file that is not JSON: %s", queue, exc)


class Transport(filesystem.Transport):
    Channel = Channel
