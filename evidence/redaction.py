"""Secrets never leave in a bundle: what replaces them, and the count of
what was replaced where (never the values).

Two sources of secrets: values this installation knows to be secret (the
settings' keys and passwords, environment variables named like *KEY*,
*TOKEN*, *SECRET*, *PASSWORD*), replaced wherever they occur; and strings in
common key formats (provider API keys, bearer tokens, Authorization
headers, JWTs, private-key blocks, Slack's and Discord's webhook addresses,
the password in a URL, the value of a field named like a password, secret,
token or key), replaced wherever they occur, whoever they belong to.
Each becomes `[REDACTED:<kind>]`.

No format matches a quote, `<` or `>`: the same patterns redact report.html's
body once it is rendered (after the answers' markdown, before it is
rendered), and a match that ran across markup could take an attribute's
closing quote with it and turn the text after it into attributes.
"""

from __future__ import annotations

import html
import json
import os
import re
from collections import Counter
from typing import Any

from django.conf import settings

SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)
# Shorter values are not taken for secrets: "1", "true", a port number
# would redact half a bundle and protect nothing.
MIN_SECRET_LENGTH = 8

# A quote, as written, as JSON inside a string escapes it, or as HTML does.
QUOTE = "(?:\\\\?[\"']|&quot;|&#x27;|&#39;)"
# Right after one of them (a look-behind is of one width).
AFTER_QUOTE = "(?:(?<=[\"'])|(?<=&quot;)|(?<=&#x27;)|(?<=&#39;))"
# Values a field named like a secret holds that are none: a flag, a number
# of up to six digits (max_tokens: 4096), each whole (no-way-in, 123-456-abc
# are values), a path (PWD=/srv/app), a variable (token=${TOKEN}, $TOKEN).
PLAIN_VALUE = (
    r"(?:true|false|none|null|yes|no|undefined|\d{1,6})(?![\w.-])|[/~]"
    r"|\$(?-i:\{|[A-Z_][A-Z0-9_]*\b)"
)
# Where a key may start: not within a word -- or right after a JSON escape
# (\n, \t, \u2028), whose letter or digits are not the key's.  A model
# call's copy holds its messages as JSON text: a document's line starts
# after "\n", and a key at its start was glued to that "n".
ESCAPED = r"(?<=\\[nrtbf])|(?<=\\u[0-9a-fA-F]{4})"
START = rf"(?:(?<!\w)|{ESCAPED})"
# Most specific first: a key is named by the first format it matches.
FORMATS: list[tuple[str, re.Pattern[str]]] = [
    (
        "private_key",
        re.compile(
            # The block's own characters only (base64, its headers, JSON's \n).
            r"-----BEGIN [A-Z0-9 ]{0,40}PRIVATE KEY-----[A-Za-z0-9+/=\s:,.\\-]{0,20000}?"
            r"-----END [A-Z0-9 ]{0,40}PRIVATE KEY-----"
        ),
    ),
    (
        "authorization_header",
        re.compile(
            # The value may be in backquotes or brackets: `Bearer x`, (Bearer x).
            # After a word's end, a digit or an underscore (HTTP_AUTHORIZATION).
            rf"(?i)(?:(?<![A-Za-z])|{ESCAPED})((?:proxy-)?authorization\"?\s*[:=]\s*\"?[`(\[]?)"
            r"(?:(?:bearer|basic|token|digest|negotiate)(?:\s*:\s*|\s+))?[^\s\"'`,)\]}<>&]+"
        ),
    ),
    ("bearer_token", re.compile(rf"(?i){START}bearer(?:\s*[:=]\s*|\s+)[A-Za-z0-9._~+/=-]{{12,}}")),
    (
        "jwt",
        re.compile(rf"{START}eyJ[A-Za-z0-9_-]{{6,}}\.[A-Za-z0-9_-]{{6,}}\.[A-Za-z0-9_-]{{6,}}"),
    ),
    ("anthropic_key", re.compile(rf"{START}sk-ant-[A-Za-z0-9_-]{{16,}}")),
    ("openai_key", re.compile(rf"{START}sk-(?:proj-|svcacct-|admin-)?[A-Za-z0-9_-]{{20,}}")),
    ("stripe_key", re.compile(rf"{START}(?:sk|rk|pk)_(?:live|test)_[A-Za-z0-9]{{16,}}")),
    ("aws_access_key", re.compile(rf"{START}(?:AKIA|ASIA)[0-9A-Z]{{16}}\b")),
    (
        "github_token",
        re.compile(rf"{START}(?:gh[pousr]_[A-Za-z0-9]{{30,}}|github_pat_[A-Za-z0-9_]{{30,}})"),
    ),
    ("google_api_key", re.compile(rf"{START}AIza[0-9A-Za-z_-]{{35}}\b")),
    ("slack_token", re.compile(rf"{START}xox[abposr]-[A-Za-z0-9-]{{10,}}")),
    # Webhooks whose address is their secret: the host and kind stay.
    (
        "webhook_url",
        re.compile(
            r"(?i)(\bhttps?://(?:hooks\.slack\.com/(?:services|workflows|triggers)/"
            r"|(?:(?:ptb|canary)\.)?discord(?:app)?\.com/api/(?:v\d+/)?webhooks/))"
            r"[A-Za-z0-9/_-]+"
        ),
    ),
    # postgres://user:PASSWORD@host, https://user:PASSWORD@host...
    (
        "url_password",
        re.compile(r"(?i)(\b[a-z][a-z0-9+.-]{0,30}://[^\s:/@\"'<>]+:)[^\s@/\"'<>]+(?=@)"),
    ),
    # password=..., "client_secret": "...", aws_secret_access_key: ...
    (
        "credential",
        re.compile(
            # Up to four words before the name, each bounded: a long run of
            # `a_a_a_...` must cost a pass, not a pass from every `_`.
            # ... and a prefix glued to the name (PGPASSWORD, csrftoken).
            r"(?i)(?<![A-Za-z0-9])((?:[a-z0-9]{1,30}[_-]){0,4}[a-z0-9]{0,10}"
            r"(?:password|passwd|pwd|secret|api[_-]?key|access[_-]?key|private[_-]?key|token"
            r"|(?:secret|encryption|signing|client|master)[_-]?key)"
            rf"{QUOTE}?\s*[:=]\s*{QUOTE}?)(?!\[REDACTED|{PLAIN_VALUE})"
            # Quoted, the value is all of it to the closing quote, spaces
            # too ("correct horse battery staple"); else up to a space.
            rf"(?:{AFTER_QUOTE}[^\"'\n<>&\\]{{4,200}}(?={QUOTE})"
            rf"|(?:(?!{QUOTE})&(?:#?\w+;)?|[^\s\"',;<>}}&\\]){{4,}})"
        ),
    ),
]


