"""Secrets never leave in a bundle: what replaces them, and the count of
what was replaced where (never the values).

Three ways a secret is found:

- by the name it is held under, at any depth of a JSON value: a mapping's
  key (`api_key`, `client_secret`, `X-Api-Key`, `Authorization`, `Cookie`,
  `credentials`...), a header list's name (`[["Authorization", "Basic ..."]]`,
  `[{"name": "Cookie", "value": "..."}]`), or a URL's query parameter
  (`?key=`, `&X-Amz-Signature=`) in any text.  The value goes whole, however
  it is made (a whole `credentials` object goes); the name stays.  A string
  that holds a JSON object or array is read as JSON and redacted the same
  way, then written back as the same JSON but for what was redacted.
- by value: the settings' secrets and the environment's variables named like
  secrets, replaced wherever they occur.
- by format: provider API keys, bearer tokens, Authorization and Cookie
  headers, JWTs, private-key blocks, Slack's and Discord's webhook addresses,
  the password in a URL, the value of a field named like a password, secret,
  token or key in free text.

Each becomes `[REDACTED:<kind>]`.

Every format is matched in time linear in the text (receipts hold up to
1 MB): no pattern may scan far from many starts.  And a redaction never
breaks the text it sits in: no format matches a quote, `<`, `>` or `&` (the
same patterns redact report.html's body once it is rendered, and a match
that ran across markup could take an attribute's closing quote with it and
turn the text after it into attributes), nor a backslash but as a whole
escape, and a match never begins or ends inside a JSON escape, so the JSON a
secret sits in (a string's text, report.html's chart) still parses.
"""

from __future__ import annotations

import functools
import html
import json
import os
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.conf import settings

SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)
# Settings named like a secret that only name or locate something.
NOT_A_SECRET_SETTING = re.compile(r"_(?:PREFIX|FILE|KEYFILE|NAME|PATH|HEADER|ALIAS)$")
# The environment is nobody's list of secrets: variables named like them hold
# "1", "true", a port or a locale, and shorter values would redact half a
# bundle and protect nothing.  A setting's secret is one by definition, and
# is redacted at any length.
MIN_SECRET_LENGTH = 8

# -- names that hold secrets --------------------------------------------------------

# Compared without case or separators: X-Api-Key, x_api_key, xApiKey are one.
SECRET_ENDING = re.compile(
    r"(?:password|passwd|passphrase|secret|token|credentials?|signature"
    r"|(?:api|access|secret|private|signing|encryption|master|client|subscription|session|hmac)key"
    r")$"
)
# Named like a secret, holding none: pagination cursors, a model's special
# tokens, a decision's one-time request token (spent once it is decided;
# opening a bundle needs them distinct).
NOT_SECRET_ENDING = re.compile(
    r"(?:page|next|continuation|sync|request|eos|bos|pad|unk|stop|sep|cls|mask)token$"
)
HEADER_ENDINGS = {"authorization": "authorization_header", "cookie": "cookie", "cookies": "cookie"}
# Whole names that are secrets only alone (`auth`, not `oauth_url`).
SECRET_NAMES = {"auth", "basicauth"}
# A query parameter may be named more tersely: ?key=, ?sig=, ?code= (OAuth's).
QUERY_NAMES = {"key", "sig", "code", "auth", "pwd", "pass"}
# A longer "name" is no field's name (and is not worth caching).
LONGEST_NAME = 100


@functools.lru_cache(maxsize=4096)
def secret_kind(name: str) -> str | None:
    """The kind a value held under `name` is reported as, or None when the
    name holds no secret (max_tokens, token_count, input_tokens)."""
    if len(name) > LONGEST_NAME:
        return None
    squeezed = re.sub(r"[^a-z0-9]", "", name.lower())
    for ending, kind in HEADER_ENDINGS.items():
        if squeezed.endswith(ending):
            return kind
    if NOT_SECRET_ENDING.search(squeezed):
        return None
    if squeezed in SECRET_NAMES or SECRET_ENDING.search(squeezed):
        return "credential"
    return None


