"""docs/BENCHMARKS.md: `bench --all --markdown` writes the figures of one run
as one table, with the machine, the date and the command; the README is a
user's document, with no figures and no history."""

from __future__ import annotations

import copy
import datetime as dt
import json
import os
import re
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection

from runs.benchmarks import document
from runs.management.commands import bench

ROOT = Path(__file__).resolve().parent.parent

MACHINE = document.Machine(
    cpu="Intel Xeon Gold 6338",
    cores=2,
    memory_gib=23.5,
    postgresql="16.2 (synchronous_commit=on, wal_sync_method=fdatasync)",
)
COMMAND = "DEBUG=0 python manage.py bench --all --steps 500 --rounds 3 --json --markdown x.md"
DAY = dt.date(2026, 12, 3)

# `bench --all --json` as the benchmarks report it, cut to what a row shows
# and a little more (the renderer must take the whole of it).
SAMPLE: dict[str, Any] = {
    "steps": {
        "agent_path": {
            "steps": 500,
            "documents": 249,
            "commits_per_step": 1.172,
            "wal_syncs_per_step": 1.038,
            "noise_wal_syncs_per_step": 0.0,
            "checkpoints": 4,
            "step_ms_p50": 1.21,
            "commit_ms_p50": 0.45,
            "step_over_commit": 2.69,
            "writes_ms_p50": 0.8,
            "writes_over_commit": 1.77,
        },
        "noop_step": {
            "steps": 500,
            "step_ms_p50": 0.62,
            "commit_ms_p50": 0.27,
            "step_over_commit": 2.27,
            "writes_ms_p50": 0.53,
            "writes_over_commit": 1.97,
            "roundtrip_ms_p50": 0.12,
        },
    },
    "support_path": {
        "steps": 320,
        "runs": 40,
        "tickets": 4,
        "commits_per_step": 1.922,
        "wal_syncs_per_step": 1.272,
        "noise_wal_syncs_per_step": 0.0,
        "mails": 40,
        "ticket_updates": 40,
    },
    "capture": {
        "copies": 500,
        "enqueue_ms_p50": 0.008,
        "enqueue_ms_p99": 0.035,
        "enqueue_ms_max": 0.2,
        "queue_capacity": 125,
    },
    "parallel": {
        "reads": 20,
        "delay_ms": 200,
        "commit_ms_p50": 0.329,
        "side_by_side_ms": 208.5,
        "bound_ms": 302.0,
        "within_bound": True,
        "one_after_another_ms": 4069.6,
        "commits_per_read": 0.65,
    },
    "evidence_locked": {
        "rounds": 2,
        "documents": 5,
        "baseline_s": 0.049,
        "share_s": 0.043,
        "access_exclusive_s": 0.05,
        "published": [
            {"lock": lock, "run_id": i, "outcome": "completed", "final_answer": i != 3}
            for i, lock in enumerate(["none", "SHARE", "ACCESS EXCLUSIVE"] * 2)
        ],
        "gaps": 66,
        "captured_while_locked": 0,
    },
    "peers": {
        "steps": 500,
        "rounds": 3,
        "commit_ms_p50": 0.32,
        "noise_wal_syncs_per_s": 0.0,
        "peers": {
            "dbos": {
                "step_ms_p50": 2.55,
                "over_commit": 8.6,
                "commits_per_step": 4.09,
                "wal_syncs_per_step": 1.004,
                "guarantee": "...",
            },
            "rundesk": {
                "step_ms_p50": 0.64,
                "over_commit": 2.06,
                "commits_per_step": 1.03,
                "wal_syncs_per_step": 1.006,
                "guarantee": "...",
            },
        },
        "fastest": "rundesk",
        "fewest_wal_syncs": "dbos, rundesk",
        "versions": {"dbos": "3.4.0"},
        "server": {"postgresql": "16.2"},
    },
    "capacity": {
        "tool_s": 1.0,
        "rundesk": [
            {
                "runs": 1000,
                "one_run_s": 8.3,
                "submit_s": 2.1,
                "seconds": 15.1,
                "over_one_run": 1.82,
                "runs_s": 66.2,
                "peak_sessions": 17,
                "executor_cpu_s": 12.5,
                "executor_cpu_ms_per_action": 1.56,
                "executor_rss_mb": 180.5,
                "server_cpu_s": 20.4,
                "server_cpu_ms_per_action": 2.55,
                "completed": 1000,
                "reads_dispatched_twice": 0,
                "leases_lost": 0,
            }
        ],
        "dbos": {"error": "bench --capacity's peer needs the bench extra"},
    },
    "throughput": {
        "batch": 100,
        "documents_per_run": 3,
        "actions_per_run": 8,
        "measured": [
            {
                "executors": 1,
                "runs_s": 34.9,
                "actions_s": 279.2,
                "ceiling_commits_per_s": 3651.4,
                "commits_per_run": 23.0,
                "commits_of_ceiling": 0.22,
                "executor_cpu_ms_per_run": 21.4,
                "executor_cpu_ms_per_action": 2.68,
                "own_cpu_ms_per_action": 1.1,
                "tools_cpu_ms_per_action": 1.58,
            },
            {
                "executors": 4,
                "runs_s": 36.2,
                "actions_s": 289.6,
                "ceiling_commits_per_s": 5536.0,
                "commits_per_run": 25.5,
                "commits_of_ceiling": 0.17,
                "executor_cpu_ms_per_run": None,
            },
        ],
        "failover": {"failover_s": [1.79, 1.8], "lease_ttl_s": 2.0, "target_s": 3.0},
    },
    "scale": {
        "broker": "filesystem",
        "batch": 100,
        "measured": [{"workers": 1, "runs_per_s": 15.9}, {"workers": 2, "runs_per_s": 20.4}],
    },
    "bundle": {
        "runs": [
            {"events": 10000, "seconds": 3.6, "peak_rss_mb": 123.0},
            {"events": 200000, "seconds": 16.8, "peak_rss_mb": 123.4},
        ]
    },
    "dashboard": {
        "pages": [
            {"page": "runs list", "p50_ms_large": 35.0},
            {"page": "capture gaps", "p50_ms_large": 55.5},
        ]
    },
    "page_load": {
        "pages": [
            {"page": "run page", "loads": 10, "p50_ms": 420.5, "max_ms": 610.0},
            {"page": "lock incident page", "loads": 10, "p50_ms": 400.0, "max_ms": 580.2},
        ]
    },
    "purge": {
        "runs_purged": 100000,
        "rows_purged": 1700000,
        "purge_s": 95.2,
        "purged_runs_per_s": 1050.4,
        "batches": 200,
        "skipped": 0,
        "step_ms_p50_quiet": 3.1,
        "step_ms_p50_purging": 3.3,
        "step_ms_p95_quiet": 4.0,
        "step_ms_p95_purging": 4.6,
        "step_time_ratio": 1.065,
        "within_target": True,
        "runs_driven": {"quiet": 400, "purging": 900},
    },
}


