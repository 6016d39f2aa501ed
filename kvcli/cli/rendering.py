"""Events (kvcli/events.py) -> the terminal, through Output: one renderer each for ask and prefill, in-process or served.

Imports nothing heavy: the served client renders with it too, and must start fast.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..events import AnswerOut, Begin, CheckOut, Event, ItemError, Note, Prefilled, Progress, TextOut, Warn
from .output import Output, human_bytes


def timing(a: dict[str, Any]) -> str:
    """The summary line after an answer: tokens, seconds, first token, rate, and whether it was cut short."""
    n = len(a["answer_token_ids"])
    total, ttft = a["total_s"], a.get("ttft_s")
    rate = (n - 1) / (total - ttft) if n > 1 and ttft is not None and total > ttft else None
    first = f", first token {ttft:.2f} s" if ttft is not None else ""
    line = f"{n} tokens in {total:.1f} s{first}" + (f", {rate:.1f} tokens/s" if rate else "")
    return line + (" (cut short)" if a["finish_reason"] == "length" else "")


def separator(label: str, first: bool) -> str:
    """The line before each answer of several on a pipe or file: `==> QUESTION <==` (`==> CACHE: QUESTION <==`
    with several caches; the question on one line), with a blank line after the previous answer."""
    return ("" if first else "\n") + f"==> {' '.join(label.split())} <==\n"


def positions_ran_out(a: dict[str, Any], max_new_tokens: int | None) -> bool:
    """Whether a cut answer stopped short of --max-new-tokens: the model's positions ran out first."""
    return a.get("finish_reason") == "length" and max_new_tokens is not None and len(a["answer_token_ids"]) < max_new_tokens


def cut_note(a: dict[str, Any], label: str | None, max_new_tokens: int | None = None) -> str:
    """The stderr note for an answer cut short (it would otherwise look finished), naming what cut it."""
    n = len(a["answer_token_ids"])
    which = f"the answer to {' '.join(label.split())!r}" if label else "the answer"
    cause = "the model's positions ran out" if positions_ran_out(a, max_new_tokens) else "--max-new-tokens"
    return f"kvcli: note: {which} was cut at {n} token{'s' * (n != 1)} ({cause}); it may be unfinished"


def message(out: Output, ev: Event) -> None:
    """A note, warning or error event as its line on stderr (any other event: nothing)."""
    if isinstance(ev, Note):
        out.note(ev.message)
    elif isinstance(ev, Warn):
        out.warn(ev.message)
    elif isinstance(ev, ItemError):
        out.error(ev.message, ev.hint)


def sources_line(a: dict[str, Any]) -> str:
    """The one line citing the sections an answer of a sectioned cache used: their lines (neighbouring sections as one
    range), pages and first heading, and the share of the document they hold."""
    runs: list[list[dict[str, Any]]] = []
    for s in a["sources"]:
        if runs and s["section"] == runs[-1][-1]["section"] + 1:
            runs[-1].append(s)
        else:
            runs.append([s])
    cited = []
    for run in runs:
        where = f"lines {run[0]['start_line']}-{run[-1]['end_line']}"
        pages = sorted({p for s in run for p in s.get("pages", [])})
        if pages:
            where += f", page {pages[0]}" if len(pages) == 1 else f", pages {pages[0]}-{pages[-1]}"
        heading = next((s["headings"][-1] for s in run if s.get("headings")), None)
        if heading:
            where += f", \"{heading}\""
        cited.append(where)
    share = a.get("document_share")
    return f"[sources: {'; '.join(cited)}" + (f" ({share:.0%} of the document)]" if share is not None else "]")


@dataclass(frozen=True)
class Look:
    """How answers are printed: JSON lines (--json), NUL-ended (-0), every answer named (labelled: a chat reading
    its questions from a pipe), every prompt id (--ids), each cache's document format (None: from the records)."""

    json_out: bool = False
    null: bool = False
    labelled: bool = False
    ids: bool = False
    formats: tuple[str | None, ...] | None = None


