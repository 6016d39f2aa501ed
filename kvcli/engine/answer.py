"""A cache opened against a loaded model (Session), ready for questions from any thread.

Each question starts from the document's own cache state, never from the previous question's: its ids
are appended after the document in rows the model's engine owns (engine/scheduling/scheduler.py), and the
document's keys/values are never written.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..requests import ModelSpec, SessionSpec
from ..format import store
from .cache import restore
from .model import fit
from .prompt import conversation, framing as fr
from .model.models import LoadedModel
from .decoding.batch import eos_ids
from .decoding.request import DEFAULT_BATCH, DEFAULT_MAX_NEW_TOKENS, Answer, GenerationOptions, prompt_room  # noqa: F401  (the API's names)

TokenFn = Callable[[str], None]  # receives answer text as it becomes final
CacheArg = str | os.PathLike | store.OpenedCache


class Session:
    """One cache opened against one loaded model, ready for any number of questions, from any thread."""

    def __init__(self, lm: LoadedModel, cache: CacheArg | Sequence[CacheArg], *, convert_dtype: bool = False,
                 blend: float | None = None):
        """cache: a folder, or a cache already opened (ModelPool.session, the warm server), whose shards this
        restores and then closes. blend=FRACTION with several caches: one prompt of their documents in order
        (engine/cache/blend.py; approximate, `blended` says how), FRACTION of each later document recomputed."""
        from contextlib import ExitStack

        t0 = time.perf_counter()
        self.lm = lm
        caches = list(cache) if isinstance(cache, (list, tuple)) else [cache]
        if blend is None and len(caches) != 1:
            raise UsageError("several caches make one prompt only when blended (blend=FRACTION, --blend)")
        self.blended: dict | None = None  # with blend: {documents, recompute, recomputed_tokens, moved_tokens, caches}
        with ExitStack() as held:
            opened = [held.enter_context(c if isinstance(c, store.OpenedCache) else store.open_cache(c)) for c in caches]
            self.path = opened[0].path
            self.manifest = opened[0].manifest
            for o in opened:
                _not_sectioned(o, blended=blend is not None)
            for o in opened:
                fit.check_fits(o.manifest, lm, str(o.path), convert_dtype=convert_dtype)
            if blend is None:
                # the document (rows decoded one at a time grow it, then rewind)
                self.cache = restore.load_cache(opened[0], device=lm.device, dtype=lm.dtype)
                self._token_ids = self.manifest.token_ids
                self.framing = fr.Framing.from_record(self.manifest.framing)
                self.storage = self.manifest.storage
            else:
                from .cache import blend as bl

                made = bl.compose(lm, opened, blend)
                self.cache, self._token_ids, self.framing, self.storage = made.cache, made.token_ids, made.framing, made.storage
                self.blended = made.record()
        self.links = tuple(link.path for o in opened for link in o.chain()[:-1])  # the bases of each cache (prefill --after)
        self.warnings = [w for o in opened for w in cache_warnings(o.manifest, lm, o.path)]
        self.formats = [o.manifest.document.get("format", "text") for o in opened]  # each document's format, for records
        if self.blended is not None:
            self.warnings.append(f"{' + '.join(str(o.path) for o in opened)}: {len(opened)} caches blended into one prompt, "
                                 f"{self.blended['recompute']:g} of each later document recomputed: answers are approximate "
                                 "(--check measures them against a full recompute)")
        self._ready(t0)

    @classmethod
    def composed(cls, lm: LoadedModel, path: Path, manifest, made, *, blended: dict, warnings: Sequence[str] = (),
                 started: float | None = None) -> "Session":
        """A Session over a prompt composed elsewhere (engine/sections/compose.py: chosen sections of a sectioned
        cache): made.cache, made.token_ids, made.framing; `blended` says how it is approximate. started: when the
        composing began (its time is the first question's, as a restore's is)."""
        self = cls.__new__(cls)
        self.lm, self.path, self.manifest = lm, path, manifest
        self.cache, self._token_ids, self.framing, self.storage = made.cache, made.token_ids, made.framing, manifest.storage
        self.blended, self.warnings, self.links = blended, list(warnings), ()
        self.formats = [manifest.document.get("format", "text")]
        self._ready(time.perf_counter() if started is None else started)
        return self

    def _ready(self, t0: float) -> None:
        from .scheduling.scheduler import engine_for

        lm = self.lm
        engine_for(lm).batched  # noqa: B018  decided now (the probe, once per model), not inside the first question
        self.load_s = time.perf_counter() - t0
        self._unreported_load = self.load_s
        self._clock_lock = threading.Lock()
        self.eos = eos_ids(lm.model)
        self.stats = {"asked": 0, "steps": 0, "peak_rows": 0}  # kept by the engine: questions, forward passes, widest step

    def nbytes(self) -> int:
        """Memory this Session holds now: its cache's buffers (grown by rows decoded one at a time) and the
        suffix buffers of the batch answering it (engine/cache/shared.py), measured, not estimated."""
        from .scheduling.scheduler import engine_for

        return self.cache.nbytes() + engine_for(self.lm).suffix_bytes(self)

    @property
    def token_ids(self) -> list[int]:
        """The cached prompt's ids: the document's, or the blended documents' composed prompt."""
        return self._token_ids

    @property
    def num_tokens(self) -> int:
        """The cached prompt's length in tokens."""
        return len(self._token_ids)

    @property
    def states(self):
        """The document's state of every layer (read-only views of the Session's buffers)."""
        return self.cache.states()

    def prompt_ids(self, question: str, history: Sequence[conversation.Exchange] = ()) -> list[int]:
        return self.token_ids + conversation.appended_ids(self.lm.tokenizer, self.framing, history, question, self.token_ids)

    def check_prompt(self, question: str, history: Sequence[conversation.Exchange] = (),
                     options: GenerationOptions | None = None) -> tuple[list[int], int]:
        """This question's prompt ids and the answer tokens they leave room for (--max-new-tokens within the
        model's positions); PromptTooLongError when they leave none, before the question is asked."""
        ids = self.prompt_ids(question, history)
        return ids, prompt_room(self.lm, ids, options or GenerationOptions())

    def clock(self) -> float:
        """When a question starts, for its timings: now, less the cache's load while no question has paid for it."""
        with self._clock_lock:
            start = time.perf_counter() - self._unreported_load
            self._unreported_load = 0.0
        return start

    def submit(self, questions: Sequence[str], options: GenerationOptions | None = None, *, batch_size: int | None = None,
               check: bool = False, history: Sequence[conversation.Exchange] = (), prompts: Sequence[list[int]] | None = None):
        """Submit questions to the model's engine; returns the Request (engine/scheduling/scheduler.py) to iterate
        for events (Text, Answered, then Done or Failed) and to cancel(). Each decoding step runs every running
        question of this document (and of any other asker) in one forward pass (engine/decoding/batch.py).
        batch_size: at most this many of these questions decode at once (1: one by one). check=True measures
        every answer against a full recompute (Answer.check, engine/check.py; it costs a recompute of the
        document). history: earlier (question, answer) exchanges, appended after the document before each
        question (engine/prompt/conversation.py). prompts: the questions' prompt ids when already tokenized (check_prompt)."""
        from .scheduling.scheduler import engine_for

        return engine_for(self.lm).submit(self, questions, options or GenerationOptions(), history=history, limit=batch_size,
                                          check=check, prompts=prompts)

    def ask(self, question: str, options: GenerationOptions | None = None, on_text: TokenFn | None = None,
            *, check: bool = False, history: Sequence[conversation.Exchange] = ()) -> Answer:
        """Answer one question (submit(), read here); on_text receives its text as it settles (raising there
        cancels it). Safe from several threads."""
        return self.ask_many([question], options, on_text=(lambda _i, t: on_text(t)) if on_text else None, check=check,
                             history=history)[0]

    def ask_many(self, questions: Sequence[str], options: GenerationOptions | None = None, *,
                 batch_size: int | None = None, on_text: Callable[[int, str], None] | None = None,
                 on_answer: Callable[[int, Answer], None] | None = None, check: bool = False,
                 history: Sequence[conversation.Exchange] = (), prompts: Sequence[list[int]] | None = None) -> list[Answer]:
        """Answer several questions together (submit(), read here): on_text(i, text) streams question i's text,
        on_answer(i, answer) hands each answer over as soon as it is complete. Greedy answers equal ask() alone
        and generate() on the full prompt."""
        return self.submit(questions, options, batch_size=batch_size, check=check, history=history,
                           prompts=prompts).result(on_text, on_answer)


