"""One rule for every setting that sends a credential somewhere, checked when params.yaml is loaded.

A section that reads a key from the environment and sends it to a URL it also names (the judge's endpoint, Label
Studio) is one change of params.yaml away from posting that key to a stranger: a pull request, a parameter typed
into the Prefect UI. So, for every such section:

- the variable it names must be one of its own service's (`Service.variables`, a pattern per service): the judge
  may read OPENAI_API_KEY or a JUDGE/LLM-named key, Label Studio a LABEL_STUDIO_ key, and neither any other
  credential of the machine, the project's own among them;
- the URL the key goes to must be https, or http on this machine (127.0.0.0/8, ::1, localhost), unless the
  section's own `allow_plain_http` says otherwise;
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


def transport_problem(setting: str, url: str, what: str, allow_plain_http: str | None = None) -> str | None:
    """Why `what` (a key, answers) may not go to `url`, the value of `setting` (None: it may): https, or http on this
    machine. `allow_plain_http`: the setting that lifts the rule, named in the message (None: nothing lifts it)."""
    scheme, host = scheme_and_host(url)
    if scheme == "https" or (scheme == "http" and is_loopback(host)):
        return None
    lift = f", or set {allow_plain_http}=true" if allow_plain_http else ""
    return (
        f"{setting} {redact_urls(url)} is not https: {what} would cross the network unencrypted. Use https or an "
        f"http URL on this machine (127.0.0.1, ::1, localhost){lift}"
    )
