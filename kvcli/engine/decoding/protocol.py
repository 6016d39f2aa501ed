"""What a decoder offers the engine (engine/scheduling/scheduler.py), and the row it decodes.

The engine holds one decoder per document that has rows: it adds and drops rows, steps it once per loop,
hands every row it holds an error when a step fails, and counts bytes() in the document's memory:
- OneRowDecoder (solo.py): rows one at a time on the document's own cache, with the model's own attention;
- BatchDecoder (batch.py): every row in each forward pass, over the document's states shared read-only;
- LoneOrBatchDecoder (lone.py): a lone row as OneRowDecoder does, moved into a batch when a second arrives.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ...errors import CacheCorruptError


@dataclass
class Row:
    """One question being decoded."""

    index: int
    prompt: list[int]  # cached + appended ids
    appended: list[int]
    max_new: int
    choose: Callable[[list[int], torch.Tensor], int]  # (ids so far, logits [vocab]) -> next id
    on_token: Callable[[int], bool | str]  # hands a new id to the stream; True (or the reason) when that ended the answer
    answer: list[int] = field(default_factory=list)
    slot: int = -1  # buffer row
    offset: int = 0  # tokens written to the row
    processed: int = 0
    first_token_at: float | None = None
    finished_at: float = 0.0
    finish_reason: str = ""
    logits: list[torch.Tensor] | None = None  # with check: the raw logits [vocab] of every answer step


class Decoder(Protocol):
    """The rows of one document, stepped by the engine thread alone. step() runs one forward pass and returns
    the rows it finished (finish_reason and finished_at set); a step that raises keeps every row it held,
    for the engine to drop. drop() takes out a row whose asker left: never finished, its room free again."""

    last_rows: int  # rows in the latest forward pass (the engine's peak_rows)

    @property
    def rows(self) -> list[Row]: ...  # every row it holds, waiting or decoding

    @property
    def busy(self) -> bool: ...  # whether it holds any row

    def add(self, row: Row) -> None: ...  # joins at a coming step

    def drop(self, row: Row) -> None: ...

    def step(self) -> list[Row]: ...

    def bytes(self) -> int: ...  # memory held beyond the document's own cache (a batch's suffix buffers)


class RowQueue:
    """A decoder's rows waiting to join and rows decoding, over a document of `length` tokens in `states`."""

    def __init__(self, model: Any, states: Sequence[Any], eos: set[int], length: int | None):
        self.model, self.eos = model, eos
        self.cached_length = check_lengths(states, length)
        self.waiting: list[Row] = []
        self.active: list[Row] = []
        self.last_rows = 0
        # the lm head runs only where a next token is needed, if the model allows
        self.keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters

    @property
    def rows(self) -> list[Row]:
        return self.waiting + self.active

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.active)

    def add(self, row: Row) -> None:
        self.waiting.append(row)

    def drop(self, row: Row) -> None:
        if row in self.waiting:
            self.waiting.remove(row)
        elif row in self.active:
            self.active.remove(row)
            self._leave(row)

    def bytes(self) -> int:
        return 0

    def _finished(self) -> list[Row]:
        """The active rows whose answer ended: out, their room given back."""
        finished = [r for r in self.active if r.finish_reason]
        for r in finished:
            r.finished_at = time.perf_counter()
            self.active.remove(r)
            self._leave(r)
        return finished

    def _leave(self, row: Row) -> None:
        """What an active row gives back when it leaves (a buffer row, the cache's spare room)."""


def take(row: Row, logits: torch.Tensor, eos: set[int]) -> None:
    """Choose the row's next id from its logits [vocab] and say whether that ended its answer."""
    if row.logits is not None:
        row.logits.append(logits.clone())  # before any processor: what check.compare measures
    token = row.choose(row.prompt + row.answer, logits)
    if row.first_token_at is None:
        row.first_token_at = time.perf_counter()
    row.answer.append(token)
    stopped = row.on_token(token)
    if stopped or token in eos:
        row.finish_reason = stopped if isinstance(stopped, str) else "stop"
    elif len(row.answer) >= row.max_new:
        row.finish_reason = "length"


def check_lengths(states: Sequence[Any], length: int | None = None) -> int:
    """The document's length, which every layer must count (a sliding layer counts more tokens than it keeps).

    A layer restored with another count would put the question at the wrong positions (batched) or make
    the model run the document again (generate()): CacheCorruptError before any forward pass."""
    counted = {s.seq_length for s in states}
    want = length if length is not None else max(counted)
    if counted != {want}:
        raise CacheCorruptError(f"the restored layers count {sorted(counted)} tokens, the document has {want}: "
                                "a sliding layer lost its counted length; rebuild the cache")
    return want
