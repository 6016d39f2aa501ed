"""Questions -> answers from a loaded cache: append only the question's ids, generate, stream.

Each question starts from the document's own cache state, never from the previous question's: the
Session's cache (engine/kvcache.py) is rewound to the document's length after every question, and
a question asked while another one holds it gets a private copy (pooled), so threads never share
writable memory.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import conversation, fit, framing as fr, restore

from ..format import store
from ..errors import GenerationError
from .check import Check
from .models import LoadedModel

DEFAULT_MAX_NEW_TOKENS = 256
DEFAULT_BATCH = 8  # questions decoded together by ask_many (README, "Many questions at once")
SPARE_CACHES = 2  # private copies of the document a Session keeps for concurrent questions
TokenFn = Callable[[str], None]  # receives answer text as it becomes final


@dataclass
class Answer:
    question: str
    answer: str
    prompt_token_ids: list[int]  # every id the model saw before answering: cached + appended
    answer_token_ids: list[int]
    cached_tokens: int
    new_tokens: int  # appended ids computed for this question
    processed_tokens: int  # ids the model actually ran forward for this question (appended + answer - 1)
    ttft_s: float | None
    total_s: float
    finish_reason: str  # "stop" (end of turn or stop string) or "length"
    cache: str = ""
    check: Check | None = None  # with ask(check=True): this answer measured against a full recompute
    history: list[dict[str, str]] = field(default_factory=list)  # earlier {question, answer} turns, oldest first

    def to_json(self) -> dict[str, Any]:
        """JSON of the answer; `check` appears only when measured, `history` only for a follow-up (so one
        line can be fed back)."""
        body = asdict(self)
        if self.check is None:
            del body["check"]
        if not body["history"]:
            del body["history"]
        return body


@dataclass
class GenerationOptions:
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: Sequence[str] = field(default_factory=tuple)
    # generate()'s own anti-repetition settings; like generate() they see every prompt id (document included).
    repetition_penalty: float = 1.0  # 1.0: off; >1 makes tokens already seen less likely
    no_repeat_ngram_size: int = 0  # 0: off; n>0 never repeats an n-gram of the prompt or answer


class _Stream:
    """A transformers streamer that decodes the answer so far and hands out only settled text.

    Text is held back while it could still become a stop string or ends in a partial character.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str], on_text: TokenFn | None):
        self.tokenizer, self.stop, self.on_text = tokenizer, list(stop), on_text
        self.ids: list[int] = []
        self.sent = 0
        self.stopped = False
        self.first_token_at: float | None = None
        self.prompt_seen = False

    def put(self, value) -> None:
        if not self.prompt_seen:  # generate() first hands over the prompt
            self.prompt_seen = True
            return
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.ids.extend(int(v) for v in value.reshape(-1).tolist())
        self._emit(final=False)

    def end(self) -> None:
        self._emit(final=True)

    def text(self) -> str:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for s in self.stop:
            at = text.find(s)
            if at >= 0:
                self.stopped = True
                text = text[:at]
        return text

    def _emit(self, final: bool) -> None:
        text = self.text()
        settled = len(text)
        if not final and not self.stopped:
            if text.endswith("\ufffd"):
                settled -= 1
            for s in self.stop:  # hold back a tail that may grow into a stop string
                for k in range(min(len(s) - 1, len(text)), 0, -1):
                    if text.endswith(s[:k]):
                        settled = min(settled, len(text) - k)
                        break
        if settled > self.sent and self.on_text:
            self.on_text(text[self.sent : settled])
        self.sent = max(self.sent, settled)


