"""The drills page: each fault scenario's latest result and its history
for each agent (runs/drills.py), and a drill an operator starts (a Celery
task; its results appear as they come)."""

from __future__ import annotations

from collections import defaultdict

from django.contrib import messages
from django.contrib.auth.decorators import permission_required
from django.http import HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST, require_safe
from django_htmx.http import HttpResponseStopPolling

from dashboard.htmx import HtmxHttpRequest
from dashboard.security import form_lock_waits, rejects_bad_input
from runs import tasks
from runs.decisions import OPERATE
from runs.drills import (
    QUESTIONS,
    SCENARIOS,
    DrillRunning,
    describe,
    drillable,
    start_drill,
    undrilled,
)
from runs.models import Drill, DrillResult, DrillState
from runs.tasks import hand_over

HISTORY = 10  # results shown per scenario


@require_safe
@rejects_bad_input
def drills(request: HtmxHttpRequest) -> HttpResponse:
    history: dict[tuple[str, str], list[DrillResult]] = defaultdict(list)
    # The newest HISTORY results of each scenario for each agent, in one query.
    for result in DrillResult.objects.raw(
        """SELECT * FROM (
               SELECT *, row_number() OVER (PARTITION BY scenario, agent
                                            ORDER BY created_at DESC, id DESC) AS nth
               FROM runs_drillresult) ranked
           WHERE nth <= %s ORDER BY created_at DESC, id DESC""",
        [HISTORY],
    ):
        # In the order of the columns (jsonb keeps no key order).
        result.answers = [result.checks.get(question) for question in QUESTIONS]
        history[result.scenario, result.agent].append(result)
    # The agents a drill runs against now, then any others drilled before.
    agents = list(dict.fromkeys([*drillable(), *sorted(agent for _, agent in history)]))
    scenarios = [
        {
            "name": name,
            "about": describe(name),
            "agents": [
                {"name": agent, "history": history.get((name, agent), [])} for agent in agents
            ],
        }
        for name in SCENARIOS
    ]
    return render(
        request,
        "drills.html",
        {
            "scenarios": scenarios,
            "agents": drillable(),
            "undrilled": undrilled(),
            "drill": Drill.objects.first(),
            "total": len(SCENARIOS),
        },
    )


@require_safe
@rejects_bad_input
def drill_progress(request: HtmxHttpRequest, drill_id: int) -> HttpResponse:
    drill = get_object_or_404(Drill, pk=drill_id)
    response = render(request, "drills.html#progress", {"drill": drill})
    if drill.state != DrillState.RUNNING:
        response.status_code = HttpResponseStopPolling.status_code
    return response


@require_POST
@permission_required(OPERATE, raise_exception=True)
@rejects_bad_input
def drill_start(request: HtmxHttpRequest) -> HttpResponse:
    chosen = request.POST.getlist("scenario") or list(SCENARIOS)
    unknown = sorted(set(chosen) - set(SCENARIOS))
    if unknown:
        messages.error(request, f"No such scenario: {', '.join(unknown)}.")
        return redirect("drills")
    try:
        with form_lock_waits():
            drill = start_drill(
                chosen, request.user.get_username(), request.POST.getlist("agent") or None
            )
    except DrillRunning as running:
        messages.info(request, f"Not started: {running}. Its results appear below.")
        return redirect("drills")
    except ValueError as refused:
        messages.error(request, f"Not started: {refused}.")
        return redirect("drills")
    if refused := hand_over(tasks.drill, drill.pk):
        # No worker will run it: ended now, so it holds back no other.
        Drill.objects.filter(pk=drill.pk, state=DrillState.RUNNING).update(
            state=DrillState.DONE,
            finished_at=timezone.now(),
            error=f"not started: could not be handed to a worker ({refused})",
        )
        messages.error(request, f"Drill {drill.pk} not started: no worker could be asked.")
    else:
        messages.success(
            request,
            f"Drill {drill.pk} started: {len(chosen)} scenarios against {', '.join(drill.agents)}.",
        )
    return redirect("drills")