def table_rows(markdown: str) -> dict[str, str]:
    """The table's rows, label to figure; every row has exactly two cells."""
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    assert lines[:2] == ["| benchmark | figure |", "|---|---|"]
    rows = {}
    for line in lines[2:]:
        cells = re.split(r"(?<!\\)\|", line)
        assert len(cells) == 4 and cells[0] == cells[-1] == "", line
        rows[cells[1].strip()] = cells[2].strip()
    return rows


def test_the_document_is_one_table_with_the_machine_date_and_command():
    text = document.markdown(SAMPLE, MACHINE, DAY, COMMAND)

    assert text.startswith("# Benchmarks\n")
    assert "- Date: 2026-12-03\n" in text
    assert "- Machine: 2 cores (Intel Xeon Gold 6338), 24 GiB of memory\n" in text
    assert "- PostgreSQL: 16.2 (synchronous_commit=on, wal_sync_method=fdatasync)\n" in text
    assert f"- Command: `{COMMAND}`\n" in text
    assert text.count("| benchmark | figure |") == 1
    rows = table_rows(text)
    assert list(rows) == [
        "agent path, 500 steps (249 documents)",
        "no-op step (500 steps)",
        "support agent path, 40 runs of 4 sample tickets, 320 steps",
        "capture hand-over (500 copies, the evidence tables locked)",
        "20 reads of 200 ms",
        "evidence locked (2 rounds, 5 documents a run)",
        "peers, 500 no-op steps \N{MULTIPLICATION SIGN} 3 rounds (commit p50 0.32 ms)",
        "1,000 runs in flight, 1-s tools, one executor process",
        "runs in flight, DBOS",
        "throughput, 100-run batches of 3 documents (8 actions)",
        "failover (lease 2 s)",
        "Celery scale-out, filesystem broker, 100-run batches",
        "investigation bundles (`export_bundle`)",
        "dashboard at 100,000 runs",
        "cold page to chart (Chromium)",
        "purge of 100,000 ended runs while runs execute",
    ]
    assert (
        "step p50 1.21 ms against a commit p50 of 0.45 ms: 2.69 \N{MULTIPLICATION SIGN}"
        in rows["agent path, 500 steps (249 documents)"]
    )
    support = rows["support agent path, 40 runs of 4 sample tickets, 320 steps"]
    assert support.startswith("1.272 WAL syncs per step (server noise 0); 1.922 commits per step")
    assert support.endswith(
        "40 mails over SMTP and 40 ticket updates over HTTP, one of each per run"
    )
    assert (
        "5 of 6 runs completed with their final answer"
        in rows["evidence locked (2 rounds, 5 documents a run)"]
    )
    capacity = rows["1,000 runs in flight, 1-s tools, one executor process"]
    assert capacity.startswith("15.1 s (1.82 \N{MULTIPLICATION SIGN} one run's 8.3 s)")
    assert "17 sessions at most" in capacity and "0 leases lost" in capacity
    assert "from the submission's commit (the bench took 2.1 s to submit them)" in capacity
    assert "the server's CPU 20.4 s (2.55 ms per action)" in capacity
    throughput = rows["throughput, 100-run batches of 3 documents (8 actions)"]
    assert throughput.startswith("1 / 4 executors: 34.9 / 36.2 runs/s (279 / 290 actions/s)")
    assert "against 3,651 / 5,536 single-row commits/s" in throughput
    assert "23-25.5 commits per run" in throughput
    assert "22 / 17 % of the ceiling" in throughput
    assert rows["cold page to chart (Chromium)"] == (
        "run page p50 420.5 ms, max 610 ms, lock incident page p50 400 ms, max 580.2 ms"
    )
    assert "21.4 ms of executor CPU per run" in throughput  # the unknown one left out
    assert (
        "2.68 / unknown ms per action, of which the executor's own 1.1 / unknown ms (runs of"
        " the same steps whose tools do nothing) and the tools' 1.58 / unknown ms" in throughput
    )
    assert rows["failover (lease 2 s)"].endswith("after 1.79 / 1.8 s (target 3 s)")
    assert rows["investigation bundles (`export_bundle`)"] == (
        "10,000 events in 3.6 s, peak RSS 123 MB; 200,000 events in 16.8 s, peak RSS 123.4 MB"
    )
    peers = rows["peers, 500 no-op steps \N{MULTIPLICATION SIGN} 3 rounds (commit p50 0.32 ms)"]
    assert peers.startswith(
        "DBOS 2.55 ms (8.6 \N{MULTIPLICATION SIGN}), 4.09 commits and 1.004 WAL syncs per step;"
    )
    assert peers.endswith("(dbos 3.4.0)")
    assert rows["purge of 100,000 ended runs while runs execute"] == (
        "1,700,000 rows in 95.2 s (1,050.4 runs/s, 200 batches); step p50 3.3 ms against "
        "3.1 ms quiet: 1.065 \N{MULTIPLICATION SIGN} (target 1.1: met)"
    )


