"""Sectioned caches (format version 4): a document longer than the model's window, stored as sections.

The cache directory holds the framing head's own shards (manifest `token_ids` and `layers`, as any cache) and one
folder per section (`s0000/`, `s0001/`, ...) with that section's shards: the keys/values of the section's own
tokens, computed after the head and a primer (the document's first tokens and the previous section's last ones),
at the positions they had there (`position`). A reader opens only the sections it uses (format/store.py, open_part). Pure Python, no torch.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import CacheCorruptError
from .fields import bad, get_field, int_field, str_field

SECTIONED_VERSION = 4
MAX_SECTIONS = 1 << 16
_DIR = re.compile(r"^s[0-9]{4,5}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_PART_KEYS = {"index", "dir", "start_line", "end_line", "pages", "headings", "text", "token_ids", "position",
              "primer_sha256", "framing", "layers"}
_KEYS = {"window", "document_tokens", "start_tokens", "tail_tokens", "parts"}
_CUT_KEYS = ("anchor", "anchor_tokens", "pending")


def is_section_dir(name: str) -> bool:
    """Whether a folder name is one a section's folder may have."""
    return bool(_DIR.match(name))


def is_sectioned(folder: Any) -> bool:
    """Whether a local cache folder is a sectioned cache (it holds its first section's folder): nothing is opened or
    parsed, so the cache is read once, where it is opened, which also reports a broken one."""
    return (folder / section_dir(0)).is_dir()


def section_dir(index: int) -> str:
    """The one folder name section `index` may have."""
    return f"s{index:04d}"


@dataclass(frozen=True)
class Part:
    """One section: where it lies in the document as read, its own ids, and its shards' entries."""

    index: int
    dir: str
    start_line: int  # 1-based, inclusive, in the document's text as read (converted: with [page N] and # lines)
    end_line: int
    pages: list[int]  # the PDF pages its text is on ([] for a document without pages)
    headings: list[str]  # the heading it sits under, then those it holds
    text: str  # the section's text, as the model read it
    token_ids: list[int]  # its own ids (after the framing head)
    position: int  # where its first token sat when computed (head + primer)
    primer_sha256: str  # of the primer's ids: a grown document reuses a section only with the same primer
    framing: dict[str, Any]  # the cut at its end when it comes last (anchor, anchor_tokens, pending), or {}
    layers: list[Any] = field(default_factory=list)  # manifest.LayerEntry, files inside `dir`

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def to_json(self, shard_hash: str) -> dict[str, Any]:
        body = dataclasses.asdict(self)
        body["layers"] = [layer.to_json(shard_hash) for layer in self.layers]
        return body

    def source(self, score: float | None = None) -> dict[str, Any]:
        """What an answer cites: the section, its lines, pages and headings (and its selection score)."""
        out: dict[str, Any] = {"section": self.index, "start_line": self.start_line, "end_line": self.end_line}
        if self.pages:
            out["pages"] = list(self.pages)
        out["headings"] = list(self.headings)
        if score is not None:
            out["score"] = round(float(score), 4)
        return out


@dataclass(frozen=True)
class Sections:
    """The manifest's `sections` block."""

    window: int  # positions a question's prompt may use (the model's, or --window at prefill)
    document_tokens: int  # the framed document's tokens: head, every section and the separators between them
    start_tokens: int  # primer: the document's first tokens every later section was computed after ...
    tail_tokens: int  # ... and the previous section's last tokens
    parts: list[Part]

    @property
    def tokens(self) -> int:
        return sum(p.num_tokens for p in self.parts)

    @property
    def layers(self) -> list[Any]:
        """Every section's layer entries, in order."""
        return [e for p in self.parts for e in p.layers]

    def to_json(self, shard_hash: str) -> dict[str, Any]:
        return {"window": self.window, "document_tokens": self.document_tokens, "start_tokens": self.start_tokens,
                "tail_tokens": self.tail_tokens, "parts": [p.to_json(shard_hash) for p in self.parts]}


