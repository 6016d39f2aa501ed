"""Where a corpus run reads each document and writes its cache: local paths or fsspec URLs (through kvcli.remote)."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..documents import Document, cache_name
from ..errors import KvcliError, UsageError
from ..format import manifest as mf
from ..remote import is_url, objects, redact


def target_for(output: str | None, *, single: bool) -> Callable[[str], object]:
    """entry -> its cache's Target: next to the document, in folder `output`, or under URL prefix `output`.

    single (one document, no list): `output` names the cache itself unless it is an existing folder
    (or a URL ending in '/'), as for a plain prefill.
    """
    from . import corpus
    from ..format.store import is_cache

    if output is not None and is_url(output):
        objects.check_writable(output)
        if single and not output.endswith("/"):
            return lambda entry: RemoteTarget(output)
        return lambda entry: RemoteTarget(objects.join(output, cache_name(entry)))
    if output is not None:
        folder = Path(output)
        if single and not (folder.is_dir() and not is_cache(folder)):
            return lambda entry: corpus.LocalTarget(folder)
        if is_cache(folder) or (folder.exists() and not folder.is_dir()):
            raise UsageError(f"{folder}: with several documents or --from-list, -o must be a folder")
        from ..format.writing import make_folder

        make_folder(folder)  # like mkdir -p, race-free: every task of a scheduler array may create it at once
        return lambda entry: corpus.LocalTarget(folder / cache_name(entry))

    def beside(entry: str):
        if is_url(entry):
            raise UsageError(f"{entry}: a document given as a URL needs -o (a folder or an object-store URL)")
        return corpus.LocalTarget(Path(entry).parent / cache_name(entry))

    return beside


def reader(encoding: str = "utf-8") -> Callable[[str], Document]:
    """entry -> Document: a URL fetched through fsspec, a path read as usual."""
    from .. import documents

    def read(entry: str) -> Document:
        if is_url(entry):
            return objects.read_document(entry, encoding)
        return documents.read(entry, encoding)

    return read


@dataclass(frozen=True)
class RemoteTarget:
    """A cache at an fsspec URL, for corpus runs: built in a local temporary folder, then uploaded."""

    url: str

    @property
    def name(self) -> str:
        return redact(self.url)

    def current(self) -> mf.Manifest | None:
        """The manifest there, if it parses and every shard it names is present at its size."""
        try:
            m = objects.read_manifest(self.url)
            sizes = objects.stored_sizes(self.url)
        except KvcliError:
            return None
        if any(sizes.get(rel) != e.stored_bytes for rel, e, _part in objects.shards(m)):
            return None
        return m

    def write(self, lm: Any, document: Document, *, force: bool, **options: Any):
        from .sections import build

        objects.check_writable(self.url)
        if options.get("after") is not None:
            raise UsageError(f"{self.url}: a cache that extends another (--after) is written to a local folder, "
                             "beside its base; upload the chain's folders together")
        with tempfile.TemporaryDirectory(prefix="kvcli-upload-") as tmp:
            r = build.prefill(lm, document, Path(tmp) / "cache.kv", **options)
            objects.upload(r.path, self.url, force=force)
        return r
