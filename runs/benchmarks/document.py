"""docs/BENCHMARKS.md: the report of `bench --all` as one markdown table, with
the machine, the date and the command that made it (`bench --all
--markdown PATH`, which `make bench` runs)."""

from __future__ import annotations

import datetime as dt
import os
import platform
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.db import connection

from runs.benchmarks import pages

Row = tuple[str, str]

# What each benchmark of `bench --all` is called in the table, by its key.
TITLES = {
    "steps": "agent path and no-op step",
    "support_path": "support agent path",
    "capture": "capture hand-over",
    "parallel": "reads side by side",
    "evidence_locked": "evidence locked",
    "peers": "peers",
    "throughput": "throughput and failover",
    "capacity": "runs in flight",
    "scale": "Celery scale-out",
    "bundle": "investigation bundles",
    "dashboard": "dashboard pages",
    "page_load": "page to chart",
    "purge": "retention's purge",
}
TIMES = "\N{MULTIPLICATION SIGN}"  # after a ratio: so many times a commit
PEER_NAMES = {"dbos": "DBOS", "langgraph": "LangGraph", "rundesk": "Rundesk"}


@dataclass(frozen=True)
class Machine:
    """What the figures were measured on."""

    cpu: str
    cores: int
    memory_gib: float
    postgresql: str  # the server's version and how it makes a commit durable

    @classmethod
    def here(cls) -> Machine:
        """This machine (Linux's /proc), and the server of Django's database."""
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT current_setting('server_version'), current_setting('synchronous_commit'),"
                " current_setting('wal_sync_method')"
            )
            version, synchronous_commit, wal_sync_method = cursor.fetchone()
        return cls(
            cpu=_proc_field("/proc/cpuinfo", "model name") or platform.machine(),
            cores=os.cpu_count() or 1,
            memory_gib=int(_proc_field("/proc/meminfo", "MemTotal").split()[0]) / 2**20,
            postgresql=f"{version} (synchronous_commit={synchronous_commit}, "
            f"wal_sync_method={wal_sync_method})",
        )


def _proc_field(path: str, name: str) -> str:
    """The value of the first `name: value` line of a /proc file, or ''."""
    for line in Path(path).read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return ""


def markdown(report: dict[str, Any], machine: Machine, day: dt.date, command: str) -> str:
    """The document: a benchmark that failed says why in its row."""
    rows: list[Row] = []
    for name, figures in report.items():
        if "error" in figures:
            rows.append((TITLES[name], f"failed: {figures['error']}"))
        else:
            rows.extend(ROWS[name](figures))
    table = "\n".join(f"| {_cell(label)} | {_cell(figure)} |" for label, figure in rows)
    return f"""# Benchmarks

The figures of one run of every benchmark, written by `bench --all
--markdown` (`make bench`): do not edit them by hand. What each benchmark
measures is in the README ("Benchmarks"). Compare ratios, not milliseconds,
and only within one run.

- Date: {day.isoformat()}
- Machine: {machine.cores} cores ({machine.cpu}), {machine.memory_gib:.0f} GiB of memory
- PostgreSQL: {machine.postgresql}
- Command: `{command}`

| benchmark | figure |
|---|---|
{table}
"""


def _cell(text: str) -> str:
    """`text` as one cell of a table row: a line break or a pipe (an error
    may hold them) would break the table."""
    return " ".join(text.split()).replace("|", "\\|")


def _n(value: float | None) -> str:
    """A figure as the JSON holds it, thousands separated; 2.0 as 2."""
    if value is None:
        return "unknown"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return format(value, ",")


def _each(values: Iterable[float | None]) -> str:
    return " / ".join(_n(value) for value in values)


def _span(values: Iterable[float | None]) -> str:
    known = [value for value in values if value is not None]
    if not known:
        return "unknown"
    low, high = min(known), max(known)
    return _n(low) if low == high else f"{_n(low)}-{_n(high)}"


