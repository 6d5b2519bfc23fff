"""The signature of an investigation bundle's manifest (evidence/bundles.py):
who exported it, as far as anyone can prove.

Ed25519, an asymmetric signature: the installation signs with its private
key, and anyone holding its public key checks the signature without being
able to make one.  (An HMAC would need the recipient to hold the secret
that signs: whoever can check a bundle could then forge one.)  The private
key is RUNDESK_BUNDLE_SIGNING_KEY or, when unset, derived from SECRET_KEY
with HKDF under a label of its own, so every process of one installation
signs with the same key with no new setting, and the SECRET_KEY itself
never signs anything.

A signature proves the manifest -- and through its SHA-256s every file --
is what a holder of that private key signed.  Who that is, is what this
installation knows of the key: its own, one named in
RUNDESK_BUNDLE_TRUSTED_KEYS, or a key it does not know (the signature
holds, but anyone can make a key pair: such a bundle is not authenticated).
"""

from __future__ import annotations

import base64
import binascii
import enum
import hashlib
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from django.conf import settings

ALGORITHM = "ed25519"
# Signed before the manifest: a signature made for a bundle cannot pass for
# one of anything else this key might ever sign, nor the other way round.
CONTEXT = b"rundesk-bundle-manifest/1\n"
# HKDF's info: the purpose the key derived from SECRET_KEY serves.
DERIVED_FOR = b"rundesk bundle signing key v1"


class SignerKind(enum.StrEnum):
    THIS_INSTALLATION = "this_installation"
    TRUSTED = "trusted"
    UNKNOWN = "unknown"
    UNSIGNED = "unsigned"


@dataclass(frozen=True)
class Signer:
    """Who signed a manifest, as far as this installation knows."""

    kind: SignerKind
    key_id: str = ""
    name: str = ""  # the trusted key's name

    @property
    def authenticated(self) -> bool:
        return self.kind in (SignerKind.THIS_INSTALLATION, SignerKind.TRUSTED)

    @property
    def words(self) -> str:
        match self.kind:
            case SignerKind.THIS_INSTALLATION:
                return f"signed by this installation (key {self.key_id})"
            case SignerKind.TRUSTED:
                return f"signed by trusted key {self.name} (key {self.key_id})"
            case SignerKind.UNKNOWN:
                return f"signed by key {self.key_id}, not known here"
        return "unsigned or signature does not verify"

    def as_json(self) -> dict[str, Any]:
        return {
            "kind": str(self.kind),
            "key_id": self.key_id,
            "name": self.name,
            "authenticated": self.authenticated,
            "words": self.words,
        }


UNSIGNED = Signer(SignerKind.UNSIGNED)


def private_key() -> Ed25519PrivateKey:
    seed = settings.RUNDESK_BUNDLE_SIGNING_KEY
    if seed is None:
        seed = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=DERIVED_FOR).derive(
            settings.SECRET_KEY.encode()
        )
    return Ed25519PrivateKey.from_private_bytes(seed)


def public_key() -> bytes:
    """This installation's public key, its 32 bytes."""
    return private_key().public_key().public_bytes_raw()


def key_id(public: bytes) -> str:
    """A key's fingerprint: the first 128 bits of its SHA-256, in hex."""
    return hashlib.sha256(public).hexdigest()[:32]


def encoded(public: bytes) -> str:
    return base64.b64encode(public).decode()


def signature(message: bytes) -> dict[str, str]:
    """The manifest's `signature` entry for `message` (its canonical
    content): algorithm, public key, its id, the signature."""
    key = private_key()
    public = key.public_key().public_bytes_raw()
    return {
        "algorithm": ALGORITHM,
        "public_key": encoded(public),
        "key_id": key_id(public),
        "value": base64.b64encode(key.sign(CONTEXT + message)).decode(),
    }


def signer(entry: Any, message: bytes) -> Signer:
    """Who signed `message` with the manifest's `signature` entry `entry`.
    Whatever the entry holds, the answer is a Signer, never an exception:
    a bundle may be made to harm."""
    try:
        if not isinstance(entry, dict) or entry.get("algorithm") != ALGORITHM:
            return UNSIGNED
        public = base64.b64decode(entry["public_key"], validate=True)
        Ed25519PublicKey.from_public_bytes(public).verify(
            base64.b64decode(entry["value"], validate=True), CONTEXT + message
        )
    except (InvalidSignature, KeyError, TypeError, ValueError, binascii.Error):
        return UNSIGNED
    fingerprint = key_id(public)
    if public == public_key():
        return Signer(SignerKind.THIS_INSTALLATION, fingerprint)
    for name, trusted in sorted(settings.RUNDESK_BUNDLE_TRUSTED_KEYS.items()):
        if public == trusted:
            return Signer(SignerKind.TRUSTED, fingerprint, name)
    return Signer(SignerKind.UNKNOWN, fingerprint)