class AskRenderer:
    """Renders one ask's events: answers on stdout (plain, NUL-ended or JSON lines), the rest on stderr.

    caches: the caches as the user spelled them (JSON lines name those); served: the JSON lines' flag."""

    def __init__(self, out: Output, caches: Sequence[str], *, questions: int, look: Look = Look(), served: bool = False,
                 once: set | None = None, max_new_tokens: int | None = None):
        self.formats = list(look.formats) if look.formats is not None else [None] * len(caches)  # each cache's document format
        self.ids = look.ids  # --ids: the JSON lines carry every prompt id, not only their digest
        self.once = once  # warnings already shown (a chat: its cache's warnings once, not at every turn)
        self.max_new_tokens = max_new_tokens
        self.out, self.caches, self.json_out, self.null, self.served = out, list(caches), look.json_out, look.null, served
        # headings (terminal) or separator lines (pipe, file) name each of several plain answers; -0 and --json need none
        self.multiple = len(self.caches) * questions > 1 or look.labelled
        self.several = self.multiple and not look.json_out and not look.null
        self.answers: list[dict[str, Any]] = []
        self._labels: dict[int, str] = {}  # cache index -> the question now answered there
        self._separated = 0
        self._waiting = None  # the "working" spinner of a question whose first text has not come yet

    def _record(self, a: dict[str, Any]) -> dict[str, Any]:
        """An answer's JSON line: its document's format; the prompt's ids only with --ids (a digest of the cache's
        ids instead, which a --follow-up checks)."""
        record = {**a, "format": a.get("format") or self.formats[self.caches.index(a["cache"])], "served": self.served}
        prompt = record.get("prompt_token_ids")
        if not self.ids and isinstance(prompt, list):
            from ..format.identity import ids_digest

            record["document_ids_sha256"] = ids_digest(prompt[:record.get("cached_tokens", 0)])
            del record["prompt_token_ids"]
        return record

    def _label(self, index: int, question: str) -> str:
        return f"{self.caches[index]}: {question}" if len(self.caches) > 1 else question

    def _stop_waiting(self) -> None:
        if self._waiting is not None:
            self._waiting.stop()
            self._waiting = None

    def __call__(self, ev: Event) -> None:
        if not isinstance(ev, Begin):
            self._stop_waiting()
        if isinstance(ev, TextOut):
            self.out.write(ev.text)
        elif isinstance(ev, Begin):
            self._begin(ev)
        elif isinstance(ev, AnswerOut):
            self._answer(ev)
        elif isinstance(ev, CheckOut):
            if not self.json_out:
                self.out.note(ev.message)
        elif isinstance(ev, Warn) and self.once is not None and ev.about == "cache":
            if ev.message not in self.once:
                self.once.add(ev.message)
                self.out.warn(ev.message)
        else:
            message(self.out, ev)

    def _begin(self, ev: Begin) -> None:
        out = self.out
        out.check_stdout()  # a reader that left (`| head -1`) cancels the questions still to come
        label = self._label(ev.index, ev.question)
        self._labels[ev.index] = ev.question
        if self.several:
            if out.stdout_terminal:
                out.heading(label)
            else:
                out.write(separator(label, self._separated == 0))
            self._separated += 1
        self._stop_waiting()
        self._waiting = out.waiting(f"working on the question ({len(ev.question):,} characters)")

    def _answer(self, ev: AnswerOut) -> None:
        out = self.out
        a = {**ev.answer, "cache": self.caches[ev.index]}
        self.answers.append(a)
        if self.json_out:
            out.json_line(self._record(a))
        else:
            if a.get("sources"):
                out.write("\n" + sources_line(a))
            out.write("\0" if self.null else "\n")
        if a.get("finish_reason") == "loop" and not self.json_out:
            which = f"the answer to {' '.join(self._label(ev.index, a.get('question', '')).split())!r}" if self.multiple else "the answer"
            out.note(f"kvcli: note: {which} was ended where it began to repeat itself (--stop-loops; 0 lets it go on)")
        elif a.get("finish_reason") == "length" and not self.json_out:  # one line: the cut, and the timing on a terminal
            note = cut_note(a, self._label(ev.index, a.get("question", "")) if self.multiple else None, self.max_new_tokens)
            out.note(note + (f" ({timing(a).removesuffix(' (cut short)')})" if out.interactive else ""))
        else:
            out.summary(timing(a))


