from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from evidence import pglog_po

LANGUAGES = ["de", "fr", "es", "it", "pt_BR", "ru", "ja", "zh_CN", "ko", "sv", "uk", "ka", "zh_TW"]
PO_DIR = "src/backend/po"
OUTPUT = Path(__file__).resolve().parents[2] / "pglog_catalog.py"


class Command(BaseCommand):
    help = (
        "Writes evidence/pglog_catalog.py, the table import_pg_log reads translated server "
        "logs with, from PostgreSQL's message catalogs (src/backend/po/<lang>.po) in a "
        "source checkout or a git directory."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("source", help="a PostgreSQL source checkout, or its git directory")
        parser.add_argument("--rev", default="HEAD", help="the commit to read, in a git directory")
        parser.add_argument("--languages", default=",".join(LANGUAGES))
        parser.add_argument("--output", default=str(OUTPUT))
        parser.add_argument(
            "--origin", help="what the catalogs are, for the header (default: the commit read)"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        source = Path(options["source"])
        languages = [code for code in options["languages"].split(",") if code]
        read, commit = _reader(source, options["rev"])
        catalogs = []
        for language in languages:
            path = f"{PO_DIR}/{language}.po"
            try:
                catalogs.append(pglog_po.read_po(language, read(path)))
            except (OSError, subprocess.CalledProcessError) as error:
                raise CommandError(f"cannot read {path} from {source}: {error}") from None
            except pglog_po.CatalogError as error:
                raise CommandError(f"{path}: {error}") from None
        origin = options["origin"] or (
            f"src/backend/po of PostgreSQL commit {commit}"
            if commit
            else f"src/backend/po of the PostgreSQL source tree {source}"
        )
        Path(options["output"]).write_text(pglog_po.module_text(catalogs, origin))
        self.stdout.write(f"{options['output']}: {', '.join(languages)} from {origin}")


def _reader(source: Path, rev: str) -> tuple[Callable[[str], str], str]:
    """How to read a file of `source` (a checkout, or a git directory at
    `rev`), and the commit it is."""
    if (source / PO_DIR).is_dir():
        return (lambda path: (source / path).read_text()), _commit(source / ".git", "HEAD")
    if (source / "HEAD").is_file():
        return (lambda path: _git(source, "show", f"{rev}:{path}")), _commit(source, rev)
    raise CommandError(f"{source} is neither a PostgreSQL checkout nor a git directory")


def _git(git_dir: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "--git-dir", str(git_dir), *args], check=True, capture_output=True, text=True
    ).stdout


def _commit(git_dir: Path, rev: str) -> str:
    """The commit `rev` names in `git_dir`, or "" when there is none."""
    try:
        return _git(git_dir, "rev-parse", "--verify", f"{rev}^{{commit}}").strip()
    except (OSError, subprocess.CalledProcessError):
        return ""