# -- formats ------------------------------------------------------------------------

# A quote, as written, as JSON inside a string escapes it, or as HTML does.
QUOTE = "(?:\\\\?[\"']|&quot;|&#x27;|&#39;)"
# Right after one of them (a look-behind is of one width).
AFTER_QUOTE = "(?:(?<=[\"'])|(?<=&quot;)|(?<=&#x27;)|(?<=&#39;))"
# Between a header's name and its value: `Name: v`, `"Name": "v"`, and a
# header list's `"Name", "v"`.  Spaces bounded: one start, one short scan.
HEADER_SEPARATOR = rf"{QUOTE}?[ \t]{{0,10}}(?:[:=]|(?<=[\"';]),)[ \t]{{0,10}}{QUOTE}?"
# Values a field named like a secret holds that are none: a flag, a number
# of up to six digits (max_tokens: 4096), each whole (no-way-in, 123-456-abc
# are values), a path (PWD=/srv/app), a variable (token=${TOKEN}, $TOKEN).
PLAIN_VALUE = (
    r"(?:true|false|none|null|yes|no|undefined|\d{1,6})(?![\w.-])|[/~]"
    r"|\$(?-i:\{|[A-Z_][A-Z0-9_]*\b)"
)


# An Authorization header's scheme, before its credentials.
SCHEME = "(?:bearer|basic|token|digest|negotiate)"


def at_start(pattern: str, width: int, inside: str = "[A-Za-z0-9_]") -> str:
    r"""`pattern` (of `width` characters) where a key may start: not right
    after one of `inside` -- or right after a JSON escape (\n, \t, \u2028),
    whose letter or digits are not the key's.  A model call's copy holds its
    messages as JSON text: a document's line starts after "\n", and a key
    at its start was glued to that "n".

    The pattern comes first and the look-behinds after it: a scan for a
    literal skips through a text, a look-behind tried at every position
    costs a pass per pattern ten times slower."""
    gap = f".{{{width}}}"
    return (
        rf"(?:{pattern})"
        rf"(?:(?<!{inside}{gap})|(?<=\\[nrtbf]{gap})|(?<=\\u[0-9a-fA-F]{{4}}{gap}))"
    )


@dataclass(frozen=True)
class Format:
    kind: str
    # Each match holds one of these (compared without case): a text without
    # any is not scanned for it (an export reads millions of strings, and a
    # substring search costs a fraction of a pattern's pass).
    triggers: tuple[str, ...]
    pattern: re.Pattern[str]
    # The name (group 1) stays; only the secret after it goes.
    keeps_name: bool = False
    # Whether the match holds a secret, beyond its pattern (a query
    # parameter's name, a field's name glued to no long word).
    holds_secret: Callable[[re.Match[str]], bool] | None = None


def _secret_parameter(match: re.Match[str]) -> bool:
    name = match.group(2)
    return re.sub(r"[^a-z0-9]", "", name.lower()) in QUERY_NAMES or secret_kind(name) is not None


# PGPASSWORD, csrftoken: a name glued to a short prefix is a secret's name,
# one glued to a long word (a hash, a base64 run) is not a name at all.
LONGEST_GLUED = 10


def _short_prefix(match: re.Match[str]) -> bool:
    text, before = match.string, match.start()
    while before > 0 and match.start() - before <= LONGEST_GLUED and text[before - 1].isalnum():
        before -= 1
    return match.start() - before <= LONGEST_GLUED


