"""The caches the HTTP server offers as models, and the open Sessions that answer them.

`Provider` is what the HTTP app needs: list the caches, and open one by id as a Session plus the lock
that serializes generation on its model (Session.ask is not assumed thread-safe; the model, its seed
and its counters are shared). `DocsProvider` is the standalone one: caches found under folders the way
`kvcli ls` finds them, models loaded once each, a few Sessions kept open (least recently used goes first),
and a cache replaced on disk since it was opened is opened again, never answered from the old copy.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


def _nothing() -> None:
    pass


@dataclass
class Opened:
    """A Session lent to one request: ask() takes the model's turn; release() gives the session back."""

    session: Any  # kvcli.engine.answer.Session
    lock: Any  # a lock (context manager) held while generating on the session's model
    release: Callable[[], None] = _nothing  # called once when the request is done with the session
    asker: Callable[..., Any] | None = None  # a provider's own turn-taking ask (e.g. a warm Lease's)
    concurrency: int = 1  # requests that may ask at once (a warm Lease decodes that many together)

    def ask(self, question: str, options: Any, on_text: Any = None, *, history: Sequence[tuple[str, str]] = (),
            cancelled: Callable[[], bool] = lambda: False):
        """Session.ask under the model's turn; `Cancelled` if the asker left before its turn came."""
        if self.asker is not None:
            return self.asker(question, options, on_text, history=history, cancelled=cancelled)
        with self.lock:
            if cancelled():
                raise Cancelled()
            return self.session.ask(question, options, on_text, history=history)


class Cancelled(Exception):
    """The request went away before its turn: nothing was generated."""


class Provider(Protocol):
    def models(self) -> list[tuple[str, dict[str, Any]]]:
        """(id, catalog row) for every cache offered; a broken cache's row has "error"."""

    def open(self, model_id: str) -> Opened | None:
        """The Session for that id (None if there is no such cache); raises CacheError if it does not fit.

        The caller calls `release()` on the result once, when it no longer uses the session."""


def catalog_ids(folders: Sequence[Path]) -> list[tuple[str, dict[str, Any]]]:
    """(id, row) for every cache under the folders: id = path relative to its folder (the first folder wins)."""
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
    return list(seen.items())


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


def _identity(path: Path) -> tuple:
    st = os.stat(path)
    return st.st_dev, st.st_ino


class DocsProvider:
    """Caches under `folders`, answered by models loaded through a ModelPool; at most `max_sessions` kept open.
    Concurrent questions on one cache decode together, up to `batch_size` (engine/joining.py)."""

    def __init__(self, folders: Sequence[str | os.PathLike], *, pool: Any = None, model: str | None = None,
                 device: str = "auto", dtype: str | None = None, max_sessions: int = 4, batch_size: int = 8):
        self.folders = [Path(f) for f in folders]
        self._pool, self._pool_args = pool, dict(model=model, device=device, dtype=dtype)
        self.max_sessions, self.batch_size = max_sessions, batch_size
        self._sessions: OrderedDict[str, tuple[tuple, Any, Any]] = OrderedDict()  # path -> (stamp, session, batcher)
        self._locks: dict[int, threading.Lock] = {}
        self._loading = threading.Lock()  # one load at a time: two requests for a new cache load it once

    def models(self) -> list[tuple[str, dict[str, Any]]]:
        return catalog_ids(self.folders)

    def open(self, model_id: str) -> Opened | None:
        from ..format import store

        path = resolve(self.folders, model_id)
        if path is None:
            return None
        with self._loading:
            manifest = store.read_manifest(path)  # CacheError (exit 3's message) if it is broken now
            stamp = (_identity(path), manifest.to_json()["manifest_sha256"])
            held = self._sessions.get(str(path))
            if held is None or held[0] != stamp:
                session = self._new_session(path)
                lock = self._locks.setdefault(id(session.lm), threading.Lock())
                self._sessions[str(path)] = (stamp, session, self._batcher(session, lock))
                while len(self._sessions) > self.max_sessions:
                    self._sessions.popitem(last=False)
            self._sessions.move_to_end(str(path))
            _stamp, session, batcher = self._sessions[str(path)]
            lock = self._locks[id(session.lm)]
        if batcher is None:
            return Opened(session=session, lock=lock)
        return Opened(session=session, lock=lock, asker=_batched(batcher), concurrency=batcher.width)

    def _batcher(self, session: Any, lock: threading.Lock) -> Any:
        from ..engine import attention
        from ..engine.joining import Batcher

        if self.batch_size <= 1 or not attention.batchable(session.lm.model):
            return None
        return Batcher(session, width=self.batch_size, turn=lambda: lock)

    def _new_session(self, path: Path):
        from ..engine import answer

        if self._pool is None:
            self._pool = answer.ModelPool(**self._pool_args)
        return answer.Session(self._pool.for_cache(path), path)


def _batched(batcher: Any) -> Callable[..., Any]:
    """Opened.ask through a Batcher: Left (the asker went away) becomes Cancelled."""
    from ..engine.joining import Left

    def ask(question: str, options: Any, on_text: Any = None, *, history=(), cancelled=lambda: False):
        try:
            return batcher.ask(question, options, on_text, history=history, cancelled=cancelled)
        except Left:
            raise Cancelled() from None

    return ask


class WarmProvider:
    """Caches under `folders`, answered from a warm server's LRU (serve/warm.py: `warm.session(path)`
    lends a Lease with the model's FIFO turn), shared with the unix-socket clients."""

    def __init__(self, warm: Any, folders: Sequence[str | os.PathLike], *, on_use: Callable[[], None] = _nothing):
        self.warm, self.folders, self.on_use = warm, [Path(f) for f in folders], on_use  # on_use: activity (idle timeout)

    def models(self) -> list[tuple[str, dict[str, Any]]]:
        return catalog_ids(self.folders)

    def open(self, model_id: str) -> Opened | None:
        path = resolve(self.folders, model_id)
        if path is None:
            return None
        self.on_use()
        held = self.warm.session(path)
        lease = held.__enter__()  # CacheError here: nothing is held

        def release() -> None:
            held.__exit__(None, None, None)
            self.on_use()

        return Opened(session=lease.session, lock=lease.lock, release=release, asker=lease.ask, concurrency=lease.concurrency)