class Session:
    """One cache opened against one loaded model, ready for any number of questions, from any thread."""

    def __init__(self, lm: LoadedModel, path: str | os.PathLike, *, convert_dtype: bool = False):
        t0 = time.perf_counter()
        self.lm = lm
        self.path = Path(path)
        with store.open_cache(self.path) as opened:
            self.manifest = opened.manifest
            fit.check_fits(self.manifest, lm, str(self.path), convert_dtype=convert_dtype)
            self.cache = restore.load_cache(opened, device=lm.device, dtype=lm.dtype)  # the document: owned, never written
        self.framing = fr.Framing.from_record(self.manifest.framing)
        self.warnings = _version_warnings(self.manifest, self.path) + _provenance_warnings(self.manifest, lm, self.path)
        self.load_s = time.perf_counter() - t0
        self._unreported_load = self.load_s
        self._busy = threading.Lock()  # held by the question using self.cache
        self._spares_lock = threading.Lock()
        self._spares: list = []

    @property
    def token_ids(self) -> list[int]:
        return self.manifest.token_ids

    @property
    def states(self):
        """The document's state of every layer (read-only views of the Session's buffers)."""
        return self.cache.states()

    def prompt_ids(self, question: str, history: Sequence[conversation.Exchange] = ()) -> list[int]:
        return self.token_ids + conversation.appended_ids(self.lm.tokenizer, self.framing, history, question, self.token_ids)

    def answer_room(self, question: str, history: Sequence[conversation.Exchange] = ()) -> int | None:
        """Positions left for the answer after this question's prompt (None: the model sets no limit)."""
        limit = self.lm.max_positions
        return None if not limit else limit - len(self.prompt_ids(question, history))

    def clock(self) -> float:
        """When a question starts, for its timings: now, less the cache's load while no question has paid for it."""
        with self._spares_lock:
            start = time.perf_counter() - self._unreported_load
            self._unreported_load = 0.0
        return start

    @contextmanager
    def _checkout(self):
        """A cache at the document's length for one question: the Session's own when free, else a private copy."""
        if self._busy.acquire(blocking=False):
            try:
                yield self.cache
            finally:
                self.cache.rewind()
                self._busy.release()
            return
        with self._spares_lock:
            spare = self._spares.pop() if self._spares else None
        if spare is None:
            spare = self.cache.copy()  # reads only the document's tokens, which nobody writes
        try:
            yield spare
        finally:
            spare.rewind()
            with self._spares_lock:
                if len(self._spares) < SPARE_CACHES:
                    self._spares.append(spare)

    def ask(self, question: str, options: GenerationOptions | None = None, on_text: TokenFn | None = None,
            *, check: bool = False, history: Sequence[conversation.Exchange] = ()) -> Answer:
        """Answer one question; on_text receives the answer's text as it is generated (raising there abandons it).
        Safe from several threads.

        check=True also runs the prompt and answer through the model once without any cache and fills
        Answer.check (see engine/check.py): it costs a full recompute of the document.
        history: earlier (question, answer) exchanges of this conversation, appended after the document
        before the question (see conversation.py); the cached document is never recomputed."""
        import torch

        opts = options or GenerationOptions()
        start = self.clock()
        cached = len(self.token_ids)
        prompt = self.prompt_ids(question, history)
        max_new = prompt_room(self.lm, prompt, opts)
        model = self.lm.model
        stream = _Stream(self.lm.tokenizer, opts.stop, on_text)
        kwargs = generate_kwargs(self.lm, opts, max_new)
        if check:  # the raw logits of every answer step, before any processor: what --check compares
            kwargs.update(output_logits=True, return_dict_in_generate=True)
        input_ids = torch.tensor([prompt], device=self.lm.device)  # [1, cached + appended]
        with torch.inference_mode(), self._checkout() as cache:
            out = model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                cache=cache,
                streamer=stream,
                **kwargs,
            )
            processed = cache.processed  # tokens this call's forward passes ran (its own cache counted them)
        logits = None
        if check:
            logits = torch.cat(out.logits, dim=0) if out.logits else None  # [answer, vocab]
            out = out.sequences
        answer_ids = [int(t) for t in out[0, len(prompt) :].tolist()]
        text = stream.text()
        eos = model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
        done_by_stop = stream.stopped or (answer_ids and answer_ids[-1] in eos)
        total_s = time.perf_counter() - start  # the answer's own time: the check's recompute is not in it
        checked = None
        if check:
            from . import check as ck

            checked = ck.compare(self.lm, prompt, answer_ids, logits, storage=self.manifest.storage)
        return Answer(
            question=question,
            answer=text,
            prompt_token_ids=prompt,
            answer_token_ids=answer_ids,
            cached_tokens=cached,
            new_tokens=len(prompt) - cached,
            processed_tokens=processed,
            ttft_s=(stream.first_token_at - start) if stream.first_token_at else None,
            total_s=total_s,
            finish_reason="stop" if done_by_stop or len(answer_ids) < max_new else "length",
            cache=str(self.path),
            check=checked,
            history=[{"question": q, "answer": a} for q, a in history],
        )


    def ask_many(self, questions: Sequence[str], options: GenerationOptions | None = None, *,
                 batch_size: int = DEFAULT_BATCH, on_text: Callable[[int, str], None] | None = None,
                 on_answer: Callable[[int, Answer], None] | None = None, check: bool = False) -> list[Answer]:
        """Answer several questions together: each decoding step runs all of them (engine/batch.py), so the
        weights are read once per step instead of once per question. Same answers as ask() (greedy), except
        where batched kernels round a near-tie the other way. on_text(i, text) streams question i's text;
        on_answer(i, answer) hands each answer over as soon as it is complete. batch_size=1 asks one by one.
        check=True measures every answer against a full recompute, as ask(check=True) does (Answer.check):
        the batched path's own logits, so a rounding difference of the batch would show there."""
        from . import attention
        from .questions import answer_many

        opts = options or GenerationOptions()
        if batch_size <= 1 or len(questions) <= 1 or not attention.batchable(self.lm.model):
            answers = []
            for i, q in enumerate(questions):
                answers.append(self.ask(q, opts, on_text=(lambda t, i=i: on_text(i, t)) if on_text else None, check=check))
                if on_answer:
                    on_answer(i, answers[-1])
            return answers
        start = self.clock()
        return answer_many(self, questions, opts, batch_size=batch_size, start=start, on_text=on_text,
                           on_answer=on_answer, check=check)