def check(body: Any, version: int, model: dict, head_tokens: int, quant: dict | None, hash_name: str, where: str,
          layer_check) -> Sections | None:
    """The optional `sections` block: present exactly in format version 4, every part's fields and shards checked
    (layer_check: manifest._layer, for one section's layers)."""
    raw = get_field(body, "sections", dict, where, optional=True)
    if (raw is None) != (version != SECTIONED_VERSION):
        raise bad(where, f"format version {version} {'needs a' if raw is None else 'has no'} 'sections' block")
    if raw is None:
        return None
    unknown = sorted(set(raw) - _KEYS)
    if unknown:
        raise bad(where, f"unknown sections field {unknown[0]!r}")
    window = int_field(raw, "sections.window", where, 2, 1 << 40)
    total = int_field(raw, "sections.document_tokens", where, 1, 1 << 40)
    start = int_field(raw, "sections.start_tokens", where, 0, 1 << 16)
    tail = int_field(raw, "sections.tail_tokens", where, 0, 1 << 16)
    items = get_field(raw, "sections.parts", list, where)
    if not 1 <= len(items) <= MAX_SECTIONS:
        raise bad(where, f"{len(items)} sections (1 to {MAX_SECTIONS})")
    parts, line = [], 0
    for i, item in enumerate(items):
        w = f"{where} (section {i})"
        if not isinstance(item, dict):
            raise bad(w, "section entry is not an object")
        unknown = sorted(set(item) - _PART_KEYS)
        missing = sorted(_PART_KEYS - set(item))
        if unknown or missing:
            raise bad(w, f"unknown section field {unknown[0]!r}" if unknown else f"missing section field {missing[0]!r}")
        if int_field(item, "index", w, 0, MAX_SECTIONS) != i:
            raise bad(w, "section index out of order")
        if str_field(item, "dir", w) != section_dir(i):
            raise bad(w, f"section folder {item['dir']!r} is not {section_dir(i)!r}")
        a = int_field(item, "start_line", w, 1, 1 << 40)
        b = int_field(item, "end_line", w, a, 1 << 40)
        if a < line:  # a line cut between words is shared by the sections holding its pieces
            raise bad(w, "sections overlap or are out of order")
        line = b
        pages = get_field(item, "pages", list, w)
        if any(type(p) is not int or p < 1 for p in pages):
            raise bad(w, "section pages must be positive integers")
        headings = get_field(item, "headings", list, w)
        if any(not isinstance(h, str) for h in headings):
            raise bad(w, "section headings must be strings")
        str_field(item, "text", w, limit=None)
        ids = get_field(item, "token_ids", list, w)
        if not ids or any(type(t) is not int or not 0 <= t < (1 << 31) for t in ids):
            raise bad(w, "section token_ids must be a non-empty list of non-negative integers")
        position = int_field(item, "position", w, head_tokens, 1 << 40)
        str_field(item, "primer_sha256", w, pattern=_SHA256)
        cut = get_field(item, "framing", dict, w)
        if set(cut) - set(_CUT_KEYS) or (cut and set(cut) != set(_CUT_KEYS)):
            raise bad(w, f"section framing must be empty or hold exactly {list(_CUT_KEYS)}")
        if cut:
            str_field(cut, "framing.anchor", w, limit=None)
            str_field(cut, "framing.pending", w, limit=None)
            int_field(cut, "framing.anchor_tokens", w, 0, min(len(ids), 1 << 10))
        entries = get_field(item, "layers", list, w)
        if len(entries) != model["num_layers"]:
            raise bad(w, f"{len(entries)} layers listed, model has {model['num_layers']}")
        layers = [layer_check(e, j, len(ids), 0, model, w, quant, hash_name) for j, e in enumerate(entries)]
        if any(layer.kind != "full" for layer in layers):
            raise bad(w, "a sectioned cache holds full-attention layers only")
        parts.append(Part(index=i, dir=item["dir"], start_line=a, end_line=b, pages=list(pages), headings=list(headings),
                          text=item["text"], token_ids=list(ids), position=position, primer_sha256=item["primer_sha256"],
                          framing=dict(cut), layers=layers))
    if total < head_tokens + sum(p.num_tokens for p in parts):
        raise bad(where, "sections.document_tokens is less than its sections hold")
    return Sections(window=window, document_tokens=total, start_tokens=start, tail_tokens=tail, parts=parts)


def label(part: Part) -> str:
    """A section as messages name it: its number and lines (and pages)."""
    pages = f", page{'s' if len(part.pages) > 1 else ''} {', '.join(map(str, part.pages))}" if part.pages else ""
    return f"section {part.index} (lines {part.start_line}-{part.end_line}{pages})"


def named(part: Part, exc: CacheCorruptError) -> CacheCorruptError:
    """A damaged shard's error, naming the section it belongs to."""
    return CacheCorruptError(f"{label(part)} of this sectioned cache is damaged: {exc}; prefill the document again")
