from __future__ import annotations

import argparse
import datetime as dt
import json
import uuid
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, DjangoHelpFormatter
from django.utils import timezone

from runs import approvals
from runs.decisions import (
    OPERATE,
    DecisionRefused,
    Offer,
    Request,
    Who,
    decide,
    decide_run,
    gather,
    offers,
    run_offers,
)
from runs.inbox import (
    Waiting,
    blocks,
    items_listed,
    known,
    listing_row,
    panels,
    receipts,
    waiting_unheld,
    what,
)
from runs.models import (
    UNSTORABLE,
    DecisionChoice,
    OperatorDecision,
    OutcomeItem,
    OutcomeKind,
    OutcomeState,
    Run,
)
from runs.words import Field

# Who decides an approval item, and how.
APPROVER = "the approver permission (the approvers group)"
APPROVE_WITH = "outcomes approve ID --as USER, or outcomes reject ID --reason WHY --as USER"

HELP = """\
The operators' inbox on the command line: what the runtime could not settle
itself (outcome items), the evidence, and decisions.  The same rules and
audit as the pages: every decision goes through runs.decisions, names the
person (--as, a user with the operator permission), says why (--reason),
and is idempotent by its request token (--token; a repeat changes nothing
and prints the first decision).

  outcomes list [--open] [--kind K] [--run N] [--json]
  outcomes show ID [--json]
  outcomes decide ID --choice C --reason TEXT --as USER [--reference R] [--token T] [--json]
  outcomes decide-run RUN_ID --choice resume|abandon --reason TEXT --as USER [--token T] [--json]
  outcomes approve ID --as USER [--input-file FILE] [--reason TEXT] [--token T] [--json]
  outcomes reject ID --reason TEXT --as USER [--token T] [--json]

An approval item (kind approval: an action that needs a person's approval
before it is sent) is decided with `approve` (as proposed; with
--input-file, a JSON object that is sent instead, checked against the
tool's input schema) or `reject`, by a user with the approver permission
(runs.approve_action, the approvers group): not with `decide`.

A refused decision (not offered by the evidence now, settled meanwhile, no
permission) exits with status 1 and says why on stderr; with --json it also
prints {"refused": MESSAGE, "winner": DECISION or null} on stdout.

JSON (one document on stdout; keys are stable, new keys may be added):
  ITEM      {"id", "kind": checkpoint|receipt|publication|effect,
             "state": open|resolved, "run_id", "run_status", "subject",
             "what" (action identity or write), "summary", "opened_at" (ISO 8601),
             "age_seconds", "blocks": nothing|further_effects|whole_run,
             "blocks_why", "resolution", "resolved_at" (ISO 8601 or null)}
  DECISION  {"id", "item_id" (null on the run), "run_id", "choice",
             "decided_by", "reason", "reference", "state_before",
             "state_after", "request_token", "evidence_digest" (SHA-256 of
             the evidence kept with it), "at" (ISO 8601)}
  OFFER     {"choice", "label", "does"}
  ALERT     {"channel": email|webhook, "state": pending|sent|failing|withdrawn,
             "attempts", "why" (the last failure), "next_try" (ISO 8601 or
             null), "sent_at" (ISO 8601 or null)}: the operators told that
             the item holds its run, once per channel, by the sweep
  WAITING   {"id", "status_reason", "waiting_since" (ISO 8601), "age_seconds",
             "offers": [OFFER, ...], "open_items": [ID, ...]}: a run waiting
             for an operator that no open item holds (an unknown
             checkpoint's item holds nothing), which only `decide-run` lets
             go on
  list        {"items": [ITEM, ...], "waiting_runs": [WAITING, ...]}  oldest
              first ("waiting_runs" left out with --kind)
  show        {"item": ITEM, "known": [sentence, ...], "evidence": {...} (as
              gathered now: runs.decisions.gather), "offers": [OFFER, ...],
              "run_offers": [OFFER, ...], "decisions": [DECISION, ...],
              "alerts": [ALERT, ...]}
  decide      {"decision": DECISION, "repeated": bool, "run_resumed": bool,
              "item": ITEM}
  decide-run  {"decision": DECISION, "repeated": bool,
              "run": {"id", "status", "status_reason"}}
  approve, reject  as decide
"""


RUN_CHOICES = [DecisionChoice.RESUME.value, DecisionChoice.ABANDON.value]
APPROVAL_CHOICES = [str(choice) for choice in approvals.CHOICES]


