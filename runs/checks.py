"""System checks of the runtime's settings (`manage.py check`, and every
command that runs work, before it starts): a setting that would let every
run go wrong quietly stops the process with what to fix instead."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import Error, register


@register()
def corpus_folder(**kwargs: Any) -> list[Error]:
    """Without its corpus folder every document read is refused, and every
    run completes with a report on nothing."""
    corpus = settings.RUNDESK_CORPUS_DIR
    if corpus.is_dir():
        return []
    return [
        Error(
            f"RUNDESK_CORPUS_DIR {corpus} is not a folder: every document read would be "
            "refused, and every run would complete with a report on nothing",
            hint="Point RUNDESK_CORPUS_DIR at the folder of documents runs may read.",
            id="rundesk.E001",
        )
    ]
