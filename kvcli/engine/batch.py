"""Many questions on one document at once: every decoding step reads the weights once for all of them.

The questions share the document's restored keys/values, read-only and never copied per question; each
question appends its own tokens to a row of a small suffix buffer. Attention runs in two parts merged
exactly by their log-sum-exp (cascade attention): every question's queries against the one copy of
the document at once, then each question against its own tokens. A finished question leaves the
batch and a waiting one takes its row between steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

GROW_TOKENS = 64  # suffix rows grow in steps of this many tokens (copying only the suffix)


# ---------------------------------------------------------------- the cache: shared prefix + per-row suffix


class SharedPrefixLayer(CacheLayerMixin):
    """One layer: the document's keys/values [1, kv_heads, cached, head_dim] shared by every row, and
    per-row suffix buffers [rows, kv_heads, capacity, head_dim] holding each question's own tokens."""

    is_compileable = False
    is_croppable = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, seq_length: int, sliding_window: int | None,
                 rows: int, capacity: int):
        super().__init__()
        self.prefix_keys, self.prefix_values = keys, values  # never written
        self.prefix_length = seq_length  # tokens the document counted (> cached for a full sliding window)
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        b, h, _, d = keys.shape
        # zeros, not empty: masked slots get weight 0, and 0 * NaN from stale memory would still be NaN
        self.keys = keys.new_zeros((rows, h, capacity, d))
        self.values = values.new_zeros((rows, h, capacity, values.shape[-1]))
        self.device = keys.device
        self.is_initialized = True
        self.step: Step | None = None

    def lazy_initialization(self, key_states, value_states) -> None:  # buffers exist from the start
        pass

    def grow(self, capacity: int) -> None:
        """Room for `capacity` tokens per row (copies the suffix, never the document)."""
        if capacity <= self.keys.shape[2]:
            return
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros((old.shape[0], old.shape[1], capacity, old.shape[3]))
            new[:, :, : old.shape[2]].copy_(old)
            setattr(self, name, new)

    def update(self, key_states, value_states, *args, **kwargs):
        """Write this step's keys/values [active, kv_heads, q, head_dim] at each active row's slots."""
        step = self.step
        q = key_states.shape[2]
        if step.uniform_offset is not None:  # every active row starts at the same slot (questions joining)
            at = step.uniform_offset
            self.keys[step.rows, :, at : at + q] = key_states
            self.values[step.rows, :, at : at + q] = value_states
        else:  # one token per row at its own slot
            self.keys[step.rows, :, step.offsets] = key_states[:, :, 0]
            self.values[step.rows, :, step.offsets] = value_states[:, :, 0]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.prefix_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.prefix_length + query_length, 0

    def get_max_length(self) -> int:
        return -1


class SharedPrefixCache(Cache):
    """A cache of SharedPrefixLayer, built explicitly from a restored document's layer states."""

    def __init__(self, states: Sequence[Any], rows: int, capacity: int):
        super().__init__(layers=[
            SharedPrefixLayer(s.keys, s.values, s.seq_length, s.sliding_window, rows, capacity) for s in states
        ])

    def begin(self, step: "Step") -> None:
        for layer in self.layers:
            layer.step = step

    def grow(self, capacity: int) -> None:
        for layer in self.layers:
            layer.grow(capacity)

    @property
    def capacity(self) -> int:
        return self.layers[0].keys.shape[2]


@dataclass
class Step:
    """What one forward pass covers: which buffer rows, and where their tokens go."""

    rows: torch.Tensor  # [active] buffer rows
    offsets: torch.Tensor  # [active] slot of each row's first new token
    uniform_offset: int | None  # the same first slot for every row (questions joining), else None
    query_length: int


# ---------------------------------------------------------------- decoding many rows


@dataclass
class Row:
    """One question in the batch."""

    index: int
    prompt: list[int]  # cached + appended ids
    appended: list[int]
    max_new: int
    choose: Callable[[list[int], torch.Tensor], int]  # (ids so far, logits [vocab]) -> next id
    on_token: Callable[[int], bool]  # hands a new id to the stream; True when a stop string ended the answer
    answer: list[int] = field(default_factory=list)
    slot: int = -1  # buffer row
    offset: int = 0  # tokens written to the row
    processed: int = 0
    first_token_at: float | None = None
    finished_at: float = 0.0
    finish_reason: str = ""


