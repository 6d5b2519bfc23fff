"""A document path that names no file of the corpus is refused when the
run is submitted, in the words the read tool uses when it reads one, and
nothing is queued; a document that is not there yet may still come."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from runs.agent import ToolRefused
from runs.agents.tools import read_document
from runs.models import Run
from runs.submission import submit
from tests.tool_calls import call

pytestmark = pytest.mark.django_db


@pytest.fixture
def corpus(tmp_path: Path, settings) -> Path:
    """A corpus with a sheet, a folder, links that stay and links that
    leave, and a secret beside it."""
    root = tmp_path / "corpus"
    (root / "funds").mkdir(parents=True)
    (root / "fund.md").write_text("# Fund\n")
    (tmp_path / "secret.txt").write_text("outside the corpus\n")
    (root / "alias.md").symlink_to(root / "fund.md")
    (root / "escape.md").symlink_to(tmp_path / "secret.txt")
    (root / "elsewhere").symlink_to(tmp_path)
    (root / "dangling.md").symlink_to(tmp_path / "not-yet.txt")
    (root / "loop.md").symlink_to(root / "loop.md")
    settings.RUNDESK_CORPUS_DIR = root
    return root


def refusal_when_read(path: str) -> str:
    with pytest.raises(ToolRefused) as refused:
        read_document({"path": path}, call("rundesk:run-1:read:0"))
    return str(refused.value)


NO_CORPUS_PATHS = [
    "../../etc/passwd",
    "/etc/passwd",
    "//etc/passwd",
    "funds/../../secret.txt",
    "funds/../fund.md",
    "escape.md",
    "elsewhere/secret.txt",
    "dangling.md",
    "funds",
    "loop.md",
]


@pytest.mark.parametrize("path", NO_CORPUS_PATHS)
def test_submit_run_refuses_a_path_the_read_tool_refuses_in_its_words(corpus, path):
    said = refusal_when_read(path)

    with pytest.raises(CommandError) as refused:
        call_command("submit_run", "--question", "Compare", "--doc", "fund.md", "--doc", path)

    assert str(refused.value) == said
    assert not Run.objects.exists()


@pytest.mark.parametrize("path", NO_CORPUS_PATHS)
def test_no_submission_queues_a_run_that_names_no_corpus_path(corpus, path):
    with pytest.raises(ValueError) as refused:
        submit(question="Compare", documents=[path])
    assert str(refused.value) == refusal_when_read(path)
    assert not Run.objects.exists()


@pytest.mark.parametrize("path", ["fund.md", "alias.md", "funds/added-later.md", "later.md"])
def test_a_corpus_path_is_queued_even_before_its_document_is_there(corpus, path):
    run = submit(question="Compare", documents=[path])
    assert Run.objects.get().documents == [path] == run.documents