class PrefillRenderer:
    """Renders one prefill's events (kvcli/events.py prefill_events), in-process or served alike: a progress bar
    per document (on a terminal), a line per cache on stderr, the record (engine.corpus.DocResult) as a JSON line
    on stdout with --json, and with several documents or a list a closing count. targets: (document, cache) as
    the user spelled them; label: what the count adds (the shard)."""

    def __init__(self, out: Output, targets: Sequence[tuple[str, str]], *, json_out: bool = False, served: bool = False,
                 listed: bool = False, label: str = ""):
        self.out, self.targets, self.json_out, self.served = out, [(str(d), str(t)) for d, t in targets], json_out, served
        self.listed, self.label = listed, label
        self._bar: Any = None  # (index, context manager, update) of the document being prefilled
        self.counts = {"built": 0, "extended": 0, "skipped": 0, "failed": 0}

    def __call__(self, ev: Event) -> None:
        if isinstance(ev, Progress):
            if self._bar is None or self._bar[0] != ev.index:
                self._close()
                begun = sum(self.counts.values()) + 1
                overall = (begun, len(self.targets)) if len(self.targets) > 1 else None
                bar = self.out.progress(f"prefill {self.targets[ev.index][0]}", overall=overall)
                self._bar = (ev.index, bar, bar.__enter__())
            self._bar[2](ev.done, ev.total)
        elif isinstance(ev, Prefilled):
            self._close()
            doc, target = self.targets[ev.index]
            r = {**ev.record, "document": doc, "cache": target, "served": self.served}
            if r["status"] == "failed" and ev.message is not None:
                r["error"] = ev.message  # a served message, spelled as the user gave the paths
            self.report(r, ev.hint)
        else:
            if isinstance(ev, ItemError):
                self._close()
            message(self.out, ev)

    def close(self) -> None:
        self._close()
        c = self.counts
        if len(self.targets) > 1:  # one document's own line says what became of it
            grown = f", {c['extended']} extended" if c["extended"] else ""
            self.out.note(f"{c['built']} built{grown}, {c['skipped']} skipped, {c['failed']} failed of {len(self.targets)} "
                          f"documents{self.label}")
        if c["failed"] and len(self.targets) > 1:
            self.out.error(f"{c['failed']} of {len(self.targets)} documents failed")

    def _close(self) -> None:
        if self._bar is not None:
            bar, self._bar = self._bar[1], None
            bar.__exit__(None, None, None)

    def report(self, r: dict[str, Any], hint: str | None = None) -> None:
        """One document's record: its JSON line, and its line on stderr."""
        out = self.out
        self.counts[r["status"]] += 1
        if self.json_out:
            out.json_line(r)
        if r["status"] == "failed":
            out.error(r["error"], hint)
        elif r["status"] == "skipped":
            out.note(f"{r['cache']}: up to date, skipped ({r['num_tokens']:,} tokens)")
        else:
            computed = r.get("computed_tokens") or r["num_tokens"]
            if r["status"] == "extended":
                what = f"extended {r['extended_from']:,} -> {r['num_tokens']:,} tokens, computed {computed:,}"
            elif r.get("base"):
                what = f"{r['num_tokens']:,} tokens after {r['base']}, computed {computed:,}"
            else:
                what = f"{r['num_tokens']:,} tokens"
            out.note(
                f"{r['cache']}: {what} in {r['compute_s'] + r['write_s']:.1f} s "
                f"({computed / max(r['compute_s'], 1e-9):,.0f} tok/s), {human_bytes(r['bytes_on_disk'])} on disk "
                f"({r['bytes_on_disk'] / r['bytes_raw']:.0%} of {human_bytes(r['bytes_raw'])} raw, {r['storage']})"
            )
