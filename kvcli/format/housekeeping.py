"""Removing caches safely (`kvcli rm`) and clearing leftovers and old caches (`kvcli prune`). No torch here.

Only kvcli caches are removed: a real folder (no symlink) holding a manifest of format "kvcli-cache"
and nothing but that manifest and layer shards. A cache is first renamed to a hidden temporary
sibling, then deleted, so no reader ever sees half a cache (and `prune` finishes an interrupted removal).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from . import chain, manifest as mf, store
from ..errors import CacheError, KvcliError, UsageError
from .store import TMP_MARK
from .writing import hidden_sibling, is_leftover, remove_if_stale

_SHARD = re.compile(r"layer_\d{3}\.safetensors\.zst")
_SECTION = re.compile(r"s\d{4,5}")  # a sectioned cache's section folder (format/sections.py), holding shards only


@dataclass(frozen=True)
class Removal:
    path: Path
    kind: str  # "cache" or "leftover" (a temporary folder of a killed or interrupted writer)
    bytes: int
    age_s: float | None = None


def not_a_cache(path: Path, *, damaged: bool = False) -> str | None:
    """Why `path` is not a removable kvcli cache, or None when it is one; damaged=True also takes a cache whose
    manifest is not readable JSON, when it holds nothing but that manifest and layer shards."""
    if path.is_symlink():
        return "is a symbolic link, not a cache"
    if not path.exists():
        return "no such file or folder"
    if not path.is_dir():
        return "is a file, not a kvcli cache"
    if TMP_MARK in path.name:
        return "is a kvcli temporary folder (kvcli prune clears those)"
    why = damaged_manifest(path)
    if why is not None and not (damaged and _unreadable_beside_shards(path)):
        return why
    others = sorted(e.name for e in path.iterdir() if e.name != mf.MANIFEST_NAME and not _part(e)
                    and not (_SECTION.fullmatch(e.name) and e.is_dir() and not e.is_symlink() and all(_part(f) for f in e.iterdir())))
    if others:
        return f"holds files that are not part of a kvcli cache ({', '.join(others[:3])}{', ...' if len(others) > 3 else ''})"
    return None


def _unreadable_beside_shards(path: Path) -> bool:
    """A kvcli cache whose manifest was cut or garbled: a manifest that is not JSON, beside layer shards."""
    try:
        json.loads((path / mf.MANIFEST_NAME).read_bytes())
        return False
    except FileNotFoundError:
        return False
    except (OSError, ValueError):
        return any(_SHARD.fullmatch(e.name) for e in path.iterdir())


def damaged_manifest(path: Path) -> str | None:
    """Why a folder's manifest is not a kvcli cache's, or None when it is one."""
    try:
        body = json.loads((path / mf.MANIFEST_NAME).read_bytes())
    except FileNotFoundError:
        return f"is not a kvcli cache (no {mf.MANIFEST_NAME})"
    except (OSError, ValueError):
        return f"is not a kvcli cache ({mf.MANIFEST_NAME} is not readable JSON)"
    if not isinstance(body, dict) or body.get("format") != mf.FORMAT_NAME:
        return f"is not a kvcli cache ({mf.MANIFEST_NAME} is not a kvcli manifest)"
    return None


def _part(entry: Path) -> bool:
    """A layer shard: a plain file of a shard's name."""
    return bool(_SHARD.fullmatch(entry.name)) and entry.is_file() and not entry.is_symlink()


def size_of(path: Path) -> int:
    if path.is_symlink() or not path.is_dir():
        return path.lstat().st_size
    return sum(e.stat(follow_symlinks=False).st_size for e in path.rglob("*"))


def age_of(path: Path) -> float:
    """Seconds since the cache was written (its manifest's mtime, as `kvcli ls` shows)."""
    return max(0.0, time.time() - os.stat(path / mf.MANIFEST_NAME).st_mtime)