def cache_warnings(manifest, lm: LoadedModel, path: Path) -> list[str]:
    """What a cache's answers may differ by: another transformers release, torch build or dtype."""
    from ..format import catalog

    changed = catalog.changed_source(path, manifest)  # the document beside the cache has other bytes now
    return ([changed] if changed else []) + _version_warnings(manifest, path) + _provenance_warnings(manifest, lm, path) \
        + _dtype_warnings(manifest, lm, path)


def _version_warnings(manifest, path: Path) -> list[str]:
    """A cache from another transformers release may hold keys/values computed by other model code."""
    import transformers

    built, now = manifest.transformers_version, transformers.__version__
    if built.split(".")[:2] != now.split(".")[:2]:
        return [f"{path}: built with transformers {built}, running {now}; if answers look off, rebuild the cache"]
    return []


def _dtype_warnings(manifest, lm: LoadedModel, path: Path) -> list[str]:
    """A cache computed in another dtype than the model now reading it (--convert-dtype): answers may differ."""
    built, now = manifest.model.get("dtype"), lm.fingerprint.get("dtype")
    if built and now and built != now:
        return [f"{path}: keys/values computed in {built}, converted to {now} for this model (--convert-dtype); "
                "answers may differ from the cache's own dtype"]
    return []


def _provenance_warnings(manifest, lm: LoadedModel, path: Path) -> list[str]:
    """Keys/values computed by another torch build, device or attention kernel: answers may differ at near-ties."""
    from .prefilling import provenance

    built = manifest.provenance
    if not built:
        return []
    now = provenance(lm)
    labels = {"torch_version": "torch", "device_type": "device", "attn_implementation": "attention"}
    diffs = [f"{labels[k]} {built[k]} (running {now[k]})" for k in labels if built.get(k) is not None and built[k] != now[k]]
    if not diffs:
        return []
    return [f"{path}: built with {', '.join(diffs)}; answers may differ where the top two logits nearly tie "
            "(--check measures it)"]


