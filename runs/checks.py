"""System checks of the runtime's settings (`manage.py check`, and every
command that runs work, before it starts): a setting that would let every
run go wrong quietly stops the process with what to fix instead.  One that
only a deployment across machines gets wrong is a warning of `check
--deploy`."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import Error, Warning, register

from runs import registry


@register()
def agents(**kwargs: Any) -> list[Error]:
    """An agent badly registered in RUNDESK_AGENTS (a path that does not
    import, a class that is no Agent, a name that differs) would fail
    every run of it: the process does not start."""
    return [
        Error(
            problem,
            hint="Fix RUNDESK_AGENTS (settings or environment): name=package.module:Class.",
            id="rundesk.E002",
        )
        for problem in registry.problems()
    ]


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


@register(deploy=True)
def broker(**kwargs: Any) -> list[Warning]:
    """With no CELERY_BROKER_URL, Celery's broker is a folder under
    RUNDESK_VAR_DIR: what the web hands to workers (bundle exports, drills)
    and `submit_run --celery` reach only workers on this machine that
    share the folder; elsewhere they wait for ever."""
    if settings.CELERY_BROKER_URL != "filesystem://":
        return []
    return [
        Warning(
            "CELERY_BROKER_URL is not set: Celery's broker is the folder "
            f"{settings.CELERY_BROKER_FOLDER}, which only workers on this machine read; bundle "
            "exports and drills the web hands over wait for ever on any other",
            hint="Set CELERY_BROKER_URL to the Redis or RabbitMQ every web process and worker "
            "shares (README: Deploying).",
            id="rundesk.W001",
        )
    ]
