from __future__ import annotations

import json
import uuid
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from runs import bulk
from runs.decisions import OPERATE
from runs.management.commands.outcomes import Formatter
from runs.models import UNSTORABLE, OutcomeKind
from runs.tasks import bulk_job, hand_over

HELP = """\
Runs, many at a time.

  runs bulk (--filter QUERY | --ids 1,2,3) --action cancel|resume|abandon|decide
            [--choice C --kind K] [--dry-run] [--reason TEXT --as USER]
            [--token T] [--queue] [--json]

bulk: one action on every run a runs-list filter selects (its query string,
e.g. "status=needs_operator&agent=support", as the runs list's address
holds it) or on the runs named by id.  `decide` takes --choice on every open
item of --kind whose evidence offers that choice (e.g. --choice check_again
--kind checkpoint settles each unknown checkpoint the evidence can settle
now).  A dry run comes first, always: what each run would change, and what
would be refused and why; nothing is written.  With --dry-run that is all.
Otherwise a job is made for the runs the dry run said would change (those
it refused are left alone), in the name of
--as (a user with the operator permission) with --reason, and carried out
here, each run through the single action's own path and audit (--queue:
handed to a Celery worker instead; follow it on /bulk/ID/).  The same
--token again makes no second job: it prints the first.  A selection of
more than RUNDESK_BULK_MAX_RUNS runs is refused.

Exits 1, saying why on stderr, when the request is refused (with --json,
{"refused": MESSAGE} on stdout too).

JSON (one document on stdout; keys are stable, new keys may be added):
  DRY_RUN  {"action", "choice", "kind", "filter" (or null), "ids" (or null),
            "total", "cap", "refused" (why the whole selection is, or null),
            "would_change", "would_refuse",
            "runs": [{"id", "status", "changes": [...], "refusals": [...]}]}
  JOB      {"id", "state": queued|running|done|stopped, "token", "repeated",
            "requested_by", "reason", "total",
            "counts": {"pending", "done", "refused", "stopped"},
            "results": [{"run_id", "result": pending|done|refused|stopped,
                         "detail", "decisions": [ID, ...]}]}
  {"dry_run": DRY_RUN, "job": JOB or null (a dry run, or nothing to change)}
"""


class Command(BaseCommand):
    help = HELP

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> Any:
        kwargs["formatter_class"] = Formatter
        return super().create_parser(prog_name, subcommand, **kwargs)

    def add_arguments(self, parser: Any) -> None:
        commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
        act = commands.add_parser("bulk", help="one action on many runs: a dry run first")
        chosen = act.add_mutually_exclusive_group(required=True)
        chosen.add_argument("--filter", help="the runs list's query string")
        chosen.add_argument("--ids", help="run ids, separated by commas")
        act.add_argument("--action", required=True, choices=bulk.BulkAction.values)
        act.add_argument("--choice", default="", choices=bulk.ITEM_CHOICES)
        act.add_argument("--kind", default="", choices=OutcomeKind.values)
        act.add_argument("--reason", default="", help="why: kept with every run's change")
        act.add_argument(
            "--as", dest="username", default="", metavar="USER", help="who acts (an operator)"
        )
        act.add_argument("--token", default="", help="request token (default: a new one)")
        act.add_argument("--dry-run", action="store_true", help="say what would happen; no job")
        act.add_argument("--queue", action="store_true", help="hand the job to a Celery worker")
        act.add_argument("--json", action="store_true")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            self.bulk(options)
        except bulk.Refused as refused:
            if options["json"]:
                self.stdout.write(json.dumps({"refused": str(refused)}, ensure_ascii=False))
            raise CommandError(f"refused: {refused}") from None

    def bulk(self, options: dict[str, Any]) -> None:
        if options["filter"] is not None:
            chosen = bulk.Selection.by_filter(options["filter"])
        else:
            chosen = bulk.Selection.by_ids(options["ids"])
        ask = bulk.Ask(options["action"], options["choice"], options["kind"])
        user = None if options["dry_run"] else self._operator(options["username"])
        planned = bulk.dry_run(chosen, ask)
        if planned.refused:
            raise bulk.Refused(planned.refused)
        text = self._plan_lines(planned)
        token = "" if options["dry_run"] else self._token(options)
        # The same token again: the job it made stands, whatever runs now.
        job = bulk.by_token(token, user, ask) if token else None
        repeated = job is not None
        if job is None and token and planned.changing:
            job = bulk.create_job(
                ask, chosen, planned.changing_ids, user=user, reason=options["reason"], token=token
            ).job
            if not options["queue"]:
                bulk.process(job.pk)
            elif failed := hand_over(bulk_job, job.pk):
                text.append(f"job {job.pk} not handed to a worker yet ({failed})")
        elif job is None and token:
            text.append("nothing would change: no job was made")
        if job is not None:
            job.refresh_from_db()
            text += self._job_lines(job, repeated)
        document = {
            "dry_run": planned.json(),
            "job": self._job_json(job, repeated) if job is not None else None,
        }
        self.stdout.write(
            json.dumps(document, ensure_ascii=False) if options["json"] else "\n".join(text)
        )

    def _plan_lines(self, planned: bulk.DryRun) -> list[str]:
        lines = [
            f"dry run: {planned.ask.words()}, {planned.selection.words()}: {planned.total} runs, "
            f"{planned.changing} would change, {planned.refused_runs} would be refused"
        ]
        for plan in planned.plans:
            lines.append(f"  run {plan.run.pk} ({plan.run.status})")
            lines += [f"    would: {line}" for line in plan.changes]
            lines += [f"    refused: {line}" for line in plan.refusals]
        return lines

    def _job_lines(self, job: bulk.BulkJob, repeated: bool) -> list[str]:
        counts = job.counts()
        lines = [
            ("already made with this token: " if repeated else "")
            + f"bulk job {job.pk} {job.state}: {counts['done']} done, {counts['refused']} "
            f"refused, {counts['stopped']} stopped, {counts['pending']} to do"
        ]
        for item in job.items.order_by("id"):
            detail = item.detail.replace("\n", "; ")
            lines.append(f"  run {item.run_id}: {item.result}" + (f": {detail}" if detail else ""))
        return lines

    def _job_json(self, job: bulk.BulkJob, repeated: bool) -> dict[str, Any]:
        return {
            "id": job.pk,
            "state": job.state,
            "token": job.request_token,
            "repeated": repeated,
            "requested_by": job.requested_by,
            "reason": job.reason,
            "total": job.total,
            "counts": job.counts(),
            "results": [
                {
                    "run_id": item.run_id,
                    "result": item.result,
                    "detail": item.detail,
                    "decisions": item.decisions,
                }
                for item in job.items.order_by("id")
            ],
        }

    def _operator(self, username: str) -> Any:
        """Who acts: the audit names them, so there is no default."""
        if not username:
            raise CommandError("--as names the operator acting (a dry run needs none)")
        user = (
            None
            if UNSTORABLE.search(username)
            else (get_user_model().objects.filter(username=username).first())
        )
        if user is None:
            raise CommandError(f"no user {username!r}: --as names the operator acting")
        if not user.has_perm(OPERATE):
            raise CommandError(f"{username} may not act on runs: it needs the operator permission")
        return user

    def _token(self, options: dict[str, Any]) -> str:
        token = options["token"].strip() or uuid.uuid4().hex
        if len(token) > bulk.TOKEN_MAX:
            raise CommandError(f"--token is longer than {bulk.TOKEN_MAX} characters")
        return token
