"""The caches the HTTP server offers as models, and the open Sessions that answer them.

`Provider` is what the HTTP app needs: list the caches, and open one by id as a Session lent to one
request. `WarmProvider` lends them from a warm server's Warm (serve/warm.py), the one LRU, staleness
rule and memory account every front end shares; `DocsProvider` is the standalone one (`http.start`
without a socket server): a WarmProvider over a Warm of its own. Every question runs through its
model's engine (engine/scheduling/scheduler.py), whichever front end asks.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..errors import UsageError
from ..requests import Blend, ModelSpec, Sections, SessionSpec


class NotSectioned(UsageError):
    """A request chose the sections of a cache that has none (a cache of one prompt)."""


def _nothing() -> None:
    pass


@dataclass
class Opened:
    """A Session lent to one request, asked through `asker` (events.ask_events); release() gives it back."""

    session: Any  # kvcli.engine.answer.Session
    release: Callable[[], None] = _nothing  # called once when the request is done with the session
    lease: Any = None  # a warm server's Lease of the session (it counts the answers served), if lent by one

    @property
    def asker(self) -> Any:
        """What the request's questions are submitted to: the lease, else the Session itself."""
        return self.lease if self.lease is not None else self.session


class Provider(Protocol):
    def models(self) -> list[tuple[str, dict[str, Any]]]:
        """(id, catalog row) for every cache offered: those whose manifest is valid."""

    def open(self, model_id: str, sections: Sections | None = None) -> Opened | None:
        """The Session for that id (None if there is no such cache); raises CacheError if it does not fit.
        sections: a sectioned cache's choice of sections (NotSectioned for any other cache); the app passes it only
        when a request gives one.

        The caller calls `release()` on the result once, when it no longer uses the session."""

    def open_blend(self, model_ids: Sequence[str], blend: Blend) -> Opened | None:
        """The Session of these caches blended into one prompt (None if an id names no cache); as open()."""


def catalog_ids(folders: Sequence[Path]) -> list[tuple[str, dict[str, Any]]]:
    """(id, row) for every cache under the folders whose manifest is valid (a broken one would only answer 409):
    id = path relative to its folder (the first folder wins)."""
    from ..format import catalog

    seen: dict[str, dict[str, Any]] = {}
    for folder in folders:
        folder = Path(folder)
        if not folder.is_dir():
            continue
        for row in catalog.find(folder):
            path = Path(row["path"])
            model_id = path.name if path == folder else path.relative_to(folder).as_posix()
            seen.setdefault(model_id, row)
    return [(model_id, row) for model_id, row in seen.items() if "error" not in row]


def resolve(folders: Sequence[Path], model_id: str) -> Path | None:
    """The cache an id names, as catalog_ids lists it (a direct child of a folder, or the folder itself)."""
    from ..format import store

    if not model_id or "/" in model_id or "\\" in model_id or model_id in (".", ".."):
        return None
    for folder in folders:
        if store.is_cache(folder):
            if folder.name == model_id:
                return folder
        elif store.is_cache(folder / model_id):
            return folder / model_id
    return None


class WarmProvider:
    """Caches under `folders`, answered from a warm server's LRU (serve/warm.py: `warm.session(path)`
    lends a Lease), shared with the unix-socket clients. model/device/dtype: how sessions are opened
    (default: the model each cache records)."""

    def __init__(self, warm: Any, folders: Sequence[str | os.PathLike], *, on_use: Callable[[], None] = _nothing,
                 model: str | None = None, device: str = "auto", dtype: str | None = None):
        self.warm, self.folders, self.on_use = warm, [Path(f) for f in folders], on_use  # on_use: activity (idle timeout)
        self.model = ModelSpec(model, device=device, dtype=dtype)

    def models(self) -> list[tuple[str, dict[str, Any]]]:
        return catalog_ids(self.folders)

    def open(self, model_id: str, sections: Sections | None = None) -> Opened | None:
        from ..format.sections import is_sectioned

        path = resolve(self.folders, model_id)
        if path is None:
            return None
        if is_sectioned(path):  # its choice of sections as `kvcli ask` builds it
            sections = sections or Sections()  # the one warm entry a socket client's `ask` uses too
        elif sections is not None:
            raise NotSectioned(f"'{model_id}' is not a sectioned cache (a document longer than the window): sections "
                               "chooses the sections of one")
        return self._lend(path, sections=sections)

    def open_blend(self, model_ids: Sequence[str], blend: Blend) -> Opened | None:
        paths = [resolve(self.folders, i) for i in model_ids]
        if any(p is None for p in paths):
            return None
        return self._lend(tuple(paths), blend=blend)

    def _lend(self, path: Path | tuple, blend: Blend | None = None, sections: Sections | None = None) -> Opened:
        self.on_use()
        self.warm.count("http_requests")
        caches = tuple(str(p) for p in path) if isinstance(path, tuple) else (str(path),)
        held = self.warm.session(SessionSpec(caches, self.model, blend=blend, sections=sections))
        lease = held.__enter__()  # CacheError here: nothing is held

        def release() -> None:
            held.__exit__(None, None, None)
            self.on_use()

        return Opened(session=lease.session, release=release, lease=lease)


class DocsProvider(WarmProvider):
    """Caches under `folders` for a standalone HTTP server: a WarmProvider over its own Warm."""

    def __init__(self, folders: Sequence[str | os.PathLike], *, model: str | None = None, device: str = "auto",
                 dtype: str | None = None, max_memory: int | None = None, batch_size: int | None = None):
        from .warm import Warm

        super().__init__(Warm(max_memory, batch_size=batch_size), folders, model=model, device=device, dtype=dtype)
