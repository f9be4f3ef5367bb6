"""Credentials out of URLs, before a URL is printed, logged or stored (MLflow params, tags and artifacts, Prefect
parameters, artifacts and logs, dvc.lock).

A URL's user info (`scheme://user:password@host`) is removed whole: a user name alone can be a token
(`https://TOKEN@host`). A query value is replaced by `***` when its key names a credential: a word of the key (split
at `_`, `-`, `.` and camelCase) is one of CREDENTIAL_WORDS (`key`, `api-key`, `access_token`, `sig`, ...), or the key
is a signed-URL parameter (`X-Amz-*`, `X-Goog-*`). Other query values (`api-version=2024-06-01`) are kept.
"""

from __future__ import annotations

import re
from urllib.parse import unquote_plus

REDACTED = "***"
CREDENTIAL_WORDS = frozenset(
    {"key", "apikey", "token", "secret", "password", "passwd", "pwd", "sig", "signature", "credential", "credentials"}
    | {"auth", "authorization", "code", "session", "sessionid"}
)
SIGNED_URL_PREFIXES = ("x-amz-", "x-goog-")

# a URL in free text: it ends at whitespace, a quote or an angle bracket
_URL = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>`]+")
# user info: everything between :// and the last @ before the host's end (a raw @ in a password included)
_USER_INFO = re.compile(r"(?<![a-zA-Z0-9+.-])(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/?#\s]*@")
# one key=value of a query; a value ends at &, #, or a closing bracket of the text around the URL
_QUERY_ITEM = re.compile(r"(?P<sep>[?&;])(?P<key>[^=&#;?\s]+)=(?P<value>[^&#;\s)\]]*)")
_CAMEL = re.compile(r"([a-z0-9])([A-Z])")


def is_credential_key(key: str) -> bool:
    """Whether a query key names a credential (CREDENTIAL_WORDS, SIGNED_URL_PREFIXES)."""
    name = unquote_plus(key)
    if name.lower().startswith(SIGNED_URL_PREFIXES):
        return True
    words = re.split(r"[_.\-\s]+", _CAMEL.sub(r"\1_\2", name).lower())
    return not CREDENTIAL_WORDS.isdisjoint(words) or "".join(words) in CREDENTIAL_WORDS


def redact_url(url: str) -> str:
    """`url` without user info and with its query's credential values replaced by ***."""
    return _masked_query(user_info_removed(url))


def redact_urls(text: str) -> str:
    """`text` with every URL in it redacted as `redact_url` does (a markdown link's two copies included)."""
    text = _USER_INFO.sub(r"\g<scheme>", str(text))
    return _URL.sub(lambda url: _masked_query(url[0]), text)


def user_info_removed(url: str) -> str:
    """`url` without its user info, the rest as it was: the form of a store's address that may travel to other
    machines, each of which adds the credentials it holds."""
    return _USER_INFO.sub(r"\g<scheme>", url, count=1) if _USER_INFO.match(url) else url


def _masked_query(url: str) -> str:
    base, sep, rest = url.partition("?")
    if not sep:
        return url
    return base + _QUERY_ITEM.sub(_masked_item, "?" + rest)


def _masked_item(item: re.Match) -> str:
    value = REDACTED if is_credential_key(item["key"]) and item["value"] else item["value"]
    return f"{item['sep']}{item['key']}={value}"
