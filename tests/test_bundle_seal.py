"""A bundle's seal means something: its manifest is signed with this
installation's Ed25519 key, and a bundle verifies (and opens) only when
its signer is this installation or a key trusted here.  Forged bundles --
a file edited and every hash and the old checksum seal recomputed, the
installation renamed, a lock incident invented, the signature stripped or
made with another key -- are refused, and say why."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import zipfile
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.test import override_settings

from dashboard import settings as project_settings
from evidence import bundle_signing, bundles
from evidence.bundle_signing import SignerKind
from evidence.opening import OpenRefused, open_bundle
from runs.models import Run
from tests import test_bundles

pytestmark = pytest.mark.django_db(transaction=True)

decided_run = test_bundles.decided_run  # a fixture: a run an operator settled

OTHER_SEED = bytes(range(32))


def entries(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as bundle:
        return {name: bundle.read(name) for name in bundle.namelist()}


def forged(original: Path, tmp_path: Path, change, *, sign_with: bytes | None = None) -> Path:
    """The bundle with `change(files, manifest)` applied, every file's size
    and hash recomputed, and sealed again as the old checksum seal was;
    signed again with the key `sign_with` (its seed) when given."""
    files = entries(original)
    manifest = json.loads(files.pop("manifest.json"))
    change(files, manifest)
    manifest["files"] = {
        name: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        for name, data in files.items()
    }
    manifest["seal"] = bundles.seal_of(manifest)
    if sign_with is not None:
        with override_settings(RUNDESK_BUNDLE_SIGNING_KEY=sign_with):
            bundles.sign(manifest)
    files["manifest.json"] = json.dumps(manifest).encode()
    path = tmp_path / f"forged-{len(list(tmp_path.iterdir()))}.zip"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as bundle:
        for name, data in files.items():
            bundle.writestr(name, data)
    return path


def another_question(files: dict[str, bytes], manifest: dict) -> None:
    run = json.loads(files["run.json"])
    run["question"] = "Which fund should we sell?"
    files["run.json"] = bundles.canonical(run) + b"\n"


def another_installation(files: dict[str, bytes], manifest: dict) -> None:
    manifest["installation"] = "headquarters"


def an_invented_lock_incident(files: dict[str, bytes], manifest: dict) -> None:
    incident = {"id": 999, "title": "invented deadlock", "source": "pg_log"}
    files["lock_incidents.jsonl"] += bundles.canonical(incident) + b"\n"


def no_signature(files: dict[str, bytes], manifest: dict) -> None:
    del manifest["signature"]


def verify_command(path: Path, *args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    try:
        call_command("verify_bundle", str(path), *args, stdout=out, stderr=err)
    except SystemExit as exit:
        return int(exit.code), out.getvalue(), err.getvalue()
    return 0, out.getvalue(), err.getvalue()


def test_a_bundle_is_signed_by_this_installation_and_says_so(decided_run, tmp_path):
    path = tmp_path / "run.zip"
    exported = bundles.export(decided_run.pk, path)
    signature = exported.manifest["signature"]
    assert signature["algorithm"] == "ed25519"
    assert base64.b64decode(signature["public_key"]) == bundle_signing.public_key()
    checked = bundles.verify(path)
    assert checked.ok and checked.authenticated and checked.failures == []
    assert checked.signer.kind == SignerKind.THIS_INSTALLATION
    code, out, _ = verify_command(path)
    assert code == 0 and "signed by this installation" in out
    code, out, _ = verify_command(path, "--json")
    said = json.loads(out)
    assert code == 0 and said["ok"] and said["authenticated"]
    assert said["signer"]["kind"] == "this_installation"
    assert said["signer"]["key_id"] == signature["key_id"]


@pytest.mark.parametrize(
    "change",
    [another_question, another_installation, an_invented_lock_incident, no_signature],
    ids=lambda change: change.__name__,
)
def test_a_bundle_forged_with_recomputed_hashes_and_seal_is_refused(decided_run, tmp_path, change):
    original = tmp_path / "run.zip"
    bundles.export(decided_run.pk, original)
    path = forged(original, tmp_path, change)
    checked = bundles.verify(path)
    assert checked.failures == []  # every hash and the old seal match...
    assert not checked.ok and not checked.authenticated  # ...and it is refused
    assert checked.signer.words == "unsigned or signature does not verify"
    code, out, err = verify_command(path)
    assert code == 1 and "ok" not in out and "valid" not in out + err
    assert "unsigned or signature does not verify" in err
    code, out, _ = verify_command(path, "--json")
    assert code == 1 and json.loads(out)["ok"] is False
    runs = Run.objects.count()
    with pytest.raises(OpenRefused):
        open_bundle(path)
    assert Run.objects.count() == runs


def test_a_bundle_signed_again_with_another_key_is_not_known_here(decided_run, tmp_path):
    original = tmp_path / "run.zip"
    bundles.export(decided_run.pk, original)
    path = forged(original, tmp_path, another_question, sign_with=OTHER_SEED)
    other = Ed25519PrivateKey.from_private_bytes(OTHER_SEED).public_key().public_bytes_raw()
    checked = bundles.verify(path)
    assert checked.failures == [] and not checked.ok
    assert checked.signer.kind == SignerKind.UNKNOWN
    assert checked.signer.words == f"signed by key {bundle_signing.key_id(other)}, not known here"
    assert checked.problems == [f"manifest.json: {checked.signer.words}"]
    code, out, err = verify_command(path)
    assert code == 1 and "not known here" in err and "ok" not in out
    with pytest.raises(OpenRefused):
        open_bundle(path)

    # Trusted here by name: the same bundle is authenticated, and says whose.
    with override_settings(RUNDESK_BUNDLE_TRUSTED_KEYS={"partner": other}):
        checked = bundles.verify(path)
        assert checked.ok and checked.signer.kind == SignerKind.TRUSTED
        assert checked.signer.words.startswith("signed by trusted key partner")
        code, out, _ = verify_command(path)
        assert code == 0 and "signed by trusted key partner" in out


def test_a_bundle_another_installation_exported_is_not_known_here(decided_run, tmp_path):
    path = tmp_path / "theirs.zip"
    with override_settings(SECRET_KEY="another installation's secret key"):
        bundles.export(decided_run.pk, path)
        assert bundles.verify(path).ok  # there, it is their own
    checked = bundles.verify(path)
    assert checked.failures == [] and checked.signer.kind == SignerKind.UNKNOWN
    assert not checked.ok


@pytest.mark.parametrize(
    "signature",
    [
        "not an object",
        {"algorithm": "ed25519"},
        {"algorithm": "ed25519", "public_key": 7, "value": None},
        {"algorithm": "ed25519", "public_key": "no base64!", "value": "x"},
        {"algorithm": "ed25519", "public_key": base64.b64encode(b"short").decode(), "value": ""},
        {"algorithm": "hmac-sha256", "public_key": "", "value": ""},
    ],
)
def test_a_signature_made_to_harm_is_unsigned_never_an_exception(decided_run, tmp_path, signature):
    original = tmp_path / "run.zip"
    bundles.export(decided_run.pk, original)

    def replaced(files: dict[str, bytes], manifest: dict) -> None:
        manifest["signature"] = signature

    checked = bundles.verify(forged(original, tmp_path, replaced))
    assert checked.signer.kind == SignerKind.UNSIGNED and not checked.ok


def test_the_signing_key_setting_signs_and_the_public_key_is_printed(decided_run, tmp_path):
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    public = key.public_key().public_bytes_raw()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RUNDESK_BUNDLE_SIGNING_KEY", pem)
        seed = project_settings.env_signing_key("RUNDESK_BUNDLE_SIGNING_KEY")
    with override_settings(RUNDESK_BUNDLE_SIGNING_KEY=seed, RUNDESK_INSTALLATION="lab"):
        path = tmp_path / "run.zip"
        exported = bundles.export(decided_run.pk, path)
        assert base64.b64decode(exported.manifest["signature"]["public_key"]) == public
        assert bundles.verify(path).signer.kind == SignerKind.THIS_INSTALLATION
        out = io.StringIO()
        call_command("verify_bundle", "--public-key", stdout=out)
        encoded = base64.b64encode(public).decode()
        assert f"RUNDESK_BUNDLE_TRUSTED_KEYS=lab={encoded}" in out.getvalue()
        out = io.StringIO()
        call_command("verify_bundle", "--public-key", "--json", stdout=out)
        assert json.loads(out.getvalue())["key_id"] == bundle_signing.key_id(public)
    # The default key is derived from SECRET_KEY: another public key.
    assert bundles.verify(path).signer.kind == SignerKind.UNKNOWN


@pytest.mark.parametrize(
    ("name", "value", "said"),
    [
        ("RUNDESK_BUNDLE_SIGNING_KEY", "not base64 at all", "not base64"),
        ("RUNDESK_BUNDLE_SIGNING_KEY", base64.b64encode(b"x" * 16).decode(), "32 bytes"),
        ("RUNDESK_BUNDLE_SIGNING_KEY", "-----BEGIN PRIVATE KEY-----\nxx\n", "not a PEM"),
        ("RUNDESK_BUNDLE_TRUSTED_KEYS", "partner", "NAME=PUBLIC_KEY"),
        ("RUNDESK_BUNDLE_TRUSTED_KEYS", "partner=" + "A" * 12, "32 bytes"),
        (
            "RUNDESK_BUNDLE_TRUSTED_KEYS",
            "a={0},a={0}".format(base64.b64encode(b"k" * 32).decode()),
            "given twice",
        ),
    ],
)
def test_a_key_setting_that_cannot_be_read_fails_loudly(monkeypatch, name, value, said):
    monkeypatch.setenv(name, value)
    read = (
        project_settings.env_signing_key
        if name == "RUNDESK_BUNDLE_SIGNING_KEY"
        else project_settings.env_public_keys
    )
    with pytest.raises(ImproperlyConfigured, match=said):
        read(name)


def test_trusted_keys_are_read_by_name(monkeypatch):
    one, two = b"1" * 32, b"2" * 32
    value = f"partner={base64.b64encode(one).decode()}, lab = {base64.b64encode(two).decode()}"
    monkeypatch.setenv("RUNDESK_BUNDLE_TRUSTED_KEYS", value)
    assert project_settings.env_public_keys("RUNDESK_BUNDLE_TRUSTED_KEYS") == {
        "partner": one,
        "lab": two,
    }


def test_an_opened_bundle_says_who_signed_it_on_its_page(decided_run, tmp_path, viewer):
    path = tmp_path / "run.zip"
    bundles.export(decided_run.pk, path)
    opened = open_bundle(path)
    page = viewer.get(f"/runs/{opened.run.pk}/").content.decode()
    assert "signed by this installation" in page
