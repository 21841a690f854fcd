"""The one rule for what never leaves the process in clear: the secrets a URL can carry.

    mask("run --set dataset.url=https://u:pw@host/x?token=abc&v=2")
        -> "run --set dataset.url=https://u:***@host/x?token=***&v=2"

In every URL found in a text (`scheme://...`), the password of `user:password@` (or a whole
`user@` without one: a token used as a user name) and the value of every query or fragment
parameter whose name looks like a credential (`SECRET_NAMES`, `is_secret_name`) become `***`.
A value that is only an `${env:NAME}` placeholder stays: it names a variable, not a secret.
Every character the URL grammar allows in a user name, password or query value is part of
what is masked (`'`, `!`, `$`, `&`, `(`, `)`, `*`, `+`, `,`, `;`, `=`, `%XX`): a URL runs up
to a space, `"`, `<`, `>` or a backtick, and only a quote or punctuation that closes it is
left outside. A query without its scheme and host (`/path?token=...`, as http.client and
urllib3 quote a request in their errors) is masked the same way.

`scrub(text, url)` goes further for an error's text: every secret value of `url` (its
password, its credential parameters' values, raw and decoded) is removed wherever it stands,
also where no URL grammar shows it (a token holding a space, quoted by http.client).

Applied where values leave the process (MLflow params, tags and artifacts; the workspace's
records; logs; error lines; `show`, `compare`), not where they are made: the full URL is
what the request is made with.
"""

from __future__ import annotations

import re
import urllib.parse
from typing import Any

MASK = "***"

# query parameter names (lower case) whose value is a credential
SECRET_NAMES = frozenset(
    {
        "token",
        "sig",
        "signature",
        "key",
        "apikey",
        "api_key",
        "api-key",
        "access_token",
        "refresh_token",
        "id_token",
        "password",
        "passwd",
        "pwd",
        "pass",
        "secret",
        "client_secret",
        "auth",
        "authorization",
        "credential",
        "credentials",
        "session",
        "sessionid",
        "session_id",
    }
)
# parts that make any name a credential's: x_auth_token, AccessKey, private-token, ...
SECRET_PARTS = ("token", "secret", "passw", "signature", "credential", "auth", "apikey", "api_key")
# whole families: a signed cloud URL's parameters (X-Amz-Signature, X-Amz-Credential,
# X-Amz-Security-Token, X-Goog-Signature, ...) are masked together
SECRET_PREFIXES = ("x-amz-", "x-goog-", "x-ms-")

PLACEHOLDER = re.compile(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)\}")
# a URL inside any text: a scheme, `://`, and everything up to a space, `"`, `<`, `>` or a
# backtick (`'` is legal in a password or a query value: a quote that closes the URL is
# taken off its end, _TRAILING)
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s\"<>`]+")
_TRAILING = ".,;:!?)'"  # punctuation or a quote after a URL in a sentence, not part of it
# a query without its URL (`/x?a=1&token=s3cr3t`): from a `?` to a space or a quote
_BARE_QUERY = re.compile(r"\?[^\s\"<>`?#]*=[^\s\"<>`#]*")


def is_secret_name(name: str) -> bool:
    """Whether a query parameter of this name carries a credential (case-insensitive)."""
    n = urllib.parse.unquote_plus(name).strip().lower()
    return (
        n in SECRET_NAMES
        or n.endswith("key")
        or any(part in n for part in SECRET_PARTS)
        or n.startswith(SECRET_PREFIXES)
    )


def _hidden(value: str) -> str:
    return value if not value or PLACEHOLDER.fullmatch(value) else MASK


def _params(text: str) -> str:
    """`a=1&token=x` -> `a=1&token=***`, the separators and the order kept. A secret's value
    runs to the next `&` (a `;` inside it is its own); without a secret name, `;` separates
    parameters too (`a=1;sig=x`)."""
    parts = text.split("&")
    for i, part in enumerate(parts):
        name, eq, value = part.partition("=")
        if eq and is_secret_name(name):
            parts[i] = f"{name}={_hidden(value)}"
        elif ";" in part:
            parts[i] = ";".join(_params(p) if p != part else p for p in part.split(";"))
    return "&".join(parts)


def mask_url(url: str) -> str:
    """One URL with its credentials masked (a text that is no URL comes back as it is)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    authority, tail = rest[:end], rest[end:]
    userinfo, at, host = authority.rpartition("@")
    if at:
        user, colon, password = userinfo.partition(":")
        authority = f"{user}:{_hidden(password)}@{host}" if colon else f"{_hidden(user)}@{host}"
    tail, hash_, fragment = tail.partition("#")
    path, q, query = tail.partition("?")
    return f"{scheme}://{authority}{path}{q}{_params(query)}{hash_}{_params(fragment)}"


def _mask_match(match: re.Match) -> str:
    url = match.group()
    stripped = url.rstrip(_TRAILING)
    return mask_url(stripped) + url[len(stripped) :]


def _mask_bare_query(match: re.Match) -> str:
    query = match.group()
    stripped = query.rstrip(_TRAILING)
    return "?" + _params(stripped[1:]) + query[len(stripped) :]


def mask_text(text: str) -> str:
    """`text` with the credentials of every URL in it, and of every query without its URL,
    masked."""
    if "://" in text:
        text = _URL.sub(_mask_match, text)
    if "?" in text and "=" in text:
        text = _BARE_QUERY.sub(_mask_bare_query, text)
    return text


def secrets_of(url: str) -> list[str]:
    """The secret values a URL holds (what `mask_url` hides), each as written and decoded,
    longest first; `${env:NAME}` placeholders are no secret."""
    found: set[str] = set()
    _, sep, rest = url.partition("://")
    if sep:
        end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
        userinfo, at, _ = rest[:end].rpartition("@")
        if at:
            user, colon, password = userinfo.partition(":")
            found.add(password if colon else user)
    tail = rest if sep else url
    for section in re.split(r"[?#]", tail)[1:]:
        for part in section.split("&"):
            for piece in (part, *part.split(";")):
                name, eq, value = piece.partition("=")
                if eq and is_secret_name(name):
                    found.add(value)
    values = set()
    for value in found:
        if value and _hidden(value) == MASK:
            values |= {value, urllib.parse.unquote(value), urllib.parse.unquote_plus(value)}
    return sorted((v for v in values if v), key=len, reverse=True)


def scrub(text: str, url: str) -> str:
    """`text` (an exception's message about a request to `url`) masked, and every secret
    value of `url` in it replaced by `***` wherever it stands."""
    for value in secrets_of(url):
        text = text.replace(value, MASK)
    return mask_text(text)


def mask(value: Any) -> Any:
    """`value` with every URL's credentials masked: a text, or the strings (keys too) of
    nested dicts, lists and tuples; anything else as it is."""
    if isinstance(value, str):
        return mask_text(value)
    if isinstance(value, dict):
        return {mask(k): mask(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(mask(v) for v in value)
    return value