# Most specific first: a key is named by the first format it matches.  A
# pattern that ignores case starts with a look-ahead for its first letter:
# a scan then skips the other positions, four times faster.
# (Private-key blocks are found by `_private_keys`, not by a pattern.)
FORMATS: list[Format] = [
    Format(
        "authorization_header",
        ("authorization",),
        re.compile(
            # After a word's end, a digit or an underscore (HTTP_AUTHORIZATION).
            # The value may be in backquotes or brackets: `Bearer x`, (Bearer x).
            rf"(?i)(?=[ap])((?:{at_start('proxy-authorization', 19, '[A-Za-z]')}"
            rf"|{at_start('authorization', 13, '[A-Za-z]')}){HEADER_SEPARATOR}"
            rf"(?!(?:{SCHEME}[ \t:]{{1,10}})?\[REDACTED)[`(\[]?)(?:{SCHEME}"
            r"(?:[ \t]{0,10}:[ \t]{0,10}|[ \t]{1,10}))?[^\s\"'`,)\]}<>&\\]+"
        ),
        keeps_name=True,
    ),
    Format(
        "cookie",
        ("cookie",),  # A cookie header's value runs to the end of its line (`a=1; b=2`).
        re.compile(
            rf"(?i)(?=[cs])((?:{at_start('set-cookie', 10, '[A-Za-z]')}"
            rf"|{at_start('cookie', 6, '[A-Za-z]')}){HEADER_SEPARATOR})"
            r"(?!\[REDACTED)[^\s\"'<>&\\][^\r\n\"'<>&\\]*"
        ),
        keeps_name=True,
    ),
    Format(
        "bearer_token",
        ("bearer",),
        re.compile(
            rf"(?i)(?=b){at_start('bearer', 6)}(?:\s{{0,10}}[:=]\s{{0,10}}|\s{{1,10}})"
            r"[A-Za-z0-9._~+/=-]{12,}"
        ),
    ),
    Format(
        "jwt",
        ("eyj",),  # Not after a character of its own: each run of them is tried once.
        re.compile(
            rf"{at_start('eyJ', 3, '[A-Za-z0-9_-]')}[A-Za-z0-9_-]{{6,}}\.[A-Za-z0-9_-]{{6,}}"
            r"\.[A-Za-z0-9_-]{6,}"
        ),
    ),
    Format("anthropic_key", ("sk-",), re.compile(rf"{at_start('sk-ant-', 7)}[A-Za-z0-9_-]{{16,}}")),
    Format(
        "openai_key",
        ("sk-",),
        re.compile(rf"{at_start('sk-', 3)}(?:proj-|svcacct-|admin-)?[A-Za-z0-9_-]{{20,}}"),
    ),
    Format(
        "stripe_key",
        ("_live_", "_test_"),
        re.compile(rf"{at_start('[spr]k_(?:live|test)_', 8)}[A-Za-z0-9]{{16,}}"),
    ),
    Format(
        "aws_access_key",
        ("akia", "asia"),
        re.compile(rf"{at_start('A(?:KIA|SIA)', 4)}[0-9A-Z]{{16}}(?![0-9A-Za-z])"),
    ),
    Format(
        "github_token",
        ("gh",),
        re.compile(
            rf"{at_start('gh[pousr]_', 4)}[A-Za-z0-9]{{30,}}"
            rf"|{at_start('github_pat_', 11)}[A-Za-z0-9_]{{30,}}"
        ),
    ),
    Format(
        "google_api_key",
        ("aiza",),
        re.compile(rf"{at_start('AIza', 4)}[0-9A-Za-z_-]{{35}}(?![0-9A-Za-z_-])"),
    ),
    Format(
        "slack_token", ("xox",), re.compile(rf"{at_start('xox[abposr]-', 5)}[A-Za-z0-9-]{{10,}}")
    ),
    # Webhooks whose address is their secret: the host and kind stay.
    Format(
        "webhook_url",
        ("hooks.slack.com", "discord"),
        re.compile(
            r"(?i)(?=h)(https?://(?:hooks\.slack\.com/(?:services|workflows|triggers)/"
            r"|(?:(?:ptb|canary)\.)?discord(?:app)?\.com/api/(?:v\d+/)?webhooks/))"
            r"[A-Za-z0-9/_-]+"
        ),
        keeps_name=True,
    ),
    # postgres://user:PASSWORD@host, https://user:PASSWORD@host... (after a
    # scheme, which stays as it was).
    Format(
        "url_password",
        ("://",),
        re.compile(r"(://(?<=[A-Za-z0-9+.-]://)[^\s:/@\"'<>]+:)(?!\[REDACTED)[^\s@/\"'<>]+(?=@)"),
        keeps_name=True,
    ),
    # ?key=AIza..., &X-Amz-Signature=..., &amp;token=... (HTML), \u0026sig=
    # (json_script): the parameter's name stays.
    Format(
        "url_credential",
        ("=",),
        re.compile(
            r"((?:[?&;]|\\u0026)([A-Za-z][A-Za-z0-9_.-]{0,63})=)(?!\[REDACTED)[^&#\s\"'<>\\]+"
        ),
        keeps_name=True,
        holds_secret=_secret_parameter,
    ),
    # password=..., "client_secret": "...", aws_secret_access_key: ...
    # (what comes before the name stays as it was).
    Format(
        "credential",
        ("pass", "pwd", "secret", "key", "token"),
        re.compile(
            # (password|passwd|pwd|private_key|secret|secret_key|signing_key|
            # api_key|access_key|token|encryption_key|client_key|master_key,
            # as a tree: one branch tried per position, not thirteen.)
            r"(?i)(?=[acempst])((?:p(?:ass(?:word|wd)|wd|rivate[_-]?key)"
            r"|s(?:ecret(?:[_-]?key)?|igning[_-]?key)|a(?:pi|ccess)[_-]?key|token"
            r"|(?:encryption|client|master)[_-]?key)"
            rf"{QUOTE}?\s{{0,10}}[:=]\s{{0,10}}{QUOTE}?)(?!\[REDACTED|{PLAIN_VALUE})"
            # Quoted, the value is all of it to the closing quote, spaces
            # too ("correct horse battery staple"); else up to a space.
            rf"(?:{AFTER_QUOTE}[^\"'\n<>&\\]{{4,200}}(?={QUOTE})"
            rf"|(?:(?!{QUOTE})&(?:#?\w+;)?|[^\s\"',;<>}}&\\]){{4,}})"
        ),
        keeps_name=True,
        holds_secret=_short_prefix,
    ),
]