def prompt_room(lm: LoadedModel, prompt: Sequence[int], opts: GenerationOptions) -> int:
    """How many answer tokens this prompt may have: --max-new-tokens within the model's positions."""
    limit = lm.max_positions
    if limit and len(prompt) >= limit:
        raise GenerationError(f"question too long: the prompt needs {len(prompt)} of the model's {limit} positions")
    return min(opts.max_new_tokens, limit - len(prompt)) if limit else opts.max_new_tokens


def generate_kwargs(lm: LoadedModel, opts: GenerationOptions, max_new: int) -> dict[str, Any]:
    """generate()'s options for one question. Sampling is done by a per-call processor (greedy generate()
    then keeps its pick), so a seed never touches torch's global generator."""
    from transformers import LogitsProcessorList

    from .sampling import Sampler

    tok = lm.tokenizer
    kwargs: dict[str, Any] = {"max_new_tokens": max_new, "do_sample": False}
    kwargs.update(repetition_penalty=opts.repetition_penalty, no_repeat_ngram_size=opts.no_repeat_ngram_size)
    if opts.temperature > 0:
        kwargs["logits_processor"] = LogitsProcessorList([Sampler(opts.temperature, opts.top_p, opts.seed, lm.device)])
    if opts.stop:
        kwargs.update(stop_strings=list(opts.stop), tokenizer=tok)
    if lm.model.generation_config.pad_token_id is None and tok.pad_token_id is None:
        kwargs["pad_token_id"] = tok.eos_token_id
    return kwargs


def _version_warnings(manifest, path: Path) -> list[str]:
    """A cache from another transformers release may hold keys/values computed by other model code."""
    import transformers

    built, now = manifest.transformers_version, transformers.__version__
    if built.split(".")[:2] != now.split(".")[:2]:
        return [f"{path}: built with transformers {built}, running {now}; if answers look off, rebuild the cache"]
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

    def for_cache(self, path: str | os.PathLike) -> LoadedModel:
        import json

        from . import models

        manifest = store.read_manifest(path)
        dtype = self.dtype or manifest.dtype
        if self.spec:
            source = models.resolve(self.spec, revision=self.revision)
        else:
            source = models.reload_source(manifest.model.get("source", {}))
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
