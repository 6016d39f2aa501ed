"""Where a corpus run reads each document and writes its cache: local paths or fsspec URLs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from . import is_url
from ..documents import Document, cache_name
from ..errors import UsageError


def target_for(output: str | None, *, single: bool) -> Callable[[str], object]:
    """entry -> its cache's Target: next to the document, in folder `output`, or under URL prefix `output`.

    single (one document, no list): `output` names the cache itself unless it is an existing folder
    (or a URL ending in '/'), as for a plain prefill.
    """
    from ..engine import corpus
    from ..format.store import is_cache

    if output is not None and is_url(output):
        from . import objects

        objects.check_writable(output)
        if single and not output.endswith("/"):
            return lambda entry: objects.RemoteTarget(output)
        return lambda entry: objects.RemoteTarget(objects.join(output, cache_name(entry)))
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
            from . import objects

            return objects.read_document(entry, encoding)
        return documents.read(entry, encoding)

    return read