PEM_BEGIN = re.compile(r"-----BEGIN [A-Z0-9 ]{0,40}PRIVATE KEY(?: BLOCK)?-----")
PEM_END = re.compile(r"-----END [A-Z0-9 ]{0,40}PRIVATE KEY(?: BLOCK)?-----")
# A block's own characters: base64, its headers' words, whitespace, and the
# escapes JSON writes for its line ends -- a backslash only with the
# character it escapes, so a block never ends inside an escape.
PEM_BODY = re.compile(r"(?:[A-Za-z0-9+/=\s:,.-]|\\[nrt/\\])*+")

# A string that may hold a JSON object or array.
JSON_START = re.compile(r"\s*[\[{]")
REDACTED = re.compile(r"\[REDACTED:[^\]]*\]")
# Fields that name the header whose "value" they sit beside (HAR, Postman).
HEADER_NAME_FIELDS = ("name", "key", "header", "field")
# How a JSON text may have been written, so that it is written back alike.
JSON_STYLES: list[dict[str, Any]] = [
    {"separators": (",", ":")},
    {},
    {"indent": 2},
    {"indent": 4},
]


def known_secrets() -> dict[str, str]:
    """Secret value -> the kind it is reported as: the settings' secrets and
    the environment's variables named like secrets."""
    found: dict[str, str] = {}
    for name, value in os.environ.items():
        if SECRET_NAME.search(name) and len(value) >= MIN_SECRET_LENGTH:
            found[value] = f"env:{name}"
    database = settings.DATABASES["default"]
    named = [
        (name, getattr(settings, name))
        for name in dir(settings)
        if name.isupper() and SECRET_NAME.search(name) and not NOT_A_SECRET_SETTING.search(name)
    ]
    named += [("DATABASE_PASSWORD", database.get("PASSWORD") or "")]
    named += [("SECRET_KEY_FALLBACKS", old) for old in settings.SECRET_KEY_FALLBACKS]
    for name, value in named:
        if isinstance(value, str) and value:
            found[value] = f"setting:{name}"
    return found


