"""A batch whose lone row runs on the model's own attention: one question alone costs what generate() costs.

Cascade attention (batch.py) pays two attention passes and a merge in every layer; for a single row that
is pure overhead (a batch of one decodes slower than the document's own cache). So while a document
has one row and nobody waiting, that row decodes on the Session's own KVCache (solo.py: the tokens land in
the spare room after the document, the model's fused attention reads one contiguous buffer). When a second
row arrives, the lone row's own keys/values move into a row of the batch's suffix buffers and every row
goes on batched; the KVCache is rewound. Both paths were checked against the plain forward for this model
(engine/scheduling/probe.py), so a row that moves keeps equal logits.
"""

from __future__ import annotations

from typing import Any

from .batch import BatchDecoder
from .protocol import Row
from .solo import OneRowDecoder
from ..cache.kvcache import FullLayer
from ..model.cpu import CpuTuning


class LoneOrBatchDecoder:
    """engine/decoding/protocol.py's Decoder over a OneRowDecoder for a lone row and a BatchDecoder, made anew
    each time a second row arrives."""

    def __init__(self, model: Any, cache: Any, *, width: int, eos: set[int], pad_id: int, length: int | None = None,
                 cpu: CpuTuning | None = None):
        self.model, self.kv, self.width, self.eos, self.pad_id, self.length = model, cache, width, eos, pad_id, length
        self.solo = OneRowDecoder(model, cache, eos=eos, length=length, cpu=cpu)
        self.batch: BatchDecoder | None = None
        self.incoming: list[Row] = []
        self.last_rows = 0

    @staticmethod
    def suits(cache: Any) -> bool:
        """Only caches of full-attention layers: a sliding layer's window drops tokens a move would need."""
        return all(isinstance(layer, FullLayer) for layer in cache.layers)

    @property
    def rows(self) -> list[Row]:
        return self.incoming + self.solo.rows + (self.batch.rows if self.batch else [])

    @property
    def busy(self) -> bool:
        return bool(self.incoming) or self.solo.busy or bool(self.batch and self.batch.busy)

    def bytes(self) -> int:
        """The batch's suffix buffers while it is held; the lone row grows the document's own cache."""
        return self.batch.bytes() if self.batch else 0

    def add(self, row: Row) -> None:
        self.incoming.append(row)

    def drop(self, row: Row) -> None:
        if row in self.incoming:
            self.incoming.remove(row)
        elif row in self.solo.rows:
            self.solo.drop(row)
        elif self.batch:
            self.batch.drop(row)

    def step(self) -> list[Row]:
        """One forward pass: the lone row on its own, else every row in the batch (the lone one moved in first)."""
        alone = not (self.batch and self.batch.busy) and len(self.incoming) + len(self.solo.rows) <= 1
        if alone:
            self.solo.waiting += self.incoming
            self.incoming.clear()
            finished = self.solo.step()
            self.last_rows = self.solo.last_rows
            return finished
        if self.batch is None or not self.batch.busy:  # a new batch over the document's views as they are now
            self.kv.settle(self.model)  # tokens still pending (none once the lone row has run) are the document's
            self.batch = BatchDecoder(self.model, self.kv.states(), width=self.width, eos=self.eos,
                                      pad_id=self.pad_id, length=self.length)
        if self.solo.active:
            self._move(self.solo.active.pop())
        self.batch.waiting += self.solo.waiting + self.incoming  # in the order they came
        self.solo.waiting.clear()
        self.incoming.clear()
        finished = self.batch.step()
        self.last_rows = self.batch.last_rows
        return finished  # an idle batch keeps its suffix buffers (counted) until the engine lets this decoder go

    def _move(self, row: Row) -> None:
        """The lone row's own tokens' keys/values [1, kv_heads, n, head_dim] per layer into a batch row; rewind."""
        own = []
        for layer in self.kv.layers:
            k, v = layer.keys, layer.values  # [1, h, mark + n, d]
            own.append((k[:, :, layer.mark:], v[:, :, layer.mark:]))
        self.batch.adopt(row, own)
        self.kv.rewind()
