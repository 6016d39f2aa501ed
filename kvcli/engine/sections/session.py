"""A sectioned cache opened against a loaded model: per question, the sections chosen (select.py), composed into one
prompt (compose.py), and the question answered on it by the model's engine as from any cache; each answer carries
its `sources` (the sections used: lines, pages, headings, score) and the share of the document they hold."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import UsageError
from ...requests import SECTION_RECOMPUTE as DEFAULT_RECOMPUTE, Sections  # noqa: F401  (the request value, re-exported)
from ..prompt import conversation, framing as fr
from . import compose as cp, select


@dataclass
class Plan:
    """One question's sections and the prompt they make."""

    choice: select.Choice
    ids: list[int]  # the composed prompt's ids (head, sections, separators)

    def sources(self, manifest: Any) -> list[dict[str, Any]]:
        parts = manifest.sections.parts
        return [parts[i].source(self.choice.scores[i]) for i in self.choice.chosen]

    def share(self, manifest: Any) -> float:
        parts = manifest.sections.parts
        return round(sum(parts[i].num_tokens for i in self.choice.chosen) / max(1, sum(p.num_tokens for p in parts)), 4)


class SectionedSession:
    """Session's interface (check_prompt, prompt_ids, submit, ask, ask_many, warnings, nbytes, stats) over a sectioned
    cache, so that every front end (in process, the warm server, HTTP) answers from it as from any Session."""

    links: tuple = ()  # the caches below it (a chain): a sectioned cache extends none

    def __init__(self, lm: Any, opened: Any, how: Sections | None = None, *, session: Any,
                 warnings: Sequence[str] = (), convert_dtype: bool = False):
        """opened: the sectioned cache (format.store.OpenedCache), already open; its head is restored once, by the first
        question, and each question's chosen sections are read from its folder then. session: engine.answer.Session
        (its `composed` makes each question's); warnings: the cache's, as a Session states them."""
        from ..cache import blend
        from ..model import fit

        t0 = time.perf_counter()
        self.lm, self.path, self.manifest = lm, opened.path, opened.manifest
        self.how = how or Sections()
        blend.check_fraction(self.how.recompute)
        fit.check_fits(self.manifest, lm, str(self.path), convert_dtype=convert_dtype)
        blend.check_supported(lm)
        from ...format import parts

        for p in self.manifest.sections.parts:  # a section missing or cut short refuses the whole cache, naming it
            parts.open_part(self.path, self.manifest, p.index).close()
        self.opened = opened
        self.storage = self.manifest.storage
        m = self.manifest
        self.session = session
        self.warnings = list(warnings)
        self.formats = [opened.manifest.document.get("format", "text")]  # the document's format, for records
        self.warnings.append(f"{self.path}: {len(m.sections.parts)} sections of a document longer than the window "
                             f"({m.document_tokens:,} tokens); each question uses those it needs, "
                             f"{self.how.recompute:g} of each recomputed: answers are approximate (--check measures them)")
        self.load_s = time.perf_counter() - t0
        self._lock = threading.Lock()
        self._plans: dict[str, Plan] = {}
        self._head: Any = None  # the head's layers restored by the first question (compose.restore_head)
        self._live: list[Any] = []  # the composed Sessions answering now (their buffers are this session's memory)
        self.stats = {"asked": 0, "steps": 0, "peak_rows": 0}  # summed over the composed Sessions, as a Session's

    @property
    def framing(self) -> fr.Framing:
        """The prompt head's framing (its system prompt), which a conversation's system message is checked against."""
        return fr.Framing.from_record(self.manifest.framing)

    @property
    def num_tokens(self) -> int:
        """The document's tokens (its sections and the separators between them, with the head)."""
        return self.manifest.document_tokens

    def nbytes(self) -> int:
        """Memory held now: the composed prompts of the questions being answered (none between questions)."""
        with self._lock:
            live = list(self._live)
        return sum(s.nbytes() for s in live)

    @property
    def token_ids(self) -> list[int]:
        raise UsageError(f"{self.path}: a sectioned cache makes a prompt per question; a follow-up cannot continue it")

    def plan(self, question: str) -> Plan:
        """The sections chosen for `question` and the prompt they make (cached per question text)."""
        with self._lock:
            if question in self._plans:
                return self._plans[question]
        from ..prefilling import ANSWER_ROOM

        m = self.manifest
        parts = m.sections.parts
        window = min(m.sections.window, self.lm.max_positions or m.sections.window)
        budget = window - len(m.token_ids) - ANSWER_ROOM
        choice = select.choose([p.num_tokens for p in parts], select.scores([p.text for p in parts], question), budget,
                               count=self.how.count, every=self.how.every)
        ids, _plans = cp.prompt_ids(self.lm, m, choice.chosen)
        plan = Plan(choice, ids)
        with self._lock:
            self._plans[question] = plan
        return plan

    def prompt_ids(self, question: str, history: Sequence[Any] = ()) -> list[int]:
        """The question's prompt: its sections composed, then the question."""
        if history:
            raise UsageError(f"{self.path}: a sectioned cache makes a prompt per question; a follow-up cannot continue it")
        plan = self.plan(question)
        last = cp.part_framing(self.manifest, self.manifest.sections.parts[plan.choice.chosen[-1]])
        return plan.ids + conversation.appended_ids(self.lm.tokenizer, last, (), question, plan.ids)

    def check_prompt(self, question: str, history: Sequence[Any] = (), options: Any = None) -> tuple[list[int], int]:
        from ..decoding.request import GenerationOptions, prompt_room

        ids = self.prompt_ids(question, history)
        return ids, prompt_room(self.lm, ids, options or GenerationOptions())

    def submit(self, questions: Sequence[str], options: Any = None, *, batch_size: int | None = None, check: bool = False,
               history: Sequence[Any] = (), prompts: Sequence[list[int]] | None = None) -> "SectionedRequest":
        if history:
            raise UsageError(f"{self.path}: a sectioned cache makes a prompt per question; a follow-up cannot continue it")
        return SectionedRequest(self, list(questions), options, check=check)

    def ask(self, question: str, options: Any = None, on_text: Callable[[str], None] | None = None, *,
            check: bool = False) -> Any:
        return self.ask_many([question], options, on_text=(lambda _i, t: on_text(t)) if on_text else None, check=check)[0]

    def ask_many(self, questions: Sequence[str], options: Any = None, *, on_text=None, on_answer=None,
                 check: bool = False, **_kw: Any) -> list[Any]:
        return self.submit(questions, options, check=check).result(on_text, on_answer)

    def session_for(self, question: str):
        """The Session (engine/answer.py) of `question`'s composed prompt, and its plan."""
        t0 = time.perf_counter()
        plan = self.plan(question)
        with self._lock:
            if self._head is None:  # read and verified once: every question's prompt starts with it
                self._head = cp.restore_head(self.lm, self.opened)
        made = cp.compose(self.lm, self.opened, plan.choice.chosen, self.how.recompute, head_copy=self._head, defer=True)
        parts = self.manifest.sections
        blended = {"documents": len(made.chosen), "recompute": made.recompute, "recomputed_tokens": made.recomputed_tokens,
                   "moved_tokens": made.moved_tokens, "caches": [str(self.path)], "sections": list(made.chosen),
                   "of": len(parts.parts)}
        return self.session.composed(self.lm, self.path, self.manifest, made, blended=blended, started=t0), plan

    def close(self) -> None:
        self.opened.close()