class Redactor:
    """Replaces secrets in text and in JSON values, counting what it
    replaced per place (a bundle's file) and kind."""

    def __init__(self, secrets: dict[str, str] | None = None) -> None:
        secrets = known_secrets() if secrets is None else secrets
        self._kinds = {spelt: k for v, k in secrets.items() for spelt in spellings(v)}
        # A short secret only as a whole word: "k3y" is not redacted out of
        # "k3yboard", nor out of the page's own markup.
        short = {spelt for v in secrets if len(v) < MIN_SECRET_LENGTH for spelt in spellings(v)}
        self._values = (
            re.compile(
                "|".join(
                    _whole_word(spelt) if spelt in short else re.escape(spelt)
                    for spelt in sorted(self._kinds, key=len, reverse=True)
                )
            )
            if self._kinds
            else None
        )
        self.counts: dict[str, Counter[str]] = {}

    def text(self, value: str, where: str) -> str:
        """A text with its secrets replaced; a JSON object or array held in
        it is redacted by its names too, and stays the same JSON."""
        return self._string(value, self.counts.setdefault(where, Counter()))

    def value(self, value: Any, where: str) -> Any:
        """A JSON value with every secret in it redacted: by the name it is
        held under at any depth, and in every string (keys included)."""
        return self._walk(value, self.counts.setdefault(where, Counter()))

    def report(self) -> dict[str, dict[str, int]]:
        """Where, what kind, how many: never a value."""
        return {
            where: dict(sorted(counts.items()))
            for where, counts in sorted(self.counts.items())
            if counts
        }

    def _walk(self, value: Any, counts: Counter[str]) -> Any:
        if isinstance(value, str):
            return self._string(value, counts)
        if isinstance(value, dict):
            beside = _header_named(value)
            walked = {}
            for key, item in value.items():
                kind = secret_kind(key) if isinstance(key, str) else None
                if kind is None and key == "value":
                    kind = beside
                name = self._string(key, counts) if isinstance(key, str) else key
                walked[name] = (
                    self._hidden(item, kind, counts) if kind else self._walk(item, counts)
                )
            return walked
        if isinstance(value, list | tuple):
            # A header list's pair, [["Authorization", "Basic ..."], ...], is
            # read as a name and its value wherever it sits, among items of
            # other shapes too ({"name": ..., "value": ...} beside it).
            return [
                [self._string(item[0], counts), self._hidden(item[1], kind, counts)]
                if _is_pair(item) and (kind := secret_kind(item[0]))
                else self._walk(item, counts)
                for item in value
            ]
        return value

    def _hidden(self, value: Any, kind: str, counts: Counter[str]) -> Any:
        """The value held under a secret's name: gone whole, whatever it is
        (a string, a number, a whole object), unless it holds nothing."""
        if value is None or isinstance(value, bool) or value in ("", [], {}):
            return value
        if isinstance(value, str) and REDACTED.fullmatch(value):
            return value
        counts[kind] += 1
        return f"[REDACTED:{kind}]"

    def _string(self, text: str, counts: Counter[str]) -> str:
        if JSON_START.match(text):
            try:
                parsed = json.loads(text)
            except (ValueError, RecursionError):
                parsed = None
            if isinstance(parsed, dict | list):
                found: Counter[str] = Counter()
                try:
                    redacted = self._walk(parsed, found)
                except RecursionError:  # deeper than Python walks: read as text
                    pass
                else:
                    counts.update(found)
                    return _dumped_alike(text, parsed, redacted) if found else text
        return self._text(text, counts)

    def _text(self, text: str, counts: Counter[str]) -> str:
        if self._values is not None:
            text = self._values.sub(
                lambda match: _replaced(match, self._kinds[match.group(0)], counts), text
            )
        lowered = text.lower()
        if "-----begin " in lowered:
            text = _private_keys(text, counts)
        for found in FORMATS:
            if not any(trigger in lowered for trigger in found.triggers):
                continue
            text = found.pattern.sub(
                lambda match, found=found: _format_replaced(match, found, counts), text
            )
        return text