def model_for_cache(model: ModelSpec, manifest: Any) -> ModelSpec:
    """The model to answer a cache with: --model's (in the weights the cache was built with), else the one the
    cache records; in the request's dtype, else the cache's."""
    from .model import models

    source = models.cache_source(model.source, manifest.model.get("source", {}), revision=model.revision)
    return model.resolved(source, model.dtype or manifest.dtype)


def load_model(model: ModelSpec, progress: Callable[[str], None] | None = None) -> LoadedModel:
    """Load the model a resolved ModelSpec (model_for_cache) names."""
    from .model import models

    return models.load(source=dict(model.source), device=model.device, dtype=model.dtype,
                       trust_remote_code=model.trust_remote_code, progress=progress)


Lender = Callable[[ModelSpec], AbstractContextManager[LoadedModel]]  # a resolved ModelSpec -> a context lending its model


def open_session(spec: SessionSpec, lend: Lender, *, where: str | None = None) -> Session:
    """The Session for one request's cache (or blend), the one way every front end opens one: the manifests read
    and checked against the request (a refusal loads nothing), the model lent by `lend` (ModelPool.lend in
    process, the warm server's LRU), the shards opened once and restored. where: the cache as messages name it."""
    from contextlib import ExitStack

    paths = list(spec.caches)
    with ExitStack() as held:
        opened = [held.enter_context(store.open_cache(p)) for p in paths]
        for o, p in zip(opened, paths):
            fit.check_request(o.manifest, (where if len(paths) == 1 else None) or str(p), dtype=spec.model.dtype,
                              convert_dtype=spec.convert_dtype)
            if spec.blend is not None:  # refused before the model loads
                _not_sectioned(o, blended=True)
        with lend(model_for_cache(spec.model, opened[0].manifest)) as lm:
            if spec.blend is None and opened[0].manifest.sections is not None:
                return _sectioned(lm, opened[0], spec, held)
            return Session(lm, opened if spec.blend else opened[0], convert_dtype=spec.convert_dtype,
                           blend=spec.blend.recompute if spec.blend else None)