def _steps(figures: dict[str, Any]) -> list[Row]:
    agent, noop = figures["agent_path"], figures["noop_step"]
    return [
        (
            f"agent path, {_n(agent['steps'])} steps ({_n(agent['documents'])} documents)",
            f"{_n(agent['wal_syncs_per_step'])} WAL syncs per step (server noise "
            f"{_n(agent['noise_wal_syncs_per_step'])}); {_n(agent['commits_per_step'])} commits "
            "per step in the database, the capture and timeline writers' included; "
            f"{_n(agent['checkpoints'])} checkpoints; step p50 {_n(agent['step_ms_p50'])} ms "
            f"against a commit p50 of {_n(agent['commit_ms_p50'])} ms: "
            f"{_n(agent['step_over_commit'])} {TIMES}; the step's fenced writes alone "
            f"{_n(agent['writes_over_commit'])} {TIMES}",
        ),
        (
            f"no-op step ({_n(noop['steps'])} steps)",
            f"p50 {_n(noop['step_ms_p50'])} ms, {_n(noop['step_over_commit'])} {TIMES} a commit; "
            f"its fenced write alone {_n(noop['writes_over_commit'])} {TIMES}",
        ),
    ]


def _support_path(figures: dict[str, Any]) -> list[Row]:
    return [
        (
            f"support agent path, {_n(figures['runs'])} runs of {_n(figures['tickets'])} sample "
            f"tickets, {_n(figures['steps'])} steps",
            f"{_n(figures['wal_syncs_per_step'])} WAL syncs per step (server noise "
            f"{_n(figures['noise_wal_syncs_per_step'])}); {_n(figures['commits_per_step'])} "
            "commits per step in the database, the capture and timeline writers' included; "
            f"{_n(figures['mails'])} mails over SMTP and {_n(figures['ticket_updates'])} ticket "
            "updates over HTTP, one of each per run",
        )
    ]


def _capture(figures: dict[str, Any]) -> list[Row]:
    return [
        (
            f"capture hand-over ({_n(figures['copies'])} copies, the evidence tables locked)",
            f"p50 {_n(figures['enqueue_ms_p50'])} ms, p99 {_n(figures['enqueue_ms_p99'])} ms",
        )
    ]


def _evidence_locked(figures: dict[str, Any]) -> list[Row]:
    published = figures["published"]
    completed = sum(1 for run in published if run["outcome"] == "completed" and run["final_answer"])
    return [
        (
            f"evidence locked ({_n(figures['rounds'])} rounds, {_n(figures['documents'])} "
            "documents a run)",
            f"the same run in {_n(figures['baseline_s'])} s unlocked, {_n(figures['share_s'])} s "
            f"under SHARE, {_n(figures['access_exclusive_s'])} s under ACCESS EXCLUSIVE; "
            f"{completed} of {len(published)} runs completed with their final answer; "
            f"{_n(figures['gaps'])} gaps ({_n(figures.get('saved_later', 0))} saved later), "
            f"{_n(figures['captured_while_locked'])} records captured while locked",
        )
    ]


def _peers(figures: dict[str, Any]) -> list[Row]:
    each = "; ".join(
        f"{PEER_NAMES.get(name, name)} {_n(peer['step_ms_p50'])} ms "
        f"({_n(peer['over_commit'])} {TIMES}), {_n(peer['commits_per_step'])} commits and "
        f"{_n(peer['wal_syncs_per_step'])} WAL syncs per step"
        for name, peer in figures["peers"].items()
    )
    versions = ", ".join(f"{package} {version}" for package, version in figures["versions"].items())
    return [
        (
            f"peers, {_n(figures['steps'])} no-op steps {TIMES} {_n(figures['rounds'])} rounds "
            f"(commit p50 {_n(figures['commit_ms_p50'])} ms)",
            f"{each} ({versions})",
        )
    ]


