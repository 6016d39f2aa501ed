"""Prefill of a document longer than the window: a sectioned cache (format/sections.py).

The framing head runs once and is stored as the cache's own shards. Each section then runs after the head and its
primer (the document's first START_TOKENS tokens and the previous section's last TAIL_TOKENS tokens, each followed
by the separator), as a link of a chain runs after its base, so that a section is not read as if it opened the
document; only the section's own keys/values are stored, in its folder. A document that grew keeps every section
whose ids and primer are unchanged (its shards are linked, not recomputed).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ... import __version__
from ...documents import Document
from ...errors import BlendError, CacheError, DocumentError, ModelError, UsageError
from ...format import manifest as mf, sections as sec, store, writing
from ..prompt import framing as fr
from . import cutting

START_TOKENS = 32  # the document's first tokens (its title, as a rule) every later section is computed after
TAIL_TOKENS = 64  # the previous section's last tokens each section is computed after


@dataclass
class Planned:
    """A section before it is computed: where it lies, its own ids, its primer, its cut when it comes last."""

    cut: cutting.Cut
    body: list[int]
    primer: list[int]
    framing: dict[str, Any]

    @property
    def primer_sha256(self) -> str:
        return hashlib.sha256(json.dumps(self.primer).encode()).hexdigest()


def plan(tokenizer: Any, framing: fr.Framing, text: str) -> tuple[list[int], list[Planned], int]:
    """The framing head's ids, the sections (each tokenized as a document of its own, head dropped) and the framed
    document's tokens (head, sections and the separators between them)."""

    def count(texts):
        return [len(ids) for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]] if texts else []

    head = fr.head_ids(tokenizer, framing)
    sep = list(tokenizer(fr.SEPARATOR, add_special_tokens=False)["input_ids"])
    out: list[Planned] = []
    for c in cutting.cut(text, count):
        ids, cut = fr.split_document(tokenizer, framing, c.text)
        if ids[: len(head)] != head or len(ids) <= len(head):
            raise ModelError(f"this tokenizer joins the prompt's head with the text after it (section at line "
                             f"{c.start_line}); the document cannot be cut into sections")
        record = {k: v for k, v in cut.record(tokenizer).items() if k in ("anchor", "anchor_tokens", "pending")}
        out.append(Planned(c, ids[len(head):], [], record))
    first = out[0].body[:START_TOKENS] if out else []
    for before, p in zip(out, out[1:]):
        p.primer = first + sep + before.body[-TAIL_TOKENS:] + sep
    return head, out, len(head) + sum(len(p.body) for p in out) + len(sep) * max(0, len(out) - 1)


def refusal(name: str, tokens: int, window: int, why: str) -> DocumentError:
    return DocumentError(f"{name}: {tokens} tokens do not fit the window of {window} positions, and {why}")


def window_limit(max_positions: int | None, window: int | None) -> int | None:
    """The positions a prompt may use: the model's, or a smaller --window."""
    if window is not None and window < 1:
        raise UsageError(f"--window must be positive, got {window}")
    return min(w for w in (max_positions, window) if w) if (max_positions or window) else None


def prefill(lm: Any, document: Document, out: str | os.PathLike, *, window: int | None = None, **options: Any):
    """prefilling.prefill, except that a document longer than the window (the model's positions, or a smaller
    `window`) becomes a sectioned cache; a document that fits (or one that extends a cache, `after`) is prefilled
    as one cache, exactly as prefilling.prefill does."""
    from .. import prefilling as pf

    limit = window_limit(lm.max_positions, window)
    if options.get("after") is not None and window is not None:
        raise UsageError("--window cuts a document prefilled alone into sections; a document extending a cache (--after) "
                         "is not cut: drop one of them")
    if options.get("after") is not None and store.read_manifest(options["after"], chain=False).sections is not None:
        raise UsageError(f"{options['after']}: is a sectioned cache (a document longer than the window), whose questions "
                         "each compose their own prompt; --after extends only a cache of one prompt")
    if options.get("after") is None:
        asked = fr.choose(lm.tokenizer, options.get("framing", "auto"), options.get("system"))
        split = options.get("split") or fr.split_document(lm.tokenizer, asked, document.text)
        if pf.too_long(document.name, len(split[0]), limit) is not None:
            extend = options.get("extend")
            if options.get("compression") is not None:  # "small" or "fast": a transform and a zstd level
                from ...format.codec import compression_spec

                options["transform"], options["level"] = compression_spec(options["compression"])
            return sectioned(lm, document, out, framing=asked, window=limit, tokens=len(split[0]),
                             chunk_size=options.get("chunk_size", pf.DEFAULT_CHUNK), force=options.get("force", False),
                             progress=options.get("progress"), transform=options.get("transform", pf.DEFAULT_TRANSFORM),
                             level=options.get("level", pf.DEFAULT_LEVEL), kv_bits=options.get("kv_bits"),
                             extend=not options.get("force", False) if extend is None else extend)
        options["split"] = split
    return pf.prefill(lm, document, out, **options)