def test_a_benchmark_that_failed_says_why_in_its_row_and_the_others_are_shown():
    report = copy.deepcopy(SAMPLE)
    report["peers"] = {"error": "bench --peers: install the extra | pip install -e '.[bench]'\n"}
    report["steps"] = {"error": "bench --steps: could not claim bench run 7"}

    rows = table_rows(document.markdown(report, MACHINE, DAY, COMMAND))

    assert rows["peers"] == (
        "failed: bench --peers: install the extra \\| pip install -e '.[bench]'"
    )
    assert rows["agent path and no-op step"] == (
        "failed: bench --steps: could not claim bench run 7"
    )
    assert len(rows) == 15  # the two rows of steps became one
    assert "dashboard at 100,000 runs" in rows
    assert rows["20 reads of 200 ms"].startswith("side by side 208.5 ms (bound")


def test_every_benchmark_of_bench_has_its_rows_and_a_name_for_its_failure():
    assert list(document.ROWS) == list(document.TITLES) == list(bench.BENCHMARKS)


@pytest.mark.django_db
def test_the_machine_is_read_from_this_machine_and_the_databases_server():
    machine = document.Machine.here()

    with connection.cursor() as cursor:
        cursor.execute("SHOW server_version")
        (version,) = cursor.fetchone()
    assert machine.cores == os.cpu_count()
    assert machine.cpu
    assert 0 < machine.memory_gib < 1 << 20
    assert machine.postgresql.startswith(f"{version} (synchronous_commit=")


