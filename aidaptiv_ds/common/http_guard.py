"""Who may talk to an HTTP endpoint of the product (the studio's page, `serve`'s OpenAI API): the one rule, so every
endpoint keeps it.

- Host: bound to a loopback address, only `localhost` and loopback IP literals (127.0.0.1, [::1], ...), on any
  port: a page whose name resolves to 127.0.0.1 (DNS rebinding) cannot send those names (its requests carry its
  own name), while the port is the one the client dialled, which differs behind `ssh -L 8080:localhost:7860`.
  Bound to any other address (which needs a password or key), any name: the server cannot know every name the
  machine is reached by, and a rebinding page has no credential for its own name, so the credential is the check.
- Origin: absent, or the request's own Host (the endpoint's own page). Any other origin, `null` included, is
  refused, so no answer ever grants another origin's page.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Optional, Sequence, Tuple
from urllib.parse import urlsplit

# A Host header (or an Origin's authority): a name or a bracketed IPv6 literal, then an optional port.
_AUTHORITY = re.compile(r"^(?P<name>\[[0-9a-f:.]+\]|[a-z0-9.-]+)(?::(?P<port>[0-9]{1,5}))?$")
DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def is_loopback(host: str) -> bool:
    """Whether an address (a `--host`, or a Host header's name) is this machine only."""
    host = host.strip().lower()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def split_authority(text: str, default_port: int) -> Optional[Tuple[str, int]]:
    """(name, port) of a Host header's value, names lower-cased and IPv6 brackets kept; None when it is none."""
    m = _AUTHORITY.match(text.strip().lower())
    if not m:
        return None
    return m.group("name"), int(m.group("port")) if m.group("port") else default_port


def refusal(
    hosts: Sequence[str], origins: Sequence[str], bound_host: str, scheme: str = "http", who: str = "this server"
) -> Optional[Tuple[int, str]]:
    """(HTTP status, one line) when a request with these Host and Origin headers must be refused, else None."""
    own = split_authority(hosts[0], DEFAULT_PORTS.get(scheme, 80)) if len(hosts) == 1 else None
    if own is None:
        said = repr(hosts[0]) if len(hosts) == 1 else f"{len(hosts)} Host headers"
        return 421, f"{who}: refused a request with the Host {said}: send one host name"
    if is_loopback(bound_host) and not is_loopback(own[0]):
        return 421, (
            f"{who}: refused a request for {hosts[0]!r}: it answers only to localhost, 127.0.0.1 and [::1] (use one of "
            "those names, or listen on another address with a password or key)"
        )
    if not origins:
        return None
    parts = urlsplit(origins[0]) if len(origins) == 1 else None
    origin_scheme = parts.scheme if parts else ""
    theirs = split_authority(parts.netloc, DEFAULT_PORTS.get(origin_scheme, 80)) if parts and origin_scheme else None
    if theirs != own:
        return 403, f"{who}: refused a request from the page at {origins[0]!r}: it answers its own page only"
    return None