def sectioned(lm: Any, document: Document, out: str | os.PathLike, *, framing: fr.Framing, window: int, tokens: int,
              chunk_size: int, force: bool = False, progress=None, transform: str, level: int, kv_bits: int | None = None,
              extend: bool = True):
    """Write the sectioned cache of `document` to `out` (atomically; replacing only with force or when `out` holds
    this document's sectioned cache from when it was shorter, whose unchanged sections are kept)."""
    from ..cache import blend, layers
    from ..cache.kvcache import KVCache
    from ..prefilling import PrefillResult, provenance, run_chunks, write_layers, _transformers_version

    if kv_bits is not None:
        raise UsageError(f"{document.name}: --kv-bits does not apply to a sectioned cache (a document longer than the "
                         "window); prefill it lossless")
    try:
        blend.check_supported(lm)
    except BlendError as exc:
        raise refusal(document.name, tokens, window, f"its sections cannot be composed with this model ({exc})") from None
    head, planned, total = plan(lm.tokenizer, framing, document.text)
    if window <= len(head) + cutting.MAX_TOKENS + TAIL_TOKENS:
        raise UsageError(f"--window {window}: too small for sections of up to {cutting.MAX_TOKENS} tokens")
    out = Path(out)
    old = _old(out, lm, document, framing, window) if extend and not force else None
    reuse = {}
    if old is not None:
        reuse = {(tuple(p.token_ids), p.primer_sha256): p for p in old.sections.parts}
    compute_s = write_s = 0.0
    computed = 0
    record = framing.record(lm.tokenizer)
    compression = {"codec": "zstd", "level": level, "transform": transform}
    longest = max(len(p.primer) + len(p.body) for p in planned)
    with writing.atomic_cache_dir(out, force=force or old is not None) as tmp:
        t0 = time.perf_counter()
        cache = KVCache.for_model(lm.model.config, reserve=len(head) + longest)
        run_chunks(lm, head, chunk_size, cache=cache, start=0)
        t1 = time.perf_counter()
        head_entries = write_layers(tmp, _span(layers.read(cache), 0, len(head)), len(head), transform=transform, level=level)
        compute_s += t1 - t0
        write_s += time.perf_counter() - t1
        parts: list[sec.Part] = []
        done, todo = 0, sum(len(p.body) for p in planned)
        if progress:
            progress(0, todo)
        for i, p in enumerate(planned):
            folder = tmp / sec.section_dir(i)
            folder.mkdir()
            position = len(head) + len(p.primer)
            kept = reuse.get((tuple(p.body), p.primer_sha256))
            if kept is not None and kept.position == position:
                t2 = time.perf_counter()
                for entry in kept.layers:
                    _link(out / kept.dir / entry.file, folder / entry.file)
                entries = kept.layers
                write_s += time.perf_counter() - t2
            else:
                t2 = time.perf_counter()
                for layer in cache.layers:
                    layer.crop(len(head) - layer.get_seq_length())
                run_chunks(lm, head + p.primer + p.body, chunk_size, cache=cache, start=len(head))
                t3 = time.perf_counter()
                entries = write_layers(folder, _span(layers.read(cache), position, position + len(p.body)), len(p.body),
                                       transform=transform, level=level)
                compute_s += t3 - t2
                write_s += time.perf_counter() - t3
                computed += len(p.primer) + len(p.body)
            parts.append(sec.Part(index=i, dir=sec.section_dir(i), start_line=p.cut.start_line, end_line=p.cut.end_line,
                                  pages=p.cut.pages, headings=p.cut.headings, text=p.cut.text, token_ids=p.body,
                                  position=position, primer_sha256=p.primer_sha256, framing=p.framing, layers=entries))
            done += len(p.body)
            if progress:
                progress(done, todo)
        del cache
        manifest = mf.Manifest(
            format_version=mf.SECTIONED_VERSION,
            kvcli_version=__version__,
            transformers_version=_transformers_version(),
            created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            model={**lm.fingerprint, "source": lm.source},
            framing={k: v for k, v in record.items() if k not in ("anchor", "anchor_tokens", "pending")},
            document=document.record(),
            token_ids=head,
            compression=compression,
            layers=head_entries,
            provenance=provenance(lm),
            sections=sec.Sections(window=window, document_tokens=total, start_tokens=START_TOKENS,
                                  tail_tokens=TAIL_TOKENS, parts=parts),
        )
        writing.write_file(tmp, mf.MANIFEST_NAME, manifest.dumps())  # written last: no manifest, no cache
    return PrefillResult(path=out, manifest=manifest, compute_s=compute_s, write_s=write_s, computed=computed,
                         grown_from=old.sections.document_tokens if old is not None else None)


def _span(states, lo: int, hi: int):
    """Full-attention states cut to tokens [lo, hi) (a section's own), contiguous for the writer."""
    from ..cache import layers

    return [layers.LayerState("full", s.keys[:, :, lo:hi].contiguous(), s.values[:, :, lo:hi].contiguous(), hi - lo, None)
            for s in states]


def _old(out: Path, lm: Any, document: Document, framing: fr.Framing, window: int):
    """The manifest at `out` if it is this document's sectioned cache, made the same way, from when it was shorter
    (or the same): its unchanged sections are kept. None otherwise."""
    from ...format import store
    from ..prefilling import same_setup

    if not store.is_cache(out):
        return None
    try:
        m = store.read_manifest(out)
    except CacheError:
        return None
    same_doc = document.grew_from(m.document) or document.same_source(m.document)
    if m.sections is None or not same_doc or m.sections.window != window:
        return None
    return m if same_setup(m, lm, framing.record(lm.tokenizer), None) else None


def _link(src: Path, dst: Path) -> None:
    """A kept shard in the new cache: a hard link to the old one (the old folder is removed after the swap), else a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
