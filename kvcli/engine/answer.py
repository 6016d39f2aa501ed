"""A cache opened against a loaded model (Session), ready for questions from any thread.

Each question starts from the document's own cache state, never from the previous question's: its ids
are appended after the document in rows the model's engine owns (engine/scheduling/scheduler.py), and the
document's keys/values are never written.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ..format import store
from .cache import restore
from .model import fit
from .prompt import conversation, framing as fr
from .model.models import LoadedModel
from .decoding.batch import eos_ids
from .decoding.request import DEFAULT_BATCH, DEFAULT_MAX_NEW_TOKENS, Answer, GenerationOptions, prompt_room  # noqa: F401  (the API's names)

TokenFn = Callable[[str], None]  # receives answer text as it becomes final


class Session:
    """One cache opened against one loaded model, ready for any number of questions, from any thread."""

    def __init__(self, lm: LoadedModel, cache: str | os.PathLike | store.OpenedCache, *, convert_dtype: bool = False):
        """cache: a folder, or a cache already opened (ModelPool.session, the warm server), whose shards this
        restores and then closes."""
        t0 = time.perf_counter()
        self.lm = lm
        opened = cache if isinstance(cache, store.OpenedCache) else store.open_cache(cache)
        self.path = opened.path
        with opened:
            self.manifest = opened.manifest
            fit.check_fits(self.manifest, lm, str(self.path), convert_dtype=convert_dtype)
            # the document (rows decoded one at a time grow it, then rewind)
            self.cache = restore.load_cache(opened, device=lm.device, dtype=lm.dtype)
        self.framing = fr.Framing.from_record(self.manifest.framing)
        self.warnings = (_version_warnings(self.manifest, self.path) + _provenance_warnings(self.manifest, lm, self.path)
                         + _dtype_warnings(self.manifest, lm, self.path))
        from .scheduling.scheduler import engine_for

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
        return self.manifest.token_ids

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
               check: bool = False, history: Sequence[conversation.Exchange] = (), prompts: Sequence[list[int]] | None = None,
               served: Callable[[int, Answer], None] | None = None):
        """Submit questions to the model's engine; returns the Request (engine/scheduling/scheduler.py) to iterate
        for events (Text, Answered, then Done or Failed) and to cancel(). Each decoding step runs every running
        question of this document (and of any other asker) in one forward pass (engine/decoding/batch.py).
        batch_size: at most this many of these questions decode at once (1: one by one). check=True measures
        every answer against a full recompute (Answer.check, engine/check.py; it costs a recompute of the
        document). history: earlier (question, answer) exchanges, appended after the document before each
        question (engine/prompt/conversation.py). prompts: the questions' prompt ids when already tokenized (check_prompt)."""
        from .scheduling.scheduler import engine_for

        return engine_for(self.lm).submit(self, questions, options or GenerationOptions(), history=history, limit=batch_size,
                                          check=check, prompts=prompts, served=served)

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


class ModelPool:
    """Loads each model once for many caches: the --model one, else the model each cache records."""

    def __init__(self, model: str | None = None, *, revision: str | None = None, device: str = "auto",
                 dtype: str | None = None, trust_remote_code: bool = False, progress: Callable[[str], None] | None = None):
        self.spec, self.revision, self.device, self.dtype = model, revision, device, dtype
        self.trust_remote_code, self.progress = trust_remote_code, progress
        self._loaded: dict[str, LoadedModel] = {}

    def session(self, path: str | os.PathLike, *, where: str | None = None, convert_dtype: bool = False) -> Session:
        """The Session for one request's cache: its manifest read and checked against the request once (a
        refusal loads nothing), the model it needs loaded, its shards opened once and restored. where: the
        cache as messages name it."""
        with store.open_cache(path) as opened:
            fit.check_request(opened.manifest, where or str(path), dtype=self.dtype, convert_dtype=convert_dtype)
            return Session(self.for_manifest(opened.manifest), opened, convert_dtype=convert_dtype)

    def fits(self, manifest, where: str, *, convert_dtype: bool = False) -> None:
        """Refuse (CacheMismatchError) a cache, by its manifest alone, that the model it would be answered
        with does not fit: a remote cache is checked this way before any shard is fetched."""
        fit.check_fits(manifest, self.for_manifest(manifest), where, convert_dtype=convert_dtype)

    def for_manifest(self, manifest) -> LoadedModel:
        import json

        from .model import models

        dtype = self.dtype or manifest.dtype
        source = models.cache_source(self.spec, manifest.model.get("source", {}), revision=self.revision)
        key = json.dumps([source, dtype], sort_keys=True)
        if key not in self._loaded:
            self._loaded[key] = models.load(source=source, device=self.device, dtype=dtype,
                                            trust_remote_code=self.trust_remote_code, progress=self.progress)
        return self._loaded[key]


def ask(lm: LoadedModel, cache: str | os.PathLike, questions: Sequence[str], options: GenerationOptions | None = None,
        *, check: bool = False) -> list[Answer]:
    """Convenience: open a cache and answer several questions from it (check: see Session.ask)."""
    session = Session(lm, cache)
    return [session.ask(q, options, check=check) for q in questions]