def decode_rows(model: Any, states: Sequence[Any], rows: list[Row], *, batch_size: int, eos: set[int],
                pad_id: int, done: Callable[[Row], None] | None = None) -> None:
    """Run every row to its end, at most batch_size at once; rows fill in place (answer, timings)."""
    if not rows:
        return
    device = states[0].keys.device
    cached_length = states[0].seq_length
    width = min(batch_size, len(rows))
    longest = max(len(r.appended) + r.max_new for r in rows)
    cache = SharedPrefixCache(states, width, min(longest, max(len(r.appended) for r in rows) + GROW_TOKENS))
    waiting = list(rows)
    active: list[Row] = []
    free = list(range(width))
    mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device)  # a 4D mask is passed through as-is

    def forward(batch: list[Row], ids: torch.Tensor, uniform: int | None) -> torch.Tensor:
        q = ids.shape[1]
        need = max(r.offset for r in batch) + q
        if need > cache.capacity:
            cache.grow(min(longest, need + GROW_TOKENS) if need <= longest else need)
        offsets = torch.tensor([r.offset for r in batch], device=device)
        cache.begin(Step(torch.tensor([r.slot for r in batch], device=device), offsets, uniform, q))
        positions = cached_length + offsets[:, None] + torch.arange(q, device=device)[None, :]  # [active, q]
        out = model(input_ids=ids, position_ids=positions, attention_mask=mask, cache=cache, use_cache=True,
                    kvcli_cache=cache)
        return out.logits  # [active, q, vocab]

    def take(row: Row, logits: torch.Tensor) -> None:
        token = row.choose(row.prompt + row.answer, logits)
        if row.first_token_at is None:
            row.first_token_at = time.perf_counter()
        row.answer.append(token)
        stopped = row.on_token(token)
        if stopped or token in eos:
            row.finish_reason = "stop"
        elif len(row.answer) >= row.max_new:
            row.finish_reason = "length"

    with torch.inference_mode():
        while waiting or active:
            joining = []
            while waiting and free:
                row = waiting.pop(0)
                row.slot, row.offset = free.pop(0), 0
                joining.append(row)
            if joining:  # the questions' own ids, right-padded; pads are never attended by real tokens
                q = max(len(r.appended) for r in joining)
                ids = torch.full((len(joining), q), pad_id, dtype=torch.long, device=device)
                for i, r in enumerate(joining):
                    ids[i, : len(r.appended)] = torch.tensor(r.appended, device=device)
                logits = forward(joining, ids, 0)
                for i, r in enumerate(joining):
                    r.offset = len(r.appended)
                    r.processed += len(r.appended)
                    take(r, logits[i, len(r.appended) - 1].float())
                active += joining
            else:
                ids = torch.tensor([[r.answer[-1]] for r in active], device=device)
                logits = forward(active, ids, None)
                for i, r in enumerate(active):
                    r.offset += 1
                    r.processed += 1
                    take(r, logits[i, 0].float())
            for r in [r for r in active if r.finish_reason]:
                r.finished_at = time.perf_counter()
                active.remove(r)
                free.append(r.slot)
                if done:
                    done(r)


def greedy(_ids: list[int], logits: torch.Tensor) -> int:
    return int(torch.argmax(logits))


def padding_id(tokenizer: Any, model: Any) -> int:
    for candidate in (tokenizer.pad_token_id, model.generation_config.pad_token_id, tokenizer.eos_token_id, 0):
        if isinstance(candidate, int):
            return candidate
    return 0


def eos_ids(model: Any) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()




# ---------------------------------------------------------------- questions -> answers


def processors(lm: Any, options: Any) -> list[Callable]:
    """The per-question logits processors generate() would apply for these options, in its order."""
    from transformers import NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor

    out: list[Callable] = []
    penalty = getattr(options, "repetition_penalty", 1.0) or 1.0
    if penalty != 1.0:
        out.append(RepetitionPenaltyLogitsProcessor(penalty))
    ngram = getattr(options, "no_repeat_ngram_size", 0) or 0
    if ngram > 0:
        out.append(NoRepeatNGramLogitsProcessor(ngram))
    if options.temperature > 0:
        from .sampling import Sampler

        out.append(Sampler(options.temperature, options.top_p, options.seed, lm.device))
    return out


def chooser(lm: Any, options: Any) -> Callable[[list[int], torch.Tensor], int]:
    """Next id for one question: its processors (incl. its own seeded sampler), then argmax, as generate() does."""
    steps = processors(lm, options)
    if not steps:
        return greedy

    def choose(ids: list[int], logits: torch.Tensor) -> int:
        scores = logits[None]  # [1, vocab]
        if steps:
            input_ids = torch.tensor([ids], device=logits.device)
            for step in steps:
                scores = step(input_ids, scores)
        return int(torch.argmax(scores[0]))

    return choose


def answer_many(session: Any, questions: Sequence[str], options: Any, *, batch_size: int, start: float,
                on_text: Callable[[int, str], None] | None = None,
                on_answer: Callable[[int, Any], None] | None = None) -> list[Any]:
    """Answer every question from the session's document, at most batch_size decoding together.

    Answers come back in question order; on_text(i, text) gets question i's settled text as it comes,
    on_answer(i, answer) each answer as soon as it is complete (in the order they finish).
    """
    from .answer import Answer, _Stream, prompt_room

    lm = session.lm
    model, tok = lm.model, lm.tokenizer
    cached = len(session.token_ids)
    rows, streams, answers = [], [], [None] * len(questions)
    for i, q in enumerate(questions):
        prompt = session.prompt_ids(q)
        stream = _Stream(tok, options.stop, (lambda text, i=i: on_text(i, text)) if on_text else None)
        stream.prompt_seen = True  # tokens are handed over one by one, never the prompt
        streams.append(stream)

        def on_token(token: int, stream=stream) -> bool:
            stream.put(torch.tensor([token]))
            return stream.stopped

        rows.append(Row(index=i, prompt=prompt, appended=prompt[cached:], max_new=prompt_room(lm, prompt, options),
                        choose=chooser(lm, options), on_token=on_token))

    def done(r: Row) -> None:
        streams[r.index].end()
        answers[r.index] = a = Answer(
            question=questions[r.index],
            answer=streams[r.index].text(),
            prompt_token_ids=r.prompt,
            answer_token_ids=r.answer,
            cached_tokens=cached,
            new_tokens=len(r.appended),
            processed_tokens=r.processed,
            ttft_s=(r.first_token_at - start) if r.first_token_at else None,
            total_s=r.finished_at - start,
            finish_reason=r.finish_reason,
            cache=str(session.path),
        )
        if on_answer:
            on_answer(r.index, a)

    decode_rows(model, session.states, rows, batch_size=batch_size, eos=eos_ids(model), pad_id=padding_id(tok, model),
                done=done)
    return answers