class SectionedRequest:
    """The questions of one submit, each on its own composed prompt, answered in order (Request's result/cancel)."""

    def __init__(self, owner: SectionedSession, questions: list[str], options: Any, *, check: bool):
        self.owner, self.questions, self.options, self.check = owner, questions, options, check
        self.served: Callable[[int, Any], None] | None = None  # on_answer's
        self._current = None
        self._cancelled = False

    def on_answer(self, fn: Callable[[int, Any], None]) -> None:
        """fn(i, answer) as each answer completes (Request.on_answer), before the reader's own callback."""
        self.served = fn

    def cancel(self) -> None:
        self._cancelled = True
        current = self._current
        if current is not None:
            current.cancel()

    def __enter__(self) -> "SectionedRequest":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cancel()

    def result(self, on_text: Callable[[int, str], None] | None = None,
               on_answer: Callable[[int, Any], None] | None = None) -> list[Any]:
        from ..scheduling.requests import Cancelled

        answers = []
        m = self.owner.manifest
        for i, q in enumerate(self.questions):
            if self._cancelled:
                raise Cancelled("the asker left")
            session, plan = self.owner.session_for(q)
            with self.owner._lock:
                self.owner._live.append(session)
            try:
                ids, _room = session.check_prompt(q, (), self.options)
                self._current = session.submit([q], self.options, check=self.check, prompts=[ids])

                def finished(_j: int, a: Any, i: int = i, plan: Plan = plan) -> None:
                    a.sources, a.document_share = plan.sources(m), plan.share(m)
                    if self.served:  # before on_answer, as a Session's engine calls it
                        self.served(i, a)
                    if on_answer:
                        on_answer(i, a)

                answers += self._current.result((lambda _j, t, i=i: on_text(i, t)) if on_text else None, finished)
            finally:
                self._current = None
                with self.owner._lock:
                    self.owner._live.remove(session)
                    for k in ("asked", "steps"):
                        self.owner.stats[k] += session.stats[k]
                    self.owner.stats["peak_rows"] = max(self.owner.stats["peak_rows"], session.stats["peak_rows"])
            del session
        return answers
