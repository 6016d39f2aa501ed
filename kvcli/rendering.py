"""Ask events (kvcli/asking.py) -> the terminal, through Output: one renderer for in-process and served asks.

Imports nothing heavy: the served client renders with it too, and must start fast.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .output import Output


def timing(a: dict[str, Any]) -> str:
    """The summary line after an answer: tokens, seconds, first token, rate, and whether --max-new-tokens cut it."""
    n = len(a["answer_token_ids"])
    total, ttft = a["total_s"], a.get("ttft_s")
    rate = (n - 1) / (total - ttft) if n > 1 and ttft is not None and total > ttft else None
    first = f", first token {ttft:.2f} s" if ttft is not None else ""
    line = f"{n} tokens in {total:.1f} s{first}" + (f", {rate:.1f} tokens/s" if rate else "")
    return line + (" (stopped at --max-new-tokens)" if a["finish_reason"] == "length" else "")


class AskRenderer:
    """Renders one ask's events: answers on stdout (plain, NUL-ended or JSON lines), the rest on stderr.

    caches: the caches as the user spelled them (JSON lines name those); served: the JSON lines' flag."""

    def __init__(self, out: Output, caches: Sequence[str], *, questions: int, json_out: bool = False, null: bool = False,
                 served: bool = False):
        self.out, self.caches, self.json_out, self.null, self.served = out, list(caches), json_out, null, served
        self.several = len(self.caches) * questions > 1 and not json_out and not null  # headings, on a terminal only
        self.answers: list[dict[str, Any]] = []

    def __call__(self, ev: dict[str, Any]) -> None:
        kind, out = ev.get("event"), self.out
        if kind == "text":
            out.write(ev["text"])
        elif kind == "begin":
            out.check_stdout()  # a reader that left (`| head -1`) cancels the questions still to come
            if self.several:
                cache = self.caches[ev["index"]]
                out.heading(f"{cache}: {ev['question']}" if len(self.caches) > 1 else ev["question"])
        elif kind == "answer":
            a = {**ev["answer"], "cache": self.caches[ev["index"]]}
            self.answers.append(a)
            if self.json_out:
                out.json_line({**a, "served": self.served})
            else:
                out.write("\0" if self.null else "\n")
            out.summary(timing(a))
        elif kind == "check":
            if not self.json_out:
                out.note(ev["message"])
        elif kind == "warning":
            out.warn(ev["message"])
        elif kind == "note":
            out.note(ev["message"])
        elif kind == "error":
            out.error(ev["message"], ev.get("hint"))