class Formatter(DjangoHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def offer_json(offer: Offer) -> dict[str, str]:
    return {"choice": str(offer.choice), "label": offer.label, "does": offer.does}


def decision_json(decision: OperatorDecision) -> dict[str, Any]:
    return {
        "id": decision.pk,
        "item_id": decision.item_id,
        "run_id": decision.run_id,
        "choice": decision.choice,
        "decided_by": decision.decided_by,
        "reason": decision.reason,
        "reference": decision.reference,
        "state_before": decision.state_before,
        "state_after": decision.state_after,
        "request_token": decision.request_token,
        "evidence_digest": decision.evidence_digest,
        "at": decision.created_at.isoformat(),
    }


def waiting_json(waiting: Waiting, now: dt.datetime) -> dict[str, Any]:
    run = waiting.run
    return {
        "id": run.pk,
        "status_reason": run.status_reason,
        "waiting_since": run.updated_at.isoformat(),
        "age_seconds": int((now - run.updated_at).total_seconds()),
        "offers": [offer_json(offer) for offer in run_offers(run)],
        "open_items": waiting.open_items,
    }


def field_lines(fields: list[Field], indent: str) -> list[str]:
    lines = []
    for field in fields:
        if field.table is not None:
            lines.append(f"{indent}{field.label}:")
            for row in field.table.rows:
                cells = ", ".join(
                    f"{column}: {cell}"
                    for column, cell in zip(field.table.columns, row, strict=True)
                    if cell
                )
                lines.append(f"{indent}  - {cells}")
        elif field.fields:
            lines.append(f"{indent}{field.label}:")
            lines.extend(field_lines(field.fields, indent + "  "))
        else:
            lines.append(f"{indent}{field.label}: {field.text}")
    return lines


class Command(BaseCommand):
    help = HELP

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> Any:
        kwargs["formatter_class"] = Formatter
        return super().create_parser(prog_name, subcommand, **kwargs)

    def add_arguments(self, parser: Any) -> None:
        commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

        listing = commands.add_parser("list", help="outcome items, oldest first")
        listing.add_argument("--open", action="store_true", help="only the open ones")
        listing.add_argument("--kind", choices=OutcomeKind.values)
        listing.add_argument("--run", type=int, help="only this run's")
        listing.add_argument("--json", action="store_true")

        show = commands.add_parser("show", help="an item: evidence (gathered now) and choices")
        show.add_argument("item_id", type=int, metavar="ID")
        show.add_argument("--json", action="store_true")

        item = commands.add_parser("decide", help="decide an item")
        item.add_argument("item_id", type=int, metavar="ID")
        self._decision_arguments(
            item,
            [c for c in DecisionChoice.values if c not in RUN_CHOICES + APPROVAL_CHOICES],
        )
        item.add_argument("--reference", default="", help="e.g. the receiver's delivery id")

        run = commands.add_parser("decide-run", help="resume or abandon a waiting run")
        run.add_argument("run_id", type=int, metavar="RUN_ID")
        self._decision_arguments(run, RUN_CHOICES)

        approve = commands.add_parser("approve", help="approve an approval item")
        approve.add_argument("item_id", type=int, metavar="ID")
        approve.add_argument(
            "--input-file",
            type=argparse.FileType("rb"),
            help="a JSON object: the input sent instead of the proposed one",
        )
        approve.add_argument("--reason", default="", help="why (kept with the decision)")
        self._person_arguments(approve, APPROVER)
        reject = commands.add_parser("reject", help="reject an approval item")
        reject.add_argument("item_id", type=int, metavar="ID")
        reject.add_argument("--reason", required=True, help="why: kept with the decision")
        self._person_arguments(reject, APPROVER)

    def _decision_arguments(self, parser: Any, choices: list[str]) -> None:
        parser.add_argument("--choice", required=True, choices=choices)
        parser.add_argument("--reason", required=True, help="why: kept with the decision")
        self._person_arguments(parser, "the operator permission")

    def _person_arguments(self, parser: Any, permission: str) -> None:
        parser.add_argument(
            "--as",
            dest="username",
            required=True,
            metavar="USER",
            help=f"the person deciding: a user with {permission}",
        )
        parser.add_argument(
            "--token",
            default="",
            help="request token (default: a new one); the same token again changes nothing",
        )
        parser.add_argument("--json", action="store_true")

    def handle(self, *args: Any, **options: Any) -> None:
        handler = {
            "list": self.list,
            "show": self.show,
            "decide": self.decide,
            "decide-run": self.decide_run,
            "approve": self.approve,
            "reject": self.approve,
        }[options["command"]]
        handler(options)

    def emit(self, options: dict[str, Any], document: dict[str, Any], text: list[str]) -> None:
        if options["json"]:
            self.stdout.write(json.dumps(document, ensure_ascii=False))
        else:
            self.stdout.write("\n".join(text))

    # -- reading ----------------------------------------------------------------

    def list(self, options: dict[str, Any]) -> None:
        items = OutcomeItem.objects.local()
        if options["open"]:
            items = items.filter(state=OutcomeState.OPEN)
        if options["kind"]:
            items = items.filter(kind=options["kind"])
        if options["run"] is not None:
            items = items.filter(run_id=options["run"])
        now = timezone.now()
        rows = [listing_row(item, now) for item in items_listed(items).order_by("created_at", "id")]
        text = [
            f"#{row['id']}  {row['state']:<8}  {row['kind']:<11}  run {row['run_id']}  "
            f"{row['what']}  {_age(row['age_seconds'])}  blocks: {row['blocks'].replace('_', ' ')}"
            for row in rows
        ] or ["no outcome items" + (" open" if options["open"] else "")]
        document: dict[str, Any] = {"items": rows}
        if not options["kind"]:
            # As the inbox lists them: runs only a decision on the run lets go on.
            waiting = [waiting_json(entry, now) for entry in waiting_unheld(options["run"])]
            document["waiting_runs"] = waiting
            if waiting:
                text += [
                    "",
                    "Runs waiting for an operator that no item holds (outcomes decide-run):",
                ]
            text += [
                f"run {row['id']}  {_age(row['age_seconds'])}  {row['status_reason']}  "
                f"choices: {', '.join(offer['choice'] for offer in row['offers'])}"
                for row in waiting
            ]
        self.emit(options, document, text)

    def show(self, options: dict[str, Any]) -> None:
        item = self._item(options["item_id"])
        shown = gather(item)
        choices = offers(item, shown)
        for_run = run_offers(item.run)
        decisions = list(item.decisions.order_by("created_at", "id"))
        alerts = list(item.alerts.all())
        document = {
            "item": listing_row(item, timezone.now()),
            "known": known(item, shown),
            "evidence": shown,
            "offers": [offer_json(offer) for offer in choices],
            "run_offers": [offer_json(offer) for offer in for_run],
            "decisions": [decision_json(decision) for decision in decisions],
            "alerts": [alert.json() for alert in alerts],
        }
        found = blocks(item)
        text = [
            f"Item {item.pk}: {item.kind} {what(item)} ({item.state}), run {item.run_id} "
            f"({item.run.status}), blocks {found.words}: {found.why}",
            "",
            *known(item, shown),
        ]
        for title, fields in panels(item, shown):
            text += ["", title, *field_lines(fields, "  ")]
        split = receipts(item, shown)
        text += ["", "Receipts of the run"]
        for when, rows in (("before the item", split["before"]), ("after", split["after"])):
            text.append(f"  {when}: " + (", ".join(r["step_key"] for r in rows) or "none"))
        if item.kind == OutcomeKind.APPROVAL and item.state == OutcomeState.OPEN:
            text += ["", f"Choices: an approver approves or rejects it ({APPROVE_WITH})"]
        else:
            text += ["", "Choices" + ("" if choices else ": none (settled)")]
        text += [f"  {offer.choice}: {offer.does}" for offer in choices]
        if for_run:
            text += ["", f"Run {item.run_id} choices (outcomes decide-run)"]
            text += [f"  {offer.choice}: {offer.does}" for offer in for_run]
        text += ["", "Decisions" + ("" if decisions else ": none")]
        text += [_decision_line(decision) for decision in decisions]
        if alerts:
            text += ["", "Operators told"]
            text += [f"  {alert.channel}: {alert.said()}" for alert in alerts]
        self.emit(options, document, text)

    # -- deciding ---------------------------------------------------------------

    def decide(self, options: dict[str, Any]) -> None:
        item = self._item(options["item_id"])
        token = self._token(options)
        request = Request(
            choice=options["choice"],
            who=Who(user=self._operator(options["username"])),
            token=token,
            reason=options["reason"],
            reference=options["reference"],
        )
        try:
            decided = decide(item.pk, request)
        except DecisionRefused as refused:
            self._refused(options, refused)
        decision, repeated, resumed = decided.decision, decided.repeated, decided.run_resumed
        item = self._item(item.pk)
        document = {
            "decision": decision_json(decision),
            "repeated": repeated,
            "run_resumed": resumed,
            "item": listing_row(item, timezone.now()),
        }
        text = [
            ("already recorded (same token): " if repeated else "recorded: ")
            + _decision_line(decision).strip(),
            f"item {item.pk} is {item.state}"
            + (f"; run {item.run_id} is back in the queue" if resumed else ""),
        ]
        self.emit(options, document, text)

    def decide_run(self, options: dict[str, Any]) -> None:
        if not Run.objects.filter(pk=options["run_id"]).exists():
            raise CommandError(f"no run {options['run_id']}")
        token = self._token(options)
        request = Request(
            choice=options["choice"],
            who=Who(user=self._operator(options["username"])),
            token=token,
            reason=options["reason"],
        )
        try:
            decided = decide_run(options["run_id"], request)
        except DecisionRefused as refused:
            self._refused(options, refused)
        decision, repeated = decided.decision, decided.repeated
        run = Run.objects.get(pk=options["run_id"])
        document = {
            "decision": decision_json(decision),
            "repeated": repeated,
            "run": {"id": run.pk, "status": run.status, "status_reason": run.status_reason},
        }
        text = [
            ("already recorded (same token): " if repeated else "recorded: ")
            + _decision_line(decision).strip(),
            f"run {run.pk} is {run.status}: {run.status_reason}",
        ]
        self.emit(options, document, text)

    def approve(self, options: dict[str, Any]) -> None:
        """`approve` (with --input-file: with an edit) or `reject`."""
        item = self._item(options["item_id"])
        edited = None
        if options["command"] == "reject":
            choice = DecisionChoice.REJECT
        elif options["input_file"] is None:
            choice = DecisionChoice.APPROVE
        else:
            choice, edited = DecisionChoice.APPROVE_EDITED, self._input(options["input_file"])
        request = Request(
            choice=choice,
            who=Who(user=self._person(options["username"], approvals.APPROVE, "approver")),
            token=self._token(options),
            reason=options["reason"],
        )
        try:
            decided = approvals.decide_approval(item.pk, request, edited)
        except DecisionRefused as refused:
            self._refused(options, refused)
        item = self._item(item.pk)
        document = {
            "decision": decision_json(decided.decision),
            "repeated": decided.repeated,
            "run_resumed": decided.run_resumed,
            "item": listing_row(item, timezone.now()),
        }
        text = [
            ("already recorded (same token): " if decided.repeated else "recorded: ")
            + _decision_line(decided.decision).strip(),
            f"item {item.pk} is {item.state}"
            + (f"; run {item.run_id} is back in the queue" if decided.run_resumed else ""),
        ]
        self.emit(options, document, text)

    def _input(self, file: Any) -> dict[str, Any]:
        with file:
            try:
                edited = json.loads(file.read())
            except (ValueError, UnicodeDecodeError) as error:
                raise CommandError(f"--input-file {file.name}: no JSON: {error}") from None
        if not isinstance(edited, dict):
            raise CommandError(f"--input-file {file.name}: not a JSON object")
        return edited

    def _item(self, item_id: int) -> OutcomeItem:
        item = items_listed(OutcomeItem.objects.all()).filter(pk=item_id).first()
        if item is None:
            raise CommandError(f"no outcome item {item_id}")
        return item

    def _operator(self, username: str) -> Any:
        return self._person(username, OPERATE, "operator")

    def _person(self, username: str, permission: str, role: str) -> Any:
        """The person deciding: the audit names them, so there is no default."""
        users = get_user_model().objects.filter(username=username)
        user = None if UNSTORABLE.search(username) else users.first()
        if user is None:
            raise CommandError(f"no user {username!r}: --as names the person deciding")
        if not user.has_perm(permission):
            inactive = "" if user.is_active else "; the user is inactive"
            raise CommandError(
                f"{username} may not decide: it needs the {role} permission "
                f"({permission}, the {role}s group){inactive}"
            )
        return user

    def _token(self, options: dict[str, Any]) -> str:
        token = options["token"].strip() or uuid.uuid4().hex
        if len(token) > 100:
            raise CommandError("--token is longer than 100 characters")
        return token

    def _refused(self, options: dict[str, Any], refused: DecisionRefused) -> None:
        winner = refused.decision
        if options["json"]:
            self.stdout.write(
                json.dumps(
                    {"refused": str(refused), "winner": decision_json(winner) if winner else None},
                    ensure_ascii=False,
                )
            )
        message = f"refused: {refused}"
        if winner is not None:
            message += f" (the decision that stands: {_decision_line(winner).strip()})"
        raise CommandError(message)


def _age(seconds: int) -> str:
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    if seconds < 172800:
        return f"{seconds // 3600}h"
    return f"{seconds // 86400}d"


def _decision_line(decision: OperatorDecision) -> str:
    at = timezone.localtime(decision.created_at).strftime("%Y-%m-%d %H:%M:%S")
    reference = f" [reference {decision.reference}]" if decision.reference else ""
    return (
        f"  #{decision.pk} {at} {decision.decided_by}: {decision.choice} "
        f"({decision.state_before} -> {decision.state_after}): {decision.reason}{reference}"
    )
