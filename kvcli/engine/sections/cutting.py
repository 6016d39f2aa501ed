"""A document's text cut into sections of a few hundred tokens, at headings, pages and paragraphs.

Blocks are runs of lines between blank lines; a `# heading` or `[page N]` line always opens a block. Blocks are
packed into sections in order: a section closes before a heading or a page once it holds MIN_TOKENS, before any
block once it holds TARGET_TOKENS, and before a block that would take it past MAX_TOKENS. A block longer than
MAX_TOKENS is cut between its lines (a single longer line between words: the sections holding its pieces
share that line number). Pure Python: token counts come from
`count(texts) -> [int]`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

TARGET_TOKENS = 320  # a section closes before any block once it holds this many tokens
MIN_TOKENS = 160  # ... and before a heading or a page once it holds this many
MAX_TOKENS = 512  # never more (a longer block is cut between lines, a longer line between words)
_PAGE = re.compile(r"^\[page (\d+)\]$")
_HEADING = re.compile(r"^#{1,6} +(.+)$")

Count = Callable[[Sequence[str]], list[int]]


@dataclass
class Cut:
    """One section of the document as read: lines [start_line, end_line] (1-based), its text, pages, headings."""

    start_line: int
    end_line: int
    text: str
    pages: list[int] = field(default_factory=list)
    headings: list[str] = field(default_factory=list)


@dataclass
class _Block:
    start: int  # 0-based line index
    end: int  # exclusive
    lines: list[str]
    opens: bool  # starts with a heading or a page line
    tokens: int = 0


def cut(text: str, count: Count, *, target: int = TARGET_TOKENS, least: int = MIN_TOKENS,
        most: int = MAX_TOKENS) -> list[Cut]:
    """The sections of `text`, in order; every non-blank line is in exactly one."""
    lines = text.split("\n")
    blocks = _blocks(lines)
    for b, n in zip(blocks, count(["\n".join(b.lines) for b in blocks])):
        b.tokens = n
    blocks = [piece for b in blocks for piece in _split(b, count, most)]
    groups: list[list[_Block]] = []
    size = 0
    for b in blocks:
        if groups and (size + b.tokens > most or size >= target or (b.opens and size >= least)):
            groups.append([])
            size = 0
        if not groups:
            groups.append([])
        groups[-1].append(b)
        size += b.tokens + 1
    return _describe(lines, groups)


def _blocks(lines: list[str]) -> list[_Block]:
    out: list[_Block] = []
    run: list[int] = []

    def close() -> None:
        if run:
            first = lines[run[0]].strip()
            out.append(_Block(run[0], run[-1] + 1, [lines[i] for i in run], bool(_PAGE.match(first) or _HEADING.match(first))))
            run.clear()

    for i, line in enumerate(lines):
        s = line.strip()
        if not s:
            close()
        elif _PAGE.match(s) or _HEADING.match(s):
            close()
            run.append(i)
        else:
            run.append(i)
    close()
    return out


def _split(b: _Block, count: Count, most: int) -> list[_Block]:
    """A block of at most `most` tokens as it is, else cut between lines (a longer line between words)."""
    if b.tokens <= most:
        return [b]
    units: list[tuple[int, str]] = []  # (line index, text piece)
    for i, line in zip(range(b.start, b.end), b.lines):
        units += [(i, piece) for piece in _line_pieces(line, count, most)]
    sizes = count([u[1] for u in units])
    out: list[_Block] = []
    cur: list[tuple[int, str]] = []
    n = 0
    for (i, piece), k in zip(units, sizes):
        if cur and n + k + 1 > most:
            out.append(_piece_block(cur, n, b.opens and not out))
            cur, n = [], 0
        cur.append((i, piece))
        n += k + 1
    if cur:
        out.append(_piece_block(cur, n, b.opens and not out))
    return out


def _piece_block(units: list[tuple[int, str]], tokens: int, opens: bool) -> _Block:
    return _Block(units[0][0], units[-1][0] + 1, [u[1] for u in units], opens, tokens)


def _line_pieces(line: str, count: Count, most: int) -> list[str]:
    """A line in pieces of at most about `most` tokens, cut between words."""
    if count([line])[0] <= most:
        return [line]
    words, pieces, cur = line.split(" "), [], []
    per = max(1, len(words) * most // max(1, count([line])[0]) * 3 // 4)  # words per piece, with room to spare
    for w in words:
        cur.append(w)
        if len(cur) >= per:
            pieces.append(" ".join(cur))
            cur = []
    if cur:
        pieces.append(" ".join(cur))
    return pieces


def _describe(lines: list[str], groups: list[list[_Block]]) -> list[Cut]:
    """Each group of blocks as a Cut: its text (lines joined; a cut line's pieces in the sections that hold them),
    the pages it is on and the headings it sits under or holds."""
    out: list[Cut] = []
    page: int | None = None
    heading: str | None = None
    for group in groups:
        opening = [line.strip() for b in group[:2] for line in b.lines[:2]][:2]
        pages = [page] if page is not None and not _PAGE.match(opening[0]) else []
        heads = []
        starts_heading = any(_HEADING.match(line) for line in opening[: 2 if _PAGE.match(opening[0]) else 1])
        if heading is not None and not starts_heading:
            heads.append(heading)
        texts = []
        for b in group:
            for piece in b.lines:
                s = piece.strip()
                m = _PAGE.match(s)
                if m:
                    page = int(m.group(1))
                    if page not in pages:
                        pages.append(page)
                h = _HEADING.match(s)
                if h:
                    heading = h.group(1).strip()
                    heads.append(heading)
            texts.append("\n".join(b.lines))
        out.append(Cut(start_line=group[0].start + 1, end_line=group[-1].end, text="\n\n".join(texts).strip(),
                       pages=pages, headings=heads))
    return out

