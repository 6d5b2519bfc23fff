"""Files that stay once written.  A file's bytes are synced before it takes
its name (a link or a rename); the name is an entry of its folder, which
is synced in turn (`sync_folder`) before anything outside depends on the
file: a report's receipt, the removal of the rows a bundle keeps.  Until
its folder is synced, a crash of the machine may take a new name back
with it, and the file with it."""

from __future__ import annotations

import errno
import os
from pathlib import Path

# What a system that cannot open or sync a folder answers (PostgreSQL's
# fsync_fname_ext ignores the same): there, nothing more can be done.
CANNOT_OPEN = (errno.EACCES, errno.EISDIR)
CANNOT_SYNC = (errno.EBADF, errno.EINVAL)


def sync_folder(folder: Path) -> None:
    """Makes the folder's entries (a file linked or renamed into it)
    durable, where the system can sync a folder; any other failure
    raises OSError."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as error:
        if error.errno in CANNOT_OPEN:
            return
        raise
    try:
        os.fsync(fd)
    except OSError as error:
        if error.errno not in CANNOT_SYNC:
            raise
    finally:
        os.close(fd)
