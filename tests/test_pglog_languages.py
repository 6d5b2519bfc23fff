"""Reports of servers with a non-English lc_messages, and the catalog that
reads them: built by `manage.py pglog_catalog` from PostgreSQL's own .po
files, never typed by hand.

tests/fixtures/pglog/lang/<lang>.log is one scenario (three processes,
their log_lock_waits messages, another session's lines between) as a
server logs it in that language: its words are PostgreSQL's translations
(the installed 15.20 catalogs; pt_BR's from postgres/postgres), its lock
modes untranslated, as the server leaves them, and what a catalog does not
translate (ka's lock waits) in English, as the server writes it."""

from __future__ import annotations

import datetime as dt
import importlib.util
import re
import subprocess
from io import StringIO
from pathlib import Path
from types import ModuleType

import pytest
from django.core.management import CommandError, call_command

from evidence import pglog, pglog_catalog, pglog_po

FIXTURES = Path(__file__).parent / "fixtures" / "pglog"
LANGUAGES = ["de", "fr", "es", "it", "pt_BR", "ru", "ja", "zh_CN", "ko", "sv", "uk", "ka", "zh_TW"]
# The zone each scenario's log_timezone prints (%m), as an offset.
OFFSETS = {
    **{"de": 1, "fr": 1, "es": -3, "it": 1, "pt_BR": -3, "ru": 3, "ja": 9, "zh_CN": 8},
    **{"ko": 9, "sv": 1, "uk": 2, "ka": 4, "zh_TW": 8},
}
# The CONTEXT each server wrote, in its own words.
CONTEXTS = {
    "de": "beim Sperren von Tupel (0,7) in Relation »evidence_modelcall«",
    "fr": "lors du verrouillage de la ligne (0,7) dans la relation « evidence_modelcall »",
    "es": "mientras se bloqueaba la tupla (0,7) de la relación «evidence_modelcall»",
    "it": 'durante il blocco della tupla (0,7) nella relazione "evidence_modelcall"',
    "pt_BR": 'while locking tuple (0,7) in relation "evidence_modelcall"',  # not translated then
    "ru": 'при блокировке кортежа (0,7) в отношении "evidence_modelcall"',
    "ja": 'リレーション"evidence_modelcall"のタプル(0,7)のロック中',
    "zh_CN": '锁定关系 "evidence_modelcall" 中的元组 (0,7) 时',
    "ko": '0,7 튜플을 "evidence_modelcall" 릴레이션에서 잠그는 중에 발생',
    "sv": 'vid låsning av tupel (0,7) i relation "evidence_modelcall"',
    "uk": 'при блокуванні кортежу (0,7) в зв\'язку "evidence_modelcall"',
    "ka": 'კორტეჟის (0,7) დაბლოკვისას ურთიერთობაში "evidence_modelcall"',
    "zh_TW": '鎖定關聯 "evidence_modelcall" 中的元組 (0,7) 時',
}


@pytest.mark.parametrize("language", LANGUAGES)
def test_a_translated_report_reads_like_the_english_one(language):
    (report,) = pglog.parse((FIXTURES / "lang" / f"{language}.log").read_text())
    # Lock modes as the server leaves them; what is locked in English.
    assert [(e.waiter, e.blocker, e.mode, e.lock_type, e.locked) for e in report.graph.edges] == [
        (4102, 4103, "ShareLock", "transaction", "transaction 9001"),
        (4103, 4104, "ShareLock", "transaction", "transaction 9002"),
        (
            4104,
            4102,
            "ExclusiveLock",
            "tuple",
            "tuple (0,7) of relation 16402 of database 16384",
        ),
    ]
    assert report.graph.cycle() == [4102, 4103, 4104]
    assert report.graph.processes[4104].query == (
        "UPDATE evidence_source SET changed = false WHERE id = 5"
    )
    zone = dt.timezone(dt.timedelta(hours=OFFSETS[language]))
    assert report.time == dt.datetime(2026, 11, 29, 10, 0, 1, 456000, zone)
    assert report.reporter == 4102
    assert report.context == CONTEXTS[language]
    assert report.statement == "SELECT id FROM evidence_modelcall WHERE id = 7 FOR SHARE"
    # The log_lock_waits messages (and their DETAIL) before it, translated too.
    assert [(w.waiter, w.holders, w.locked, w.waited_ms) for w in report.lead_up] == [
        (4103, [4104], "transaction 9002", 1000),
        (4104, [4102], "tuple (0,7) of relation 16402 of database 16384", 1000),
        (4102, [4103], "transaction 9001", 1000),
    ]
    assert report.unread == []


