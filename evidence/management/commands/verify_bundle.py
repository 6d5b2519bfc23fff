from __future__ import annotations

import json
import sys
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from evidence import bundle_signing, bundles


class Command(BaseCommand):
    help = (
        "Checks an investigation bundle: every file's size and SHA-256, the seal, and the "
        "manifest's signature, and says who signed it: this installation, a key trusted "
        "here (RUNDESK_BUNDLE_TRUSTED_KEYS), or a key not known here.  Exits 0 only if "
        "everything matches and the signer is this installation or trusted.  With "
        "--public-key, prints this installation's public key for others to trust."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("path", nargs="?")
        parser.add_argument(
            "--public-key",
            action="store_true",
            help="print this installation's public key (what a recipient adds to its "
            "RUNDESK_BUNDLE_TRUSTED_KEYS) and exit",
        )
        parser.add_argument("--json", action="store_true")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["public_key"]:
            self._public_key(options["json"])
            return
        if not options["path"]:
            raise CommandError("give the bundle to verify (or --public-key)")
        checked = bundles.verify(options["path"])
        manifest = checked.manifest
        if options["json"]:
            self.stdout.write(
                json.dumps(
                    {
                        "ok": checked.ok,
                        "authenticated": checked.authenticated,
                        "signer": checked.signer.as_json(),
                        "failures": checked.failures,
                        "run_id": manifest.get("run_id"),
                        "seal": manifest.get("seal"),
                        "installation": manifest.get("installation"),
                        "exported_at": manifest.get("exported_at"),
                    }
                )
            )
        elif checked.ok:
            self.stdout.write(
                f"ok: run {manifest['run_id']} from {manifest['installation']}, exported "
                f"{manifest['exported_at']}, {len(manifest['files'])} files match\n"
                f"{checked.signer.words}\nseal {manifest['seal']}"
            )
        else:
            for failure in checked.failures:
                self.stderr.write(f"FAILED {failure}")
            if not checked.authenticated:
                self.stderr.write(
                    f"NOT AUTHENTICATED: {checked.signer.words}; anyone can make a bundle "
                    "that is not signed by a key this installation trusts"
                )
        if not checked.ok:
            sys.exit(1)

    def _public_key(self, as_json: bool) -> None:
        public = bundle_signing.public_key()
        key, key_id = bundle_signing.encoded(public), bundle_signing.key_id(public)
        name = settings.RUNDESK_INSTALLATION or "NAME"
        if as_json:
            self.stdout.write(
                json.dumps(
                    {"algorithm": bundle_signing.ALGORITHM, "public_key": key, "key_id": key_id}
                )
            )
            return
        self.stdout.write(
            f"public key {key} ({bundle_signing.ALGORITHM}, key {key_id})\n"
            f"a recipient trusts it with RUNDESK_BUNDLE_TRUSTED_KEYS={name}={key}"
        )
