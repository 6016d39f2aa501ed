"""A sectioned cache's sections on disk (format/sections.py): each opened as a cache of its own, and verified."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from . import manifest as mf, store
from ..errors import CacheCorruptError
from .sections import label, named


def open_part(path: str | os.PathLike, manifest: mf.Manifest, index: int) -> store.OpenedCache:
    """Section `index` of the sectioned cache at `path` as an OpenedCache of its own (its ids, its shards opened from
    its folder, each checked for its size), for restore and verify; a missing one is refused naming the section."""
    part = manifest.sections.parts[index]
    folder = Path(path) / part.dir
    own = dataclasses.replace(manifest, token_ids=part.token_ids, layers=part.layers, base=None, sections=None)
    fds: list[int] = []
    try:
        dir_fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise CacheCorruptError(f"{folder}: {label(part)} cannot be opened ({exc.strerror}); prefill the document again") from None
    try:
        for layer in part.layers:
            try:
                fds.append(store._open_in(dir_fd, layer.file, folder))
            except FileNotFoundError:
                raise CacheCorruptError(f"{folder / layer.file}: {label(part)}: shard is missing; prefill the document again") from None
            store._check_size(fds[-1], layer, f"{folder / layer.file}: {label(part)}")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    finally:
        os.close(dir_fd)
    return store.OpenedCache(path=folder, manifest=own, shards=fds)


def verify(path: str | os.PathLike, *, decode: bool = True, threads: int | None = None) -> mf.Manifest:
    """store.verify, and for a sectioned cache every section's shards too, in order; a bad one is refused naming its
    section."""
    from concurrent.futures import ThreadPoolExecutor

    m = store.verify(path, decode=decode, threads=threads)
    for p in m.sections.parts if m.sections is not None else []:
        with open_part(path, m, p.index) as part:

            def one(i: int, part=part) -> None:
                e = part.manifest.layers[i]
                data = part.read_shard(i)
                if decode:
                    store.check_payload(data, where=str(part.path / e.file), transform=m.transform, dtype=m.dtype, key_shape=e.key_shape,
                                        value_shape=e.value_shape, decoded_bytes=e.decoded_bytes, quant=m.quant)

            try:
                with ThreadPoolExecutor(max_workers=threads or min(store.usable_cores(), 8)) as pool:
                    for f in [pool.submit(one, i) for i in range(len(p.layers))]:  # in layer order: the first bad one
                        f.result()
            except CacheCorruptError as exc:
                raise named(p, exc) from None
    return m
