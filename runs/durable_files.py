"""Files that stay once written.  A file's bytes are synced before it takes
its name (a link or a rename); the name is an entry of its folder, which
is synced in turn (`sync_folder`) before anything outside depends on the
file: a report's receipt, the removal of the rows a bundle keeps.  Until
its folder is synced, a crash of the machine may take a new name back
with it, and the file with it."""

from __future__ import annotations

import os
from pathlib import Path


def sync_folder(folder: Path) -> None:
    """Makes the folder's entries (a file linked or renamed into it) durable."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
