"""What the HTTP endpoint checks before any model work, and what it takes out of its answers (serve/http.py).

Host names (DNS rebinding: a page whose name resolves to 127.0.0.1 sends its own Host), bind addresses,
browser origins, and server paths in messages. Stdlib only.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Sequence

from ..errors import UsageError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
_ABSOLUTE_DIRS = re.compile(r"(?<![\w.:/])(?:~|[A-Za-z]:)?(?:/[^\s/'\"(),:]+)+/(?=[^\s/'\"(),:])")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def parse_address(text: str) -> tuple[str, int]:
    """HOST:PORT (or [IPv6]:PORT) -> (host, port); UsageError when malformed."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise UsageError(f"--http {text}: expected HOST:PORT, e.g. 127.0.0.1:8000")
    return host.strip("[]"), int(port)


def check_bind(host: str, api_key: str | None) -> None:
    """Only loopback without a key: anyone who can reach the port could read the documents."""
    if not is_loopback(host) and not api_key:
        raise UsageError(f"--http {host}: listening on a non-loopback address needs --api-key (clients send it as a Bearer token)")


def allowed_hosts(host: str, extra: Sequence[str] = ()) -> list[str]:
    """The Host header names a server bound to `host` answers: loopback names, the bound address (every
    local name for a wildcard address), and the names the user added (--allow-host)."""
    names = list(LOOPBACK_NAMES)
    bound = f"[{host}]" if ":" in host else host
    if bound not in names:
        names.append(bound)
    if host in ("0.0.0.0", "::", ""):
        names += [socket.gethostname(), socket.getfqdn()]
    for name in extra:
        name = name.strip().lower()
        if not name or "/" in name or ("*" in name[1:]) or (name.startswith("*") and not name.startswith("*.")):
            raise UsageError(f"--allow-host {name!r}: expected a host name such as kvcli.example.org or *.example.org")
        names.append(name)
    return list(dict.fromkeys(n.lower() for n in names if n))


def check_origins(origins: Sequence[str]) -> list[str]:
    """--allow-origin values: scheme://host[:port], exactly as a browser sends its Origin header."""
    for origin in origins:
        if not re.fullmatch(r"https?://[^/\s]+", origin):
            raise UsageError(f"--allow-origin {origin!r}: expected an origin such as https://app.example.org (scheme, host, optional port)")
    return list(origins)


def scrub(message: str, folders: Sequence[str] = ()) -> str:
    """An error message without server paths: the --docs folders taken out (a cache is named by its model
    id), any other absolute path cut to its last part."""
    for folder in sorted({str(f).rstrip("/") for f in folders if str(f) not in ("", "/")}, key=len, reverse=True):
        message = message.replace(folder + "/", "")
    return _ABSOLUTE_DIRS.sub("", message)