def test_logs_of_several_languages_in_one_file_are_each_read():
    # Each a deadlock of its own: its first transaction is another one.
    text = "".join(
        (FIXTURES / "lang" / f"{language}.log").read_text().replace("9001", str(9100 + number))
        for number, language in enumerate(LANGUAGES)
    )
    reports = pglog.parse(text)
    assert [r.graph.cycle() for r in reports] == [[4102, 4103, 4104]] * len(LANGUAGES)
    assert [r.graph.edges[0].locked for r in reports] == [
        f"transaction {9100 + number}" for number in range(len(LANGUAGES))
    ]
    assert [r.time.utcoffset().total_seconds() / 3600 for r in reports] == [
        OFFSETS[language] for language in LANGUAGES
    ]


def test_the_committed_catalog_holds_every_language_for_the_report():
    assert set(pglog_catalog.CATALOGS) == set(LANGUAGES)
    for name in ("deadlock", "waits", "process_query", "label:HINT", "lock:transaction"):
        assert set(pglog_catalog.MESSAGES[name]) >= {"en", "de", "ru", "ja", "zh_CN"}, name
    assert "PostgreSQL 15.20" in pglog_catalog.ORIGIN
    assert "0016f8e311c5d9f7822057adbcdf09b768d936bc" in pglog_catalog.ORIGIN
    # Every message of the generator's list is in it, English at least.
    assert [m.name for m in pglog_po.MESSAGES] == list(pglog_catalog.MESSAGES)
    assert all("en" in forms for forms in pglog_catalog.MESSAGES.values())


# -- the generator --------------------------------------------------------------------


def load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("generated_catalog", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_generator_reproduces_a_small_table_from_a_tiny_po_file(tmp_path):
    source = FIXTURES / "po"
    out = StringIO()
    call_command(
        "pglog_catalog", str(source), "--languages", "de", "--output", str(tmp_path / "c.py"),
        stdout=out,
    )  # fmt: skip
    table = load(tmp_path / "c.py")
    assert f"src/backend/po of the PostgreSQL source tree {source}" == table.ORIGIN
    assert table.CATALOGS == {"de": "PostgreSQL 99, 2026-01-01 00:00+0000"}
    assert table.MESSAGES["deadlock"] == {
        "en": [r"deadlock\s+detected"],
        "de": [r"Verklemmung\s+entdeckt"],
    }
    # Positional arguments, reordered and over two lines of the .po file.
    assert table.MESSAGES["waits"]["de"] == [
        r"Prozess\s+(?P<waiter>-?\d+)\s+wartet\s+\(blockiert\s+von\s+(?P<blocker>-?\d+)\)"
        r"\s+auf\s+(?P<mode>[A-Za-z]+)\-Sperre\s+auf\s+(?P<lock>.{1,300}?)\."
    ]
    assert len(table.MESSAGES["holders"]["en"]) == 2  # msgid and msgid_plural
    assert table.MESSAGES["holders"]["de"][1] == (
        r"Sperre\s+halten:\s+(?P<holders>\d+(?:,\s*\d+)*)\.\s+Warteschlange:"
        r"\s+(?P<queue>\d*(?:,\s*\d+)*)\."
    )
    assert table.MESSAGES["label:DETAIL"] == {"en": ["DETAIL:"], "de": ["EINZELHEIT:"]}
    # Fuzzy and untranslated entries are left out: English only.
    translated = {"deadlock", "waits", "holders", "label:DETAIL"}
    assert all(
        list(forms) == ["en"] for name, forms in table.MESSAGES.items() if name not in translated
    )
    match = re.search(
        table.MESSAGES["waits"]["de"][0],
        "Prozess 12 wartet (blockiert von 13) auf ShareLock-Sperre auf Transaktion 5.",
    )
    assert match.groupdict() == {
        "waiter": "12",
        "blocker": "13",
        "mode": "ShareLock",
        "lock": "Transaktion 5",
    }


def test_the_generator_reads_a_git_directory_and_names_the_commit(tmp_path):
    repo = tmp_path / "postgres"
    po = repo / "src" / "backend" / "po"
    po.mkdir(parents=True)
    (po / "de.po").write_text((FIXTURES / "po" / "src" / "backend" / "po" / "de.po").read_text())

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
            check=True, capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip

    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "catalogs")
    commit = git("rev-parse", "HEAD")
    output = tmp_path / "c.py"
    call_command(
        "pglog_catalog", str(repo / ".git"), "--languages", "de", "--output", str(output),
        stdout=StringIO(),
    )  # fmt: skip
    assert f"src/backend/po of PostgreSQL commit {commit}" == load(output).ORIGIN
    assert f"PostgreSQL commit {commit}" in output.read_text().split('"""')[1]


