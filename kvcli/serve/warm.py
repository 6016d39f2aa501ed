"""What a server keeps warm: loaded models and restored caches (Sessions), in an LRU bounded by memory.

Used by the unix-socket server (server.py) and meant for any other front end (an HTTP server):

    warm = Warm(max_memory=8 << 30)
    with warm.session(SessionSpec(("doc.kv",))) as lease:   # loads the model and restores the cache once
        answer = lease.ask("Who signed it?", GenerationOptions(max_new_tokens=64))
    with warm.model(ModelSpec()) as held:                  # the model alone (prefill: chunks take the engine's turn)
        prefill(held.lm, ...)
    warm.status()                                       # what `kvcli ps` shows

Every question on a model runs through that model's one engine (engine/scheduling/scheduler.py): rows of one
document decode together, at most `batch_size` at once, joining between steps; documents sharing a model are
stepped in turn, and a prefill's chunks take turns with those steps. A cache directory replaced since it was
restored (directory or manifest identity changed) is restored again, never answered from the old copy. Entries
in use are never evicted; the rest go least recently used first, and an evicted model's engine is closed.
Any number of front ends (the unix socket, HTTP) share one Warm: one LRU, one staleness rule, one memory account:
the bytes held now, measured (a cache's buffers with their spare room, grown by rows decoded one at a time, and
the suffix buffers of the batch answering it), not the figure taken at restore; measured again, and entries not
in use evicted to fit, whenever a question starts, an answer completes or a request ends.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from . import memory
from .loading import LoadTurns
from ..requests import ModelSpec, SessionSpec

Note = Callable[[str], None]
DEFAULT_MAX_QUEUE = 32  # requests waiting per model, beyond those decoding, before more are refused (EngineBusy)


@dataclass
class _Entry:
    key: str
    kind: str  # "model" or "cache"
    obj: Any  # LoadedModel or Session
    nbytes: int
    info: dict[str, Any]
    identity: tuple = ()  # caches: what says the directory (and each base of a chain) is still the one restored
    links: tuple = ()  # caches: the folders of the chain below it (prefill --after), checked as the cache is
    model_key: str = ""  # caches: the model entry they were restored against
    users: int = 0
    answers: int = 0  # questions answered from it (a model: from any of its caches)
    prefills: int = 0  # models: documents prefilled with it
    loaded_at: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.time)
    measure: Callable[[], int] | None = None  # caches: the bytes held now (buffers grow while answering)
    engine: Any = None  # models: the model's one engine (engine/scheduling/scheduler.py)

    def size(self) -> int:
        if self.measure is not None:
            try:
                self.nbytes = self.measure()
            except Exception:  # a buffer swapped mid-measure: the last figure stands until the next one
                pass
        return self.nbytes


class Lease:
    """A warm Session lent to one request; its questions join the model's engine with everyone else's."""

    def __init__(self, warm: "Warm", entry: _Entry, model_entry: _Entry):
        self._warm, self._entry, self._model = warm, entry, model_entry
        self.session = entry.obj

    @property
    def warnings(self) -> list[str]:
        return self.session.warnings

    @property
    def formats(self) -> list[str]:
        return self.session.formats

    @property
    def token_ids(self) -> list[int]:
        return self.session.token_ids

    def check_prompt(self, question: str, history: Any = (), options: Any = None) -> tuple[list[int], int]:
        return self.session.check_prompt(question, history, options)

    def submit(self, questions: list[str], options: Any = None, **kw: Any):
        """Session.submit, with each answer counted and the memory account fitted as it completes."""
        def answered(_i: int, _a: Any) -> None:
            self._warm._served("answers", self._entry, self._model)
            self._warm.fit()  # the account as held now (suffix buffers and grown caches counted): others go if over

        self._warm.fit()
        request = self.session.submit(questions, options, **kw)
        request.on_answer(answered)
        return request

    def ask(self, question: str, options: Any = None, on_text: Callable[[str], None] | None = None, history: Any = ()):
        """One question (after the conversation `history`, if any), read here."""
        return self.submit([question], options, history=history).result((lambda _i, t: on_text(t)) if on_text else None)[0]


class HeldModel:
    """A warm LoadedModel lent to one request (prefill, whose chunks take the model engine's turn)."""

    def __init__(self, warm: "Warm", entry: _Entry):
        self._warm, self._entry = warm, entry
        self.lm = entry.obj

    def served(self) -> None:
        """One document prefilled with this model."""
        self._warm._served("prefills", self._entry)


class Warm:
    """Loaded models and restored caches, least recently used first out when over max_memory bytes."""

    def __init__(self, max_memory: int | None = None, batch_size: int | None = None, host_memory: int | None = None,
                 max_queue: int = DEFAULT_MAX_QUEUE):
        from ..engine.answer import DEFAULT_BATCH

        self.max_memory = max_memory or memory.default_max_memory()
        if host_memory is not None:  # a GPU server: caches pushed out of device memory kept in pinned host memory
            from ..engine.cache import tiers

            tiers.HOST.limit = host_memory
        self.batch_size = batch_size or DEFAULT_BATCH  # questions on one document decoded together
        self.max_queue = max_queue  # each model's engine admits this many requests beyond those decoding
        self._entries: dict[str, _Entry] = {}  # insertion order = use order (moved to the end on use)
        self._alias: dict[str, str] = {}  # requested model key -> the key of what was loaded
        self._mutex = threading.RLock()
        self._turns = LoadTurns()  # one loader per model or cache; requests waiting for a restore bounded
        self.reloads = 0  # caches restored again because their directory was replaced
        self._counters = {"answers": 0, "prefills": 0, "http_requests": 0}

    # ---- public API
    @contextmanager
    def session(self, spec: SessionSpec, *, progress: Note | None = None) -> Iterator[Lease]:
        """Lend the Session for `spec` (opened now by engine.answer.open_session if not held, or replaced since).
        A blend is held as one entry, opened again when any of its caches is replaced."""
        spec = replace(spec, caches=tuple(os.path.abspath(c) for c in spec.caches))
        paths = tuple(Path(c) for c in spec.caches) if spec.blend else Path(spec.caches[0])
        entry = self._fresh_cache(spec.key, paths)
        if entry is None:
            with self._turns.turn(spec.key, bound=self.batch_size + self.max_queue):
                entry = self._fresh_cache(spec.key, paths) or self._restore(spec, paths, progress)
        try:
            with self._mutex:
                model_entry = self._entries[entry.model_key]
                model_entry.users += 1
            try:
                yield Lease(self, entry, model_entry)
            finally:
                with self._mutex:
                    model_entry.users -= 1
        finally:
            self._release(entry)

    @contextmanager
    def model(self, model: ModelSpec, *, progress: Note | None = None) -> Iterator[HeldModel]:
        """Lend a loaded model (loaded now if not held), as models.load(model, ...) would load it."""
        entry = self._held_model(model, progress)
        try:
            yield HeldModel(self, entry)
        finally:
            self._release(entry)

    def status(self) -> dict[str, Any]:
        """Models and caches held: bytes, last use, answers given, and the counters (JSON-ready)."""
        with self._mutex:
            entries = list(self._entries.values())
        rows = {"models": [], "caches": []}
        for e in reversed(entries):  # most recently used first
            row = {**e.info, "bytes": e.size(), "loaded_at": e.loaded_at, "last_used": e.last_used, "answers": e.answers, "in_use": e.users}
            if e.kind == "model":
                row["prefills"] = e.prefills
            model = e if e.kind == "model" else self._entries.get(e.model_key)
            engine = model.engine if model is not None else None
            width = 1 if engine is not None and engine.mode == "one at a time" else (engine.width if engine else None) or self.batch_size
            if e.kind == "model":
                row["decoding"] = engine.mode if engine is not None else "idle"
                row["decoding_why"] = engine.why if engine is not None else ""  # the batching probe's reason
                row["engine"] = {"width": width, "asked": engine.asked, "steps": engine.steps,
                                 "peak_rows": engine.peak_rows} if engine is not None else None
            else:
                row["batch"] = {"width": width, **e.obj.stats}
            rows["models" if e.kind == "model" else "caches"].append(row)
        tiers = sys.modules.get("kvcli.engine.cache.tiers")
        host = {"host_tier": tiers.HOST.report()} if tiers is not None and tiers.HOST.limit else {}
        return {"max_memory": self.max_memory, "bytes": sum(e.nbytes for e in entries), "reloads": self.reloads, **self.counters(), **rows, **host}

    def counters(self) -> dict[str, int]:
        """What every front end did with this Warm: `answers` (questions answered: the sum of the cache rows'
        answers while they are held), `prefills` (documents prefilled), `http_requests` (HTTP requests that
        opened a cache)."""
        with self._mutex:
            return dict(self._counters)

    def count(self, name: str) -> None:
        with self._mutex:
            self._counters[name] = self._counters.get(name, 0) + 1

    def fit(self) -> None:
        """Measure what is held now and evict least recently used entries not in use until it fits max_memory."""
        with self._mutex:
            self._evict()

    def clear(self) -> None:
        """Drop everything not in use."""
        with self._mutex:
            self._evict(limit=0)

    @property
    def busy(self) -> bool:
        """Whether any request holds a model or cache, or any engine has work or a request not yet read to its end
        (for the idle timeout: an answer still streaming to its client is use)."""
        with self._mutex:
            entries = list(self._entries.values())
        return any(e.users > 0 for e in entries) or any(e.engine.in_use for e in entries if e.kind == "model")

    def close(self) -> None:
        """Stop every model's engine: requests still waiting or decoding end with EngineClosed."""
        from ..engine.scheduling.scheduler import close_engine

        with self._mutex:
            models = [e.obj for e in self._entries.values() if e.kind == "model"]
        for lm in models:
            close_engine(lm)

    # ---- internals
    def _take(self, key: str) -> _Entry | None:
        with self._mutex:
            entry = self._entries.get(key)
            if entry is not None:
                entry.users += 1
                entry.last_used = time.time()
                self._entries[key] = self._entries.pop(key)  # most recently used last
            return entry

    def _release(self, entry: _Entry) -> None:
        with self._mutex:
            entry.users -= 1
            entry.last_used = time.time()
            self._evict()

    def _served(self, what: str, *entries: _Entry) -> None:
        with self._mutex:
            self._counters[what] += 1
            for e in entries:
                setattr(e, what, getattr(e, what) + 1)
                e.last_used = time.time()

    def _fresh_cache(self, key: str, path: Path | tuple) -> _Entry | None:
        """The held Session for this request if its directory (each, for a blend) is still the one restored."""
        try:
            now = _identity(path)
        except OSError:
            now = None
        with self._mutex:
            entry = self._entries.get(key)
            if entry is None:
                return None
            if now is not None:
                now = (now, *(_identity_or_none(p) for p in entry.links))
            if entry.identity != now or entry.model_key not in self._entries:
                if entry.users == 0:
                    self._drop(key)
                else:  # still answering someone from the old copy: forget it, it goes when they finish
                    self._entries.pop(key)
                self.reloads += 1
                return None
        return self._take(key)

    def _restore(self, spec: SessionSpec, path: Path | tuple, progress: Note | None) -> _Entry:
        from ..engine import answer as an

        try:
            identity = _identity(path)  # taken before reading: a replace after this is caught next time
        except OSError:
            identity = ()
        lent: list[_Entry] = []

        @contextmanager
        def lend(model: ModelSpec):
            lent.append(self._held_model(model, progress, resolved=True))
            yield lent[0].obj

        try:
            session = an.open_session(spec, lend)
            model_entry = lent[0]
            info = {"path": " + ".join(spec.caches), "model": model_entry.info["name"], "num_tokens": session.num_tokens,
                    "dtype": session.manifest.dtype, "load_s": round(session.load_s, 4)}
            identity = (identity, *(_identity_or_none(p) for p in session.links))
            entry = _Entry(spec.key, "cache", session, session.nbytes(), info, identity=identity, links=session.links,
                           model_key=model_entry.key, users=1, measure=session.nbytes)
            with self._mutex:
                self._entries[spec.key] = entry
                self._evict()
            return entry
        finally:
            for e in lent:
                self._release(e)

    def _held_model(self, model: ModelSpec, progress: Note | None, *, resolved: bool = False) -> _Entry:
        """The model's entry, taken for one user (loaded now if not held). resolved: the spec's source is a source
        record (engine.answer.model_for_cache), else --model as given."""
        key = model.key
        entry = self._take(self._alias.get(key, key))
        if entry is None:
            with self._turns.turn(key):
                entry = self._take(self._alias.get(key, key)) or self._load_model(key, model, progress, resolved=resolved)
        return entry

    def _load_model(self, key: str, model: ModelSpec, progress: Note | None, *, resolved: bool) -> _Entry:
        """Load a model and hold it under its canonical key (the source, the device and the dtype it got)."""
        from ..engine import answer as an
        from ..engine.model import models
        from ..engine.scheduling.scheduler import engine_for
        from ..format.codec import dtype_name

        if not resolved:
            source = models.resolve(model.source, revision=model.revision)
            if model.weights is not None:  # else the source's default (models.default_weights)
                source["weights"] = model.weights  # models.load checks it
            model = model.resolved(source, model.dtype)
        lm = an.load_model(model, progress)
        engine = engine_for(lm, width=self.batch_size)  # rows per document on this model: the server's --batch-size
        engine.max_queue = self.max_queue
        canonical = ModelSpec(lm.source, None, model.device, dtype_name(lm.dtype), model.trust_remote_code).key
        with self._mutex:
            self._alias[key] = canonical
            existing = self._entries.get(canonical)
            if existing is not None:  # loaded meanwhile under another spelling: keep the first, drop ours
                existing.users += 1
                return existing
            info = {"name": lm.source.get("name") or lm.fingerprint.get("name"), "source": lm.source.get("kind"),
                    "dtype": dtype_name(lm.dtype), "device": str(lm.device), "weights": lm.weights}
            entry = _Entry(canonical, "model", lm, memory.model_bytes(lm), info, users=1, engine=engine)
            self._entries[canonical] = entry
            self._evict()
            return entry

    def _evict(self, limit: int | None = None) -> None:
        """Drop least recently used entries not in use until the total fits (caller holds the mutex)."""
        limit = self.max_memory if limit is None else limit
        total = sum(e.size() for e in self._entries.values())
        models = 0
        for key in list(self._entries):
            if total <= limit:
                break
            e = self._entries.get(key)
            if e is None or e.users > 0 or e.kind == "model" and (e.engine.in_use or any(
                    c.model_key == key and c.users > 0 for c in self._entries.values() if c.kind == "cache")):
                continue
            models += e.kind == "model"
            total -= self._drop(key)
        if models:
            memory.give_back()  # a model's memory back to the system, not kept in this process's heap

    def _drop(self, key: str) -> int:
        """Forget an entry (a model takes the caches restored against it along, and closes its engine: its thread
        ends and nothing holds the model any more); returns the bytes freed."""
        e = self._entries.pop(key, None)
        if e is None:
            return 0
        freed = e.nbytes
        restore = sys.modules.get("kvcli.engine.cache.restore")  # imported by a restore, never here (ps needs no torch)
        if e.kind == "cache" and restore is not None:  # on a GPU with a host tier, its document is kept there
            restore.leaving(e.obj)
        if e.kind == "model":
            from ..engine.scheduling.scheduler import close_engine

            for ck in [k for k, c in self._entries.items() if c.kind == "cache" and c.model_key == key and c.users == 0]:
                freed += self._entries.pop(ck).nbytes
            close_engine(e.obj)  # idle (never dropped in use): its thread ends at once
        return freed


def _identity(path: Path | tuple) -> tuple:
    """memory.identity of a cache, or of each cache of a blend."""
    return tuple(memory.identity(p) for p in path) if isinstance(path, tuple) else memory.identity(path)


def _identity_or_none(path: Path) -> tuple | None:
    try:
        return memory.identity(path)
    except OSError:
        return None
