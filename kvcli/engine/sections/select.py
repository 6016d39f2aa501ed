"""Which sections of a sectioned cache answer a question: ranked by BM25 over their text (bm25s, imported only
here), a term the question quotes ranking first the sections that hold it in quotes (where a document defines its
terms); the best, up to DEFAULT_COUNT and while they fit the window with the question and answer's room, are put
back in document order."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_COUNT = 8  # sections a question uses unless --sections says otherwise (the window may allow fewer)
RELATIVE = 0.3  # ... each scoring at least this share of the best one's score
_QUOTED = re.compile(r"[\"“”]([^\"“”]{2,80})[\"“”]")


@dataclass(frozen=True)
class Choice:
    """The sections chosen for one question (document order) and every section's score."""

    chosen: list[int]
    scores: list[float]
    how: str  # "ranked", "first" (no section shares a word with the question), "count" (--sections), "all"


def scores(texts: Sequence[str], question: str) -> list[float]:
    """BM25 score of each text for the question (English stopwords left out; 0 where no word is shared)."""
    import bm25s

    index = bm25s.BM25()
    index.index(bm25s.tokenize(list(texts), stopwords="en", show_progress=False), show_progress=False)
    words = bm25s.tokenize(question, stopwords="en", return_ids=False, show_progress=False)[0]
    out = [float(s) for s in index.get_scores(words)] if words else [0.0] * len(texts)
    best = max(out, default=0.0)
    for term in _QUOTED.findall(question):  # a quoted term: its definition, the term in quotes, ranks first
        pattern = re.compile(r"[\"“”]" + re.escape(term.strip()) + r"[\"“”]", re.I)
        out = [s + best if pattern.search(t) else s for s, t in zip(out, texts)]
    return out


def choose(sizes: Sequence[int], ranks: Sequence[float], budget: int, *, glue: int = 2, count: int | None = None,
           every: bool = False) -> Choice:
    """Sections by score (ties: the earlier first) while their tokens (plus `glue` between two) fit `budget`: at most
    DEFAULT_COUNT, each scoring at least RELATIVE of the best; sections that share no word with the question only when
    none does (then the first that fit). count: at most this many, scored or not; every: all of them, whatever the
    budget (the caller checks the model's positions)."""
    n = len(sizes)
    if every:
        return Choice(list(range(n)), list(ranks), "all")
    order = sorted(range(n), key=lambda i: (-ranks[i], i))
    top = ranks[order[0]] if n else 0.0
    scored = [i for i in order if ranks[i] > 0 and ranks[i] >= RELATIVE * top][:DEFAULT_COUNT]
    pool = order if count is not None else (scored or list(range(n)))
    chosen, used = [], 0
    for i in pool:
        if count is not None and len(chosen) >= count:
            break
        cost = sizes[i] + (glue if chosen else 0)
        if used + cost <= budget:
            chosen.append(i)
            used += cost
    if not chosen:  # not even one section fits: the best one alone (the caller refuses it if it exceeds the model)
        chosen = [pool[0]]
    how = "count" if count is not None else ("ranked" if scored else "first")
    return Choice(sorted(chosen), list(ranks), how)