def _not_sectioned(opened: store.OpenedCache, *, blended: bool) -> None:
    """BlendError for a sectioned cache given as one of a blend's, or to a Session (SectionedSession answers it)."""
    from ..errors import BlendError

    if opened.manifest.sections is not None:
        how = "cannot be blended with others; ask it alone" if blended else \
            "is not one prompt; open it with open_session or ModelPool.session"
        raise BlendError(f"{opened.path}: a sectioned cache (a document longer than the window) makes a prompt per "
                         f"question and {how}")


def _sectioned(lm: LoadedModel, opened: store.OpenedCache, spec: SessionSpec, held: Any):
    """A sectioned cache's session (engine/sections/session.py), its sections chosen per question as spec.sections
    says; it holds the cache open (held lets go of it), its sections read per question."""
    from .sections.session import SectionedSession

    session = SectionedSession(lm, opened, spec.sections, session=Session, convert_dtype=spec.convert_dtype,
                               warnings=cache_warnings(opened.manifest, lm, opened.path))
    held.pop_all()
    return session


class ModelPool:
    """Loads each model once for many caches (in process): the request's model, else the model each cache records."""

    def __init__(self, model: ModelSpec | None = None, *, progress: Callable[[str], None] | None = None):
        self.model, self.progress = model or ModelSpec(), progress
        self._loaded: dict[str, LoadedModel] = {}

    @contextmanager
    def lend(self, model: ModelSpec) -> Iterator[LoadedModel]:
        """The loaded model a resolved spec names (loaded now the first time)."""
        if model.key not in self._loaded:
            self._loaded[model.key] = load_model(model, self.progress)
        yield self._loaded[model.key]

    def session(self, spec: SessionSpec, *, where: str | None = None) -> Session:
        """open_session with this pool's models."""
        return open_session(spec, self.lend, where=where)

    def fits(self, manifest, where: str, *, convert_dtype: bool = False) -> None:
        """Refuse (CacheMismatchError) a cache, by its manifest alone, that the model it would be answered
        with does not fit: a remote cache is checked this way before any shard is fetched."""
        fit.check_fits(manifest, self.for_manifest(manifest), where, convert_dtype=convert_dtype)

    def for_manifest(self, manifest) -> LoadedModel:
        with self.lend(model_for_cache(self.model, manifest)) as lm:
            return lm

    def close(self) -> None:
        """Close every loaded model's engine (its thread ends); the models go with the pool."""
        from .scheduling.scheduler import close_engine

        for lm in self._loaded.values():
            close_engine(lm)
        self._loaded.clear()


def ask(lm: LoadedModel, cache: str | os.PathLike | Sequence[str | os.PathLike], questions: Sequence[str],
        options: GenerationOptions | None = None, *, check: bool = False, blend: float | None = None) -> list[Answer]:
    """Convenience: open a cache and answer several questions from it (check: see Session.ask). blend=FRACTION
    with several caches: one prompt of their documents in order, blended (approximate; Session)."""
    session = Session(lm, cache, blend=blend)
    return [session.ask(q, options, check=check) for q in questions]
