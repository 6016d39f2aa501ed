"""Caches and documents in object stores (S3 and compatibles, GCS, Azure, hf://, https://) via fsspec.

Only `is_url` and the printing of URLs live here: they are what the CLI asks before deciding to import
anything else, so the plain commands never import fsspec. fsspec and its backends (s3fs, ...) are the optional extra
`kvcli[remote]` and are imported inside the functions that need them.
"""

from __future__ import annotations

import re

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]+)://")
_USERINFO = re.compile(r"(://)[^/@\s]+@")
READ_ONLY_SCHEMES = ("hf", "http", "https")


def is_url(text: object) -> bool:
    """Whether `text` names a remote location (`scheme://...`) rather than a local path."""
    return isinstance(text, str) and bool(_SCHEME.match(text))


def scheme(url: str) -> str:
    m = _SCHEME.match(url)
    return m.group(1).lower() if m else ""


def redact(text: str) -> str:
    """`text` with any user:password@ of a URL removed (credentials never reach a message)."""
    return _USERINFO.sub(r"\1", text)


def shown(location: str) -> str:
    """A cache path or URL as printed and logged (a URL without user:password@)."""
    return redact(location) if is_url(location) else location