def test_markdown_needs_all_and_a_folder_before_any_benchmark_runs(tmp_path):
    with pytest.raises(CommandError, match="--markdown needs --all"):
        call_command("bench", "--markdown", str(tmp_path / "BENCHMARKS.md"))
    with pytest.raises(CommandError, match="there is no folder"):
        call_command("bench", "--all", "--markdown", str(tmp_path / "none" / "BENCHMARKS.md"))


@pytest.mark.django_db
def test_bench_all_writes_the_document_beside_an_unchanged_json(tmp_path, monkeypatch):
    # The benchmarks themselves are tested apart (test_commands, test_bench_*):
    # here each reports its sample figures at once, and peers fails.
    def fails(options: dict[str, Any]) -> Any:
        raise RuntimeError("the bench extra is not installed")

    measured = {name: (lambda options, name=name: SAMPLE[name]) for name in bench.BENCHMARKS}
    monkeypatch.setattr(bench, "BENCHMARKS", {**measured, "peers": fails})
    path = tmp_path / "BENCHMARKS.md"
    path.write_text("the figures of another run\n")
    out = StringIO()

    with pytest.raises(CommandError, match="peers failed"):
        call_command("bench", "--all", "--json", "--markdown", str(path), stdout=out)

    expected = {**SAMPLE, "peers": {"error": "bench --peers: the bench extra is not installed"}}
    assert json.loads(out.getvalue()) == expected
    text = path.read_text()
    assert f"--all --steps 500 --rounds 3 --json --markdown {path}`" in text
    rows = table_rows(text)
    assert rows["peers"] == "failed: bench --peers: the bench extra is not installed"
    assert "dashboard at 100,000 runs" in rows
    assert list(tmp_path.iterdir()) == [path]  # no partial file left beside it


def test_make_bench_rewrites_the_benchmarks_document():
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("\nbench:", 1)[1].split("\n\n", 1)[0]
    assert "manage.py bench --all --json --markdown docs/BENCHMARKS.md" in recipe
    # On a fresh machine too: bench --page-load drives Debian's Chromium.
    assert "$(CHROMIUM)" in recipe.split("\n", 1)[0]
    committed = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    assert committed.startswith("# Benchmarks\n")
    assert set(table_rows(committed)) >= {"failover (lease 2 s)", "dashboard at 100,000 runs"}


# Words that speak of when and on what the project was measured or made,
# not of what it does: the figures live in docs/BENCHMARKS.md, with their
# machine and date, and nowhere else.
HISTORY = [
    "latest figures",
    "latest session",
    "this session",
    "the session before",
    "machine of 20",
    "earlier machines",
    "slower machine",
    "development machine",
    "pgbench",
]


@pytest.mark.parametrize("name", ["README.md", "docs/DESIGN.md"])
def test_the_users_documents_hold_no_figures_history(name):
    text = " ".join((ROOT / name).read_text().lower().split())
    assert [phrase for phrase in HISTORY if phrase in text] == []
