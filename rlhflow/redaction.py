"""URLs as they may be printed, logged or stored (MLflow params, tags and artifacts, Prefect parameters, artifacts and
logs, dvc.lock): their scheme, host, port and path, nothing else.

User info (`scheme://user:password@host`) goes whole: a user name alone can be a token (`https://TOKEN@host`). The
query and the fragment go too: a key can sit under any name there (`?k=...`, `#access_token=...`), and no list of
names catches them all.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

REDACTED = "***"

# a URL in free text: it ends at whitespace, a quote, a backtick or a bracket (a markdown link's), but for the
# brackets of an IPv6 host
_URL = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://(?:[^\s'\"<>`()\[\]/@]*@)?(?:\[[0-9a-fA-F:.]*\])?[^\s'\"<>`()\[\]]*")
# user info: everything between :// and the last @ before the host's end (a raw @ in a password included)
_USER_INFO = re.compile(r"(?<![a-zA-Z0-9+.-])(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/?#\s]*@")


def redact_url(url: str) -> str:
    """`url`'s scheme, host, port and path: no user info, query or fragment."""
    bare = user_info_removed(url)
    try:
        parts = urlsplit(bare)
    except ValueError:  # a malformed host (an unclosed IPv6 bracket): up to where the query would start
        return re.split(r"[?#]", bare, maxsplit=1)[0]
    return f"{parts.scheme}://{parts.netloc}{parts.path}"


def redact_urls(text: str) -> str:
    """`text` with every URL in it as `redact_url` shows it (a markdown link's two copies included)."""
    text = _USER_INFO.sub(r"\g<scheme>", str(text))
    return _URL.sub(lambda url: redact_url(url[0]), text)


def user_info_removed(url: str) -> str:
    """`url` without its user info, the rest as it was: the form of a store's address that may travel to other
    machines, each of which adds the credentials it holds."""
    return _USER_INFO.sub(r"\g<scheme>", url, count=1) if _USER_INFO.match(url) else url
