"""Which paths name a document of the corpus (RUNDESK_CORPUS_DIR): one
answer, and one wording of it, for the read tool (runs/agents/tools.py) and for a
run's submission (runs/submission.py), so that a path the tool would refuse
is refused before a run is queued, in the same words."""

from __future__ import annotations

import contextlib
import functools
import os
import stat
from pathlib import Path, PurePosixPath


class NotInCorpus(ValueError):
    """The path names no document of the corpus."""


class NoSuchDocument(NotInCorpus):
    """The path could name a document of the corpus, but nothing is there:
    at submission, the corpus may hold it by the time the run reads it (it
    may even be mounted on the executors' hosts only)."""


def corpus_file(relative: str, corpus: Path) -> Path:
    """The file `relative` names inside the corpus folder, or NotInCorpus.
    Refuses absolute paths, `..`, symlinks that leave the folder, missing
    files and folders."""
    if not relative or "\x00" in relative:
        raise NotInCorpus("empty or invalid document path")
    pure = PurePosixPath(relative)
    if pure.is_absolute() or Path(relative).is_absolute():
        raise NotInCorpus(f"{relative!r}: absolute paths are refused; name a file of the corpus")
    if ".." in pure.parts:
        raise NotInCorpus(f"{relative!r}: '..' is refused; name a file inside the corpus")
    root = _real_folder(str(corpus))
    target = root.joinpath(*pure.parts)
    try:
        # No symlink below the (resolved) corpus folder: the path is inside
        # it as written, one lstat per part (usually one).  With a symlink,
        # where it leads decides.
        if any(
            stat.S_ISLNK(os.lstat(root.joinpath(*pure.parts[:n])).st_mode)
            for n in range(1, len(pure.parts) + 1)
        ):
            target = Path(os.path.realpath(target, strict=True))
        mode = os.stat(target).st_mode
    except (FileNotFoundError, NotADirectoryError):
        # A link to a place that does not exist (yet) outside the folder
        # leads out all the same.
        if not Path(os.path.realpath(target)).is_relative_to(root):
            raise _outside(relative) from None
        raise NoSuchDocument(f"{relative!r}: no such document in the corpus") from None
    except OSError as error:  # a symlink loop, a folder it may not read
        raise NotInCorpus(f"{relative!r}: {error.strerror or error}") from None
    if not target.is_relative_to(root):
        raise _outside(relative)
    if not stat.S_ISREG(mode):
        raise NotInCorpus(f"{relative!r}: not a regular file")
    return target


def check_path(relative: str, corpus: Path) -> None:
    """At submission: NotInCorpus for a path the read tool will refuse, but
    for a document that is not there yet."""
    with contextlib.suppress(NoSuchDocument):
        corpus_file(relative, corpus)


def _outside(relative: str) -> NotInCorpus:
    return NotInCorpus(f"{relative!r}: resolves outside the corpus folder (symlink)")


@functools.lru_cache(maxsize=8)
def _real_folder(corpus: str) -> Path:
    """The corpus folder with its own symlinks resolved, once per process
    (it is a setting: where it points is decided at deployment)."""
    return Path(corpus).resolve()
