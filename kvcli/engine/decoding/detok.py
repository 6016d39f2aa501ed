"""Answer ids -> text as tokens come: incremental detokenization and stop strings on the new text only.

Each token decodes a short window of ids (the last few already shown plus the new ones), as
transformers' TextStreamer and vLLM's detokenizer do, never the answer from its start; stop strings
are searched only where the new text could complete one. Text that may still become a stop string,
or that ends in an incomplete character, is held back until it settles.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

TextFn = Callable[[str], None]
CONTEXT = 6  # ids already shown that are decoded again with the new ones (spaces and merges at the seam)


class TextStream:
    """The text of one answer, settled piece by piece; `put(id)` returns True once a stop string ends it."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), on_text: TextFn | None = None):
        self.tokenizer, self.stop, self.on_text = tokenizer, [s for s in stop if s], on_text
        self.ids: list[int] = []
        self.text = ""  # decoded so far (cut before a stop string once one is found)
        self.sent = 0  # characters of `text` handed to on_text
        self.stopped = False
        self._prefix = 0  # ids[_prefix:_read] were decoded into the end of `text` last time
        self._read = 0
        self._longest = max((len(s) for s in self.stop), default=0)

    def put(self, token: int) -> bool:
        """Add one answer id; settle and hand out what can no longer change. True when a stop string ended the answer."""
        if self.stopped:
            return True
        self.ids.append(int(token))
        before = self._decode(self._prefix, self._read)
        after = self._decode(self._prefix, len(self.ids))
        if after.endswith("\ufffd"):
            return False  # an incomplete character: wait for the ids that complete it
        if after.startswith(before):
            self.text += after[len(before):]
        else:  # the seam moved what was decoded before (rare): decode the answer whole, once
            full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            self.text = full if full.startswith(self.text[: self.sent]) else self.text[: self.sent] + full[self.sent:]
        self._prefix, self._read = max(0, len(self.ids) - CONTEXT), len(self.ids)
        self._cut_at_stop()
        self._emit(final=self.stopped)
        return self.stopped

    def end(self) -> None:
        """The answer is complete: settle everything (the full text decoded once, for the exact final form)."""
        if not self.stopped:
            full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            if full.startswith(self.text[: self.sent]):
                self.text = full
                self._cut_at_stop()
        self._emit(final=True)

    def _cut_at_stop(self) -> None:
        """End the text before the first stop string in it, searched only where one could start in unsent text."""
        found = [at for at in (self.text.find(s, max(0, self.sent - self._longest + 1)) for s in self.stop) if at >= 0]
        if found:
            self.stopped = True
            self.text = self.text[:min(found)]

    def _decode(self, start: int, stop: int) -> str:
        if stop <= start:
            return ""
        return self.tokenizer.decode(self.ids[start:stop], skip_special_tokens=True)

    def _emit(self, final: bool) -> None:
        settled = len(self.text)
        if not final:
            for s in self.stop:  # hold back a tail that may grow into a stop string
                for k in range(min(len(s) - 1, settled), 0, -1):
                    if self.text.endswith(s[:k]):
                        settled = min(settled, len(self.text) - k)
                        break
        if settled > self.sent:
            piece = self.text[self.sent:settled]
            self.sent = settled
            if self.on_text:
                self.on_text(piece)