def _throughput(figures: dict[str, Any]) -> list[Row]:
    measured = figures["measured"]
    rows = [
        (
            f"throughput, {_n(figures['batch'])}-run batches of "
            f"{_n(figures['documents_per_run'])} documents ({_n(figures['actions_per_run'])} "
            "actions)",
            f"{_each(m['executors'] for m in measured)} executors: "
            f"{_each(m['runs_s'] for m in measured)} runs/s "
            f"({_each(round(m['actions_s']) for m in measured)} actions/s), against "
            f"{_each(round(m['ceiling_commits_per_s']) for m in measured)} single-row "
            f"commits/s with as many clients; {_span(m['commits_per_run'] for m in measured)} "
            "commits per run (read-only ones included): "
            f"{_each(_percent(m['commits_of_ceiling']) for m in measured)} % of the ceiling; "
            f"{_span(m['executor_cpu_ms_per_run'] for m in measured)} ms of executor CPU per run, "
            f"{_each(m.get('executor_cpu_ms_per_action') for m in measured)} ms per action, "
            "of which the executor's own "
            f"{_each(m.get('own_cpu_ms_per_action') for m in measured)} ms "
            "(runs of the same steps whose tools do nothing) and the tools' "
            f"{_each(m.get('tools_cpu_ms_per_action') for m in measured)} ms",
        )
    ]
    if failover := figures["failover"]:
        rows.append(
            (
                f"failover (lease {_n(failover['lease_ttl_s'])} s)",
                "an executor SIGKILLed with its run: another owner resumed it after "
                f"{_each(failover['failover_s'])} s (target {_n(failover['target_s'])} s)",
            )
        )
    return rows


def _percent(share: float | None) -> int | None:
    return None if share is None else round(100 * share)


def _scale(figures: dict[str, Any]) -> list[Row]:
    measured = figures["measured"]
    return [
        (
            f"Celery scale-out, {figures['broker']} broker, {_n(figures['batch'])}-run batches",
            f"{_each(m['workers'] for m in measured)} workers: "
            f"{_each(m['runs_per_s'] for m in measured)} runs/s",
        )
    ]


def _bundle(figures: dict[str, Any]) -> list[Row]:
    return [
        (
            "investigation bundles (`export_bundle`)",
            "; ".join(
                f"{_n(run['events'])} events in {_n(run['seconds'])} s, peak RSS "
                f"{_n(run['peak_rss_mb'])} MB"
                for run in figures["runs"]
            ),
        )
    ]


def _dashboard(figures: dict[str, Any]) -> list[Row]:
    large_runs, _ = pages.SCALES["large"]
    rows = [
        (
            f"dashboard at {_n(large_runs)} runs",
            "p50: "
            + ", ".join(
                f"{page['page']} {_n(page['p50_ms_large'])} ms" for page in figures["pages"]
            ),
        )
    ]
    if fleet := figures.get("overview"):
        rows.append(
            (
                f"overview and search at {_n(fleet['runs'])} runs, {_n(fleet['events'])} events",
                "p95: "
                + ", ".join(
                    f"{page['page']} {_n(page['p95_ms'])} ms"
                    for page in fleet["overview"] + fleet["search"]
                )
                + "; the search's statement alone: "
                + ", ".join(
                    f"{row['search']} {_n(row['p95_ms'])} ms"
                    for row in fleet.get("search_statement", [])
                )
                + f"; first roll-up {_n(fleet['first_rollup_s'])} s, next "
                f"{_n(fleet['next_rollup_ms'])} ms",
            )
        )
    return rows


def _page_load(figures: dict[str, Any]) -> list[Row]:
    return [
        (
            "cold page to chart (Chromium)",
            ", ".join(
                f"{page['page']} p50 {_n(page['p50_ms'])} ms, max {_n(page['max_ms'])} ms"
                for page in figures["pages"]
            ),
        )
    ]