# Every format above starts with one of these: a string without any is
# scanned once, not once per format (an export reads millions of strings).
MAYBE = re.compile(
    r"(?i:authorization|bearer)|BEGIN|eyJ|sk-|_live_|_test_|AKIA|ASIA|gh[pousr]_|github_pat_"
    r"|AIza|xox[abposr]-|://|(?i:passw|pwd|secret|key|token)"
)


def known_secrets() -> dict[str, str]:
    """Secret value -> the kind it is reported as: the settings' secrets and
    the environment's variables named like secrets."""
    found: dict[str, str] = {}
    for name, value in os.environ.items():
        if SECRET_NAME.search(name) and len(value) >= MIN_SECRET_LENGTH:
            found[value] = f"env:{name}"
    database = settings.DATABASES["default"]
    for name, value in [
        ("SECRET_KEY", settings.SECRET_KEY),
        ("RUNDESK_MODEL_API_KEY", settings.RUNDESK_MODEL_API_KEY),
        ("DATABASE_PASSWORD", database.get("PASSWORD") or ""),
        ("EMAIL_HOST_PASSWORD", getattr(settings, "EMAIL_HOST_PASSWORD", "")),
    ]:
        if value and len(value) >= MIN_SECRET_LENGTH:
            found[value] = f"setting:{name}"
    return found


class Redactor:
    """Replaces secrets in text and in JSON values, counting what it
    replaced per place (a bundle's file) and kind."""

    def __init__(self, secrets: dict[str, str] | None = None) -> None:
        secrets = known_secrets() if secrets is None else secrets
        variants = {spelt: k for v, k in secrets.items() for spelt in spellings(v)}
        self._kinds = variants
        self._values = (
            re.compile("|".join(re.escape(v) for v in sorted(variants, key=len, reverse=True)))
            if variants
            else None
        )
        self.counts: dict[str, Counter[str]] = {}

    def text(self, value: str, where: str) -> str:
        counts = self.counts.setdefault(where, Counter())
        if self._values is not None:

            def known(match: re.Match[str]) -> str:
                kind = self._kinds[match.group(0)]
                counts[kind] += 1
                return f"[REDACTED:{kind}]"

            value = self._values.sub(known, value)
        if MAYBE.search(value) is None:
            return value
        for kind, pattern in FORMATS:
            value, replaced = pattern.subn(_replacement(kind), value)
            if replaced:
                counts[kind] += replaced
        return value

    def value(self, value: Any, where: str) -> Any:
        """A JSON value with every string in it redacted (keys included)."""
        if isinstance(value, str):
            return self.text(value, where)
        if isinstance(value, dict):
            return {self.text(k, where): self.value(v, where) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.value(v, where) for v in value]
        return value

    def report(self) -> dict[str, dict[str, int]]:
        """Where, what kind, how many: never a value."""
        return {
            where: dict(sorted(counts.items()))
            for where, counts in sorted(self.counts.items())
            if counts
        }


# What Django's json_script writes for these characters, so that the JSON
# it puts in a page never closes its <script> element.
JSON_SCRIPT = str.maketrans({"<": "\\u003C", ">": "\\u003E", "&": "\\u0026"})


def spellings(value: str) -> set[str]:
    """Every way an export can spell a known secret: as written; as HTML
    escapes it (report.html, and chart labels, escaped with or without
    their quotes); inside a JSON string (a model call's request body held
    as text, a chart's figure), with or without non-ASCII escaped, and as
    json_script escapes that."""
    escaped = {value, html.escape(value), html.escape(value, quote=False)}
    in_json = {
        json.dumps(spelt, ensure_ascii=only_ascii)[1:-1]
        for spelt in escaped
        for only_ascii in (True, False)
    }
    return escaped | in_json | {spelt.translate(JSON_SCRIPT) for spelt in in_json}


def _replacement(kind: str) -> Any:
    if kind in ("authorization_header", "webhook_url", "url_password", "credential"):
        # The name or the address stays; only the secret goes.
        return lambda match: f"{match.group(1)}[REDACTED:{kind}]"
    return f"[REDACTED:{kind}]"