def remove_cache(path: str | os.PathLike, *, damaged: bool = False) -> Removal:
    """Delete one kvcli cache (damaged=True: also one whose manifest is damaged); refuse (KvcliError) anything else,
    touching nothing."""
    path = Path(path)
    why = not_a_cache(path, damaged=damaged)
    if why:
        raise KvcliError(f"{path}: {why}; refusing to remove it")
    size = size_of(path)
    hidden = hidden_sibling(path, "rm")
    try:
        os.rename(path, hidden)  # one step: readers see the whole cache or none
    except OSError as exc:
        raise KvcliError(f"{path}: cannot remove ({exc.strerror or exc})") from None
    shutil.rmtree(hidden, ignore_errors=True)
    return Removal(path=path, kind="cache", bytes=size)


def distinct(paths: list[Path]) -> list[Path]:
    """The paths without repeats, in order: two spellings of one path (a.kv, ./a.kv, d/../a.kv) are one.
    The last component is not resolved, so a symbolic link stays a link (and is refused)."""
    seen: dict[str, Path] = {}
    for path in map(Path, paths):
        seen.setdefault(os.path.normcase(os.path.join(os.path.realpath(path.parent), path.name)), path)
    return list(seen.values())


def check_removable(paths: list[Path], *, force: bool = False) -> dict[Path, str]:
    """Refuse the whole request, before removing anything, if any path is not a kvcli cache, or (unless force)
    is the base of a cache beside it that is not removed too (prefill --after). A cache whose manifest is damaged
    (not JSON, beside layer shards and nothing else) does not stop the others: returned, path -> what is wrong, for
    the caller to report, and with force removed too (then nothing is returned)."""
    gone = {os.path.realpath(p) for p in paths}
    damaged: dict[Path, str] = {}
    for path in paths:
        why = not_a_cache(Path(path), damaged=True)
        if why:
            raise KvcliError(f"{path}: {why}; refusing to remove it (nothing was removed)")
        broken = damaged_manifest(Path(path))
        if broken is not None:
            if not force:
                damaged[path] = broken.removeprefix("is not a kvcli cache (").removesuffix(")")
            continue
        kept = [p for p in extended_by(Path(path)) if os.path.realpath(p) not in gone]
        if kept and not force:
            raise KvcliError(f"{path}: {kept[0]} extends it (prefill --after); remove both, or pass --force to break "
                             "the link (nothing was removed)")
    return damaged


def _needed(path: Path, older_than_s: float, depth: int = 0) -> bool:
    """Whether a cache beside `path` that prune keeps (younger, or itself needed) extends it."""
    return depth < chain.MAX_CHAIN and any(age_of(p) < older_than_s or _needed(p, older_than_s, depth + 1)
                                        for p in extended_by(path))


def extended_by(path: Path) -> list[Path]:
    """The caches in `path`'s folder that extend it (their manifests name it as their base)."""
    target = os.path.realpath(path)
    found = []
    for entry in sorted(path.parent.iterdir()) if path.parent.is_dir() else ():
        if entry.name == path.name or not store.is_cache(entry):
            continue
        try:
            m = store.read_manifest(entry, chain=False)
            if m.base is not None and os.path.realpath(chain.base_path(entry, m.base["path"])) == target:
                found.append(entry)
        except CacheError:
            continue
    return found


def prune(folder: str | os.PathLike, *, older_than_s: float | None = None, dry_run: bool = False) -> list[Removal]:
    """Remove leftovers of dead writers in `folder`, and with older_than_s the caches older than that.

    Only entries directly inside `folder` are considered; a leftover whose writer still runs is kept.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise UsageError(f"{folder}: not a folder")
    done: list[Removal] = []
    for entry in sorted(folder.iterdir()):
        if is_leftover(entry):
            try:
                size = size_of(entry)
            except OSError:  # gone meanwhile
                size = 0
            if remove_if_stale(entry, dry_run=dry_run):
                done.append(Removal(path=entry, kind="leftover", bytes=size))
        elif older_than_s is not None and not_a_cache(entry) is None:
            age = age_of(entry)
            if age >= older_than_s and not _needed(entry, older_than_s):
                size = size_of(entry) if dry_run else remove_cache(entry).bytes
                done.append(Removal(path=entry, kind="cache", bytes=size, age_s=age))
    return done

