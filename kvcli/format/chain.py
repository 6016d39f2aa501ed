"""Links between caches (`prefill --after`): a link's record of its base, where the base lies, and whether the
cache found there is the one the link was computed on. Pure Python, no torch."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from ..errors import CacheMissingError
from .fields import bad, get_field, int_field, str_field
from .identity import FRAMING_KEYS

BASE_KEYS = ("manifest_sha256", "path", "num_tokens")  # the base's manifest digest, where it lies, its tokens
MAX_CHAIN = 64  # links a chain may have: bounds a hostile loop of bases
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def check_base(body: dict, num_tokens: int, allowed: bool, where: str) -> dict[str, Any] | None:
    """A manifest's optional `base`: its digest, its path (relative to the link's folder, or absolute) and the
    tokens it holds, fewer than the link's. allowed: the manifest's format version has the field."""
    base = get_field(body, "base", dict, where, optional=True)
    if base is None:
        return None
    if not allowed:
        raise bad(where, f"format version {body.get('format_version')} has no 'base' field")
    if set(base) != set(BASE_KEYS):
        raise bad(where, f"manifest field 'base' must hold exactly {list(BASE_KEYS)}")
    str_field(base, "base.manifest_sha256", where, pattern=_SHA256)
    if not str_field(base, "base.path", where):
        raise bad(where, "manifest field 'base.path' is empty")
    int_field(base, "base.num_tokens", where, 1, num_tokens - 1)
    return dict(base)


def base_path(link: Path, recorded: str) -> Path:
    """Where a link's base lies: its recorded path, taken relative to the link's own folder unless absolute."""
    if "://" in recorded:
        raise CacheMissingError(f"{link}: extends {recorded}, an object-store URL; fetch the chain into one local "
                                "folder and prefill it with --after there")
    return Path(os.path.normpath(link / recorded))


def base_problem(link: Any, base: Any) -> str | None:
    """What makes manifest `base` not that of the cache manifest `link` was computed on (None if it is): the same
    manifest (its digest), model, framing and token ids."""
    if base.digest != link.base["manifest_sha256"]:
        return "has changed since this cache was made (its manifest digest differs)"
    if base.num_tokens != link.base["num_tokens"] or base.token_ids != link.token_ids[: base.num_tokens]:
        return "holds other token ids than the start of this cache"
    if {k: v for k, v in base.model.items() if k != "source"} != {k: v for k, v in link.model.items() if k != "source"}:
        return "was made with another model or dtype"
    if any(base.framing.get(k) != link.framing.get(k) for k in FRAMING_KEYS):
        return "was made with another prompt framing"
    return None