def _parallel(figures: dict[str, Any]) -> list[Row]:
    return [
        (
            f"{figures['reads']} reads of {figures['delay_ms']} ms",
            f"side by side {_n(figures['side_by_side_ms'])} ms (bound 1.5 {TIMES} "
            f"(delay + 4 commits) = {_n(figures['bound_ms'])} ms: "
            f"{'met' if figures['within_bound'] else 'not met'}), one after another "
            f"{_n(figures['one_after_another_ms'])} ms; {_n(figures['commits_per_read'])} "
            "commits per read",
        )
    ]


def _capacity(figures: dict[str, Any]) -> list[Row]:
    rows = []
    for ours in figures["rundesk"]:
        rows.append(
            (
                f"{_n(ours['runs'])} runs in flight, {_n(figures['tool_s'])}-s tools, "
                "one executor process",
                f"{_n(ours['seconds'])} s ({_n(ours['over_one_run'])} {TIMES} one run's "
                f"{_n(ours['one_run_s'])} s) from the submission's commit (the bench took "
                f"{_n(ours['submit_s'])} s to submit them), {_n(ours['runs_s'])} runs/s, "
                f"{_n(ours['peak_sessions'])} sessions at most, {_n(ours['executor_cpu_s'])} s "
                f"of CPU ({_n(ours['executor_cpu_ms_per_action'])} ms per action), "
                f"{_n(ours['executor_rss_mb'])} MB; {_server_cpu(ours)}; "
                f"{_n(ours['completed'])} completed, "
                f"{_n(ours['reads_dispatched_twice'])} reads sent twice, "
                f"{_n(ours['leases_lost'])} leases lost",
            )
        )
    peer = figures["dbos"]
    if "error" in peer:
        rows.append(("runs in flight, DBOS", f"not measured: {peer['error']}"))
        return rows
    for theirs in peer:
        rows.append(
            (
                f"{_n(theirs['runs'])} workflows in flight, DBOS",
                f"{_n(theirs['seconds'])} s ({_n(theirs['over_one_run'])} {TIMES} one "
                f"workflow's {_n(theirs['one_run_s'])} s), {_n(theirs['peak_sessions'])} "
                f"sessions at most, {_n(theirs['cpu_s'])} s of CPU, {_n(theirs['rss_mb'])} MB; "
                f"{_server_cpu(theirs)}",
            )
        )
    return rows


def _server_cpu(figures: dict[str, Any]) -> str:
    """The server's CPU over a capacity batch, or why it is not known."""
    if figures.get("server_cpu_s") is None:
        return "the server's CPU not measured (not on this machine)"
    per_action = figures.get("server_cpu_ms_per_action")
    return f"the server's CPU {_n(figures['server_cpu_s'])} s" + (
        f" ({_n(per_action)} ms per action)" if per_action is not None else ""
    )


def _purge(figures: dict[str, Any]) -> list[Row]:
    return [
        (
            f"purge of {_n(figures['runs_purged'])} ended runs while runs execute",
            f"{_n(figures['rows_purged'])} rows in {_n(figures['purge_s'])} s "
            f"({_n(figures['purged_runs_per_s'])} runs/s, {_n(figures['batches'])} batches); "
            f"step p50 {_n(figures['step_ms_p50_purging'])} ms against "
            f"{_n(figures['step_ms_p50_quiet'])} ms quiet: "
            f"{_n(figures['step_time_ratio'])} {TIMES} (target 1.1: "
            f"{'met' if figures['within_target'] else 'not met'})",
        )
    ]


# Each benchmark's rows, by its key in `bench --all --json`.
ROWS: dict[str, Callable[[dict[str, Any]], list[Row]]] = {
    "steps": _steps,
    "support_path": _support_path,
    "capture": _capture,
    "parallel": _parallel,
    "evidence_locked": _evidence_locked,
    "peers": _peers,
    "throughput": _throughput,
    "capacity": _capacity,
    "scale": _scale,
    "bundle": _bundle,
    "dashboard": _dashboard,
    "page_load": _page_load,
    "purge": _purge,
}
