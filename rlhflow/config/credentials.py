"""One rule for every setting that sends a credential somewhere, checked when params.yaml is loaded.

A section that reads a key from the environment and sends it to a URL it also names (the judge's endpoint, Label
Studio) is one change of params.yaml away from posting that key to a stranger: a pull request, a parameter typed
into the Prefect UI. So, for every such section:

- the variable it names must be one of its own service's (`Service.variables`, a pattern per service): the judge
  may read OPENAI_API_KEY or a JUDGE/LLM-named key, Label Studio a LABEL_STUDIO_ key, and neither any other
  credential of the machine, the project's own among them;
- the URL the key goes to must be one that every client reads as the check does (`reading_problem`), and https,
  or http on this machine (127.0.0.0/8, ::1, localhost), unless the section's own `allow_plain_http` says otherwise;
- a refused setting names the key, the value (a URL without its credentials) and why.

The tracking store follows the same transport rule where its URI carries a password (rlhfops/tracking.py applies
it to the credentials MLflow reads from the environment).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from rlhflow.redaction import redact_urls

# httpx and urllib3, the clients' own URL parsers, are imported where a URL is checked: every command reads the
# config, and its --help needs neither.


@dataclass(frozen=True)
class Service:
    name: str
    variables: re.Pattern  # the environment variables its key may be read from
    example: str


JUDGE = Service(
    "the judge's endpoint",
    re.compile(r"OPENAI_API_KEY|(?:[A-Z0-9]+_)*(?:JUDGE|LLM|VLLM)(?:_[A-Z0-9]+)*_(?:API_KEY|TOKEN)"),
    "OPENAI_API_KEY, JUDGE_API_KEY, MY_LLM_TOKEN",
)
LABEL_STUDIO = Service(
    "Label Studio",
    re.compile(r"LABEL_STUDIO(?:_[A-Z0-9]+)*_(?:API_KEY|TOKEN)"),
    "LABEL_STUDIO_API_KEY",
)


def variable_problem(setting: str, name: str, service: Service) -> str | None:
    """Why `setting` may not name the variable `name` as `service`'s key (None: it may)."""
    if service.variables.fullmatch(name):
        return None
    return (
        f"{setting}={name!r} is not a variable for {service.name}'s key: the key read from it is sent there, so it "
        f"must be one of that service's own (upper case, {service.example}), never another credential"
    )


# The one form of URL a credential is sent to: scheme://[user info@]host[:port][/path][?query][#fragment] in printable
# ASCII without a backslash; user info without a raw @, / ? or # (percent-encoded: %40); a host of letters, digits,
# dots and hyphens, or a bracketed IPv6 address. Outside it parsers part ways: urllib3 (requests, MLflow) ends the host
# at a backslash where urllib.parse reads on to the last @.
_PLAIN_URL = re.compile(
    r"[A-Za-z][A-Za-z0-9+.-]*://"
    r"(?:[A-Za-z0-9._~!$&'()*+,;=:%-]*@)?"
    r"(?:[A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\])"
    r"(?::[0-9]{1,5})?"
    r"(?:[/?#][\x21-\x5b\x5d-\x7e]*)?"
)
DEFAULT_PORTS = {"http": 80, "https": 443}


def readings(url: str) -> set[tuple[str, str, int | None]]:
    """(scheme, host, port) as each client's parser reads `url`: urllib.parse (the check, urllib.request), urllib3
    (requests, MLflow) and httpx (the judge); one element when they agree. Raises ValueError where one cannot."""
    import httpx  # the clients' own parsers: loaded only when a URL is checked
    from urllib3.util import parse_url

    try:
        split, pooled, hx = urlsplit(url), parse_url(url), httpx.URL(url)
    except httpx.InvalidURL as err:  # urllib.parse's and urllib3's errors are ValueErrors already
        raise ValueError(str(err)) from None
    read = [
        (split.scheme, split.hostname or "", split.port),
        (pooled.scheme or "", pooled.host or "", pooled.port),
        (hx.scheme, hx.host, hx.port),
    ]
    return {
        (scheme.lower(), host.lower().strip("[]"), port or DEFAULT_PORTS.get(scheme.lower()))
        for scheme, host, port in read
    }


def reading_problem(setting: str, url: str) -> str | None:
    """Why `url`, the value of `setting`, may not receive a credential although its host may pass the transport
    rule (None: it may): it is not of the plain form (_PLAIN_URL), or urllib.parse, urllib3 and httpx read a
    different scheme, host or port in it. The message shows the URL without credentials and names what breaks."""
    if re.search(r"[^\x21-\x7e]", url):
        reason = "it holds whitespace, a control character or a character outside printable ASCII"
    elif "\\" in url:
        reason = "it holds a backslash"
    elif not _PLAIN_URL.fullmatch(url):
        reason = "its host is not a name, an IPv4 or a bracketed IPv6 address after at most one @"
    else:
        try:
            reason = None if len(readings(url)) == 1 else "urllib.parse, urllib3 and httpx read different hosts in it"
        except ValueError as err:
            reason = f"it cannot be read ({type(err).__name__})"
    if reason is None:
        return None
    return (
        f"{setting} {redact_urls(url)!r} is refused: {reason}. Clients read such a URL differently from the check, so "
        "a credential could go to a host other than the one checked. Write scheme://host[:port]/path, with an @ in "
        "a user name or password percent-encoded (%40)"
    )


def scheme_and_host(url: str) -> tuple[str, str]:
    """The scheme and host of a URL, lower case (host without user info or port; "" when it has none)."""
    try:
        parts = urlsplit(url)
        return parts.scheme.lower(), (parts.hostname or "")
    except ValueError:  # a malformed host, e.g. an unclosed IPv6 bracket
        return url.partition(":")[0].lower(), ""


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 (an IPv4-mapped loopback address too) or localhost."""
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or bool(mapped and mapped.is_loopback)


def transport_problem(
    setting: str, url: str, what: str, allow_plain_http: str | None = None, *, lifted: bool = False
) -> str | None:
    """Why `what` (a key, answers) may not go to `url`, the value of `setting` (None: it may): https, or http on this
    machine, in a URL every client reads alike (`reading_problem`). `allow_plain_http`: the setting that lifts the
    https rule, named in the message (None: nothing lifts it); `lifted`: it is lifted (the reading rule alone holds)."""
    problem = reading_problem(setting, url)
    if problem or lifted:
        return problem
    scheme, host = scheme_and_host(url)
    if scheme == "https" or (scheme == "http" and is_loopback(host)):
        return None
    lift = f", or set {allow_plain_http}=true" if allow_plain_http else ""
    return (
        f"{setting} {redact_urls(url)} is not https: {what} would cross the network unencrypted. Use https or an "
        f"http URL on this machine (127.0.0.1, ::1, localhost){lift}"
    )