def test_the_generator_refuses_what_it_cannot_read(tmp_path):
    with pytest.raises(CommandError, match="neither a PostgreSQL checkout nor a git directory"):
        call_command("pglog_catalog", str(tmp_path), "--output", str(tmp_path / "c.py"))
    with pytest.raises(CommandError, match=r"cannot read src/backend/po/xx\.po"):
        call_command(
            "pglog_catalog", str(FIXTURES / "po"), "--languages", "xx",
            "--output", str(tmp_path / "c.py"),
        )  # fmt: skip
    with pytest.raises(pglog_po.CatalogError, match=r"line 3 is not \.po syntax"):
        pglog_po.read_po("de", 'msgid "a"\nmsgstr "b"\nnonsense\n')
    assert not (tmp_path / "c.py").exists()


@pytest.mark.parametrize(
    ("template", "args", "text", "groups"),
    [
        ("after %ld.%03d ms", ("ms", "ms_fraction"), "after 1000.072 ms", ("1000", "072")),
        ("%2$s an %1$d", ("pid", "mode"), "ShareLock an 7", ("7", "ShareLock")),
        ("100%% of %s", ("query",), "100% of SELECT 1", ("SELECT 1",)),
        ("Process %d: %s", ("pid", "query"), "Process 7: SELECT  1 ", ("7", "SELECT  1 ")),
    ],
)
def test_printf_placeholders_become_named_groups(template, args, text, groups):
    match = re.fullmatch(pglog_po.printf_regex(template, args), text)
    assert match is not None
    assert tuple(match[name] for name in args) == groups


def test_a_client_quoting_a_german_servers_report():
    """psycopg's message when the server's lc_messages is German: the
    message and the labels in German, the lock modes as they are."""
    output = (
        "psycopg.errors.DeadlockDetected: Verklemmung (Deadlock) entdeckt\n"
        "DETAIL:  Prozess 12749 wartet auf ShareLock-Sperre auf Transaktion 102047; "
        "blockiert von Prozess 12750.\n"
        "Prozess 12750 wartet auf ShareLock-Sperre auf Transaktion 102046; "
        "blockiert von Prozess 12749.\n"
        "TIPP:  Einzelheiten zur Anfrage finden Sie im Serverlog.\n"
        "ZUSAMMENHANG:  beim Aktualisieren von Tupel (0,2) in Relation »accounts«\n"
    )
    (report,) = pglog.parse(output)
    assert [(e.waiter, e.blocker, e.mode, e.locked) for e in report.graph.edges] == [
        (12749, 12750, "ShareLock", "transaction 102047"),
        (12750, 12749, "ShareLock", "transaction 102046"),
    ]
    assert report.context == "beim Aktualisieren von Tupel (0,2) in Relation »accounts«"


@pytest.mark.parametrize("language", ["de", "fr", "es", "it", "pt_BR", "sv"])
def test_a_sql_ascii_servers_report_with_a_question_mark_for_each_accent_is_read(language):
    """A database of encoding SQL_ASCII has gettext write the translation
    in ASCII: glibc writes "?" for each letter ASCII does not hold
    ("interblocage (deadlock) d?tect?").  A form of Latin letters matches
    with them; the CONTEXT is kept as written."""
    text = (FIXTURES / "lang" / f"{language}.log").read_text()
    (whole,) = pglog.parse(text)
    (report,) = pglog.parse(re.sub(r"[^\x00-\x7f]", "?", text))
    assert {**report.as_json(), "context": whole.context} == whole.as_json()
    assert report.context == re.sub(r"[^\x00-\x7f]", "?", whole.context)


def test_a_word_of_question_marks_alone_is_no_translation_read():
    """Korean, Japanese or Chinese in ASCII are words of "?" that could be
    any word of their length: not read as any message."""
    for language in ("ko", "ja", "zh_CN", "ru"):
        text = (FIXTURES / "lang" / f"{language}.log").read_text()
        assert pglog.parse(re.sub(r"[^\x00-\x7f]", "?", text)) == [], language