def _whole_word(spelt: str) -> str:
    word = re.escape(spelt)
    if re.match(r"\w", spelt):
        word = at_start(word, len(spelt))
    return word + "(?![A-Za-z0-9_])" if re.search(r"\w$", spelt) else word


def _is_pair(item: Any) -> bool:
    return isinstance(item, list | tuple) and len(item) == 2 and isinstance(item[0], str)


def _header_named(value: dict[str, Any]) -> str | None:
    """The kind of secret a {"name": "Authorization", "value": ...} holds."""
    if "value" not in value:
        return None
    for field in HEADER_NAME_FIELDS:
        name = value.get(field)
        if isinstance(name, str) and (kind := secret_kind(name)):
            return kind
    return None


def _dumped_alike(text: str, parsed: Any, redacted: Any) -> str:
    """`redacted` written as `parsed` was written in `text` (compact or
    indented, with non-ASCII escaped or not, with json_script's escapes or
    not), around the same spaces; otherwise as plain JSON."""
    body = text.strip()
    lead = text[: len(text) - len(text.lstrip())]
    trail = text[len(lead) + len(body) :]
    for style in JSON_STYLES:
        for ascii_only in (False, True):
            written = json.dumps(parsed, ensure_ascii=ascii_only, **style)
            for spelt in (str, _json_script):
                if spelt(written) == body:
                    return (
                        lead + spelt(json.dumps(redacted, ensure_ascii=ascii_only, **style)) + trail
                    )
    written = json.dumps(redacted, ensure_ascii=False)
    try:
        written.encode()
    except UnicodeEncodeError:  # a lone surrogate, read from its escape
        written = json.dumps(redacted)
    return lead + written + trail


def _json_script(written: str) -> str:
    return written.translate(JSON_SCRIPT)


def _escape_head(match: re.Match[str]) -> str:
    """What of the match completes a JSON escape begun before it (the `n`
    of `\\n`, the `u00e9` of `\\u00e9`): it stays, so the escape stays whole."""
    text, before = match.string, match.start() - 1
    while before >= 0 and text[before] == "\\":
        before -= 1
    if (match.start() - 1 - before) % 2 == 0:
        return ""
    matched = match.group(0)
    return matched[:5] if matched.startswith("u") else matched[:1]


def _replaced(match: re.Match[str], kind: str, counts: Counter[str]) -> str:
    counts[kind] += 1
    return f"{_escape_head(match)}[REDACTED:{kind}]"


def _format_replaced(match: re.Match[str], found: Format, counts: Counter[str]) -> str:
    if found.holds_secret is not None and not found.holds_secret(match):
        return match.group(0)
    if not found.keeps_name:
        return _replaced(match, found.kind, counts)
    counts[found.kind] += 1
    return f"{match.group(1)}[REDACTED:{found.kind}]"


def _private_keys(text: str, counts: Counter[str]) -> str:
    """Private-key blocks, each from its BEGIN line to its END line; a block
    without an END (cut short) to the end of its run of key characters.

    Found in one pass: after each BEGIN, the END is looked for only within
    the run of key characters that follows it, whose end is found once per
    run however many BEGIN lines it holds."""
    kept: list[str] = []
    done = 0
    run_end = -1
    while (begin := PEM_BEGIN.search(text, done)) is not None:
        if run_end < begin.end():
            run_end = PEM_BODY.match(text, begin.end()).end()  # type: ignore[union-attr]
        end = PEM_END.search(text, begin.end(), run_end)
        kept += [text[done : begin.start()], "[REDACTED:private_key]"]
        counts["private_key"] += 1
        done = end.end() if end is not None else run_end
    kept.append(text[done:])
    return "".join(kept)


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
