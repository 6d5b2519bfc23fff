"""The installed agents: RUNDESK_AGENTS names each one's Agent class by
import path ("package.module:Class"; dashboard/settings.py reads it from
the environment too).  A run is driven only by the agent installed under
its agent's name; a bad registration stops the process at start-up
(runs/checks.py) with what failed, instead of failing each run."""

from __future__ import annotations

import functools
import importlib
from typing import Any

from django.conf import settings

from runs.agent import Agent


class NotInstalled(LookupError):
    """No agent is installed under this name, or its registration is bad."""


def load(name: str, path: str) -> type[Agent]:
    """The Agent class `path` names for agent `name`, or NotInstalled
    saying what failed (the module, the class, the declaration)."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise NotInstalled(
            f"agent {name!r}: {path!r} is not an import path of the form package.module:Class"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # any error its import raises says what to fix
        raise NotInstalled(f"agent {name!r}: importing {module_name} failed: {error!r}") from None
    found: Any = getattr(module, attribute, None)
    if not (isinstance(found, type) and issubclass(found, Agent)):
        raise NotInstalled(
            f"agent {name!r}: {path} is {'missing' if found is None else repr(found)}, "
            "not a subclass of runs.agent.Agent"
        )
    if found.name != name:
        raise NotInstalled(
            f"agent {name!r}: {path} declares name = {found.name!r}; install it under that name"
        )
    names = [tool.name for tool in found.tools]
    if len(set(names)) != len(names):
        raise NotInstalled(f"agent {name!r}: two of its tools share a name ({names})")
    if not isinstance(found.version, str) or not found.version:
        raise NotInstalled(f"agent {name!r}: version must be a non-empty string")
    return found


@functools.cache
def _installed(registrations: tuple[tuple[str, str], ...]) -> dict[str, type[Agent]]:
    return {name: load(name, path) for name, path in registrations}


def installed() -> dict[str, type[Agent]]:
    """Every installed agent by name (NotInstalled if one is badly
    registered: the system check says so at start-up)."""
    return _installed(tuple(sorted(settings.RUNDESK_AGENTS.items())))


def agent_class(name: str) -> type[Agent]:
    """The agent installed under `name`, or NotInstalled."""
    path = settings.RUNDESK_AGENTS.get(name)
    if path is None:
        raise NotInstalled(f"no agent {name!r} is installed here")
    return installed()[name]


def problems() -> list[str]:
    """What is wrong with each registration (none: [])."""
    found = []
    for name, path in sorted(settings.RUNDESK_AGENTS.items()):
        try:
            load(name, path)
        except NotInstalled as problem:
            found.append(str(problem))
    return found
