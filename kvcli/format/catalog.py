"""Summaries of caches for `info` and `ls`: manifests only, no torch."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from . import chain, store
from ..errors import CacheError
from .manifest import Manifest


def summary(path: Path, m: Manifest) -> dict[str, Any]:
    """The stable JSON shape of `kvcli info --json` (and each row of `kvcli ls --json`)."""
    source = m.model.get("source", {})
    return {
        "path": str(path),
        "format_version": m.format_version,
        "shard_hash": m.shard_hash,  # "blake3" (format 3) or "sha256" (formats 1, 2)
        "model": m.model_name,
        "model_source": source,
        "model_type": m.model.get("model_type"),
        "num_tokens": m.document_tokens,  # a sectioned cache: the whole document's (head, sections, separators)
        "num_layers": len(m.layers),
        "dtype": m.dtype,
        "weights": m.weights,  # "q8", "q4", "gguf": computed with quantized weights (engine/model/stored.py)
        **({"weights_error": m.model["weights_error"]} if m.model.get("weights_error") else {}),  # gguf: per file type -> kernel
        "bytes_raw": m.bytes_raw,
        "bytes_on_disk": m.bytes_stored,
        "ratio": round(m.bytes_stored / m.bytes_raw, 4) if m.bytes_raw else None,
        "compression": m.compression,
        "storage": m.storage,
        "framing": {k: m.framing.get(k) for k in ("kind", "system")},
        "document": {**m.document, "format": m.document.get("format", "text")},  # text caches record none: text
        "created": m.created,
        "kvcli_version": m.kvcli_version,
        "transformers_version": m.transformers_version,
        "provenance": m.provenance,  # None for caches written before it was recorded
        "base": _base(path, m),  # the cache it extends (prefill --after), or None
        "sections": section_rows(m),  # a document longer than the window: its sections, or None
    }


def section_rows(m: Manifest) -> list[dict[str, Any]] | None:
    """A sectioned cache's sections: lines, pages, headings, tokens and bytes on disk (None for any other cache)."""
    if m.sections is None:
        return None
    return [{**p.source(), "tokens": p.num_tokens, "bytes_on_disk": sum(e.stored_bytes for e in p.layers)}
            for p in m.sections.parts]


def _base(path: Path, m: Manifest) -> dict[str, Any] | None:
    if m.base is None:
        return None
    try:
        where = str(chain.base_path(Path(path), m.base["path"]))
    except CacheError:  # a link to an object-store URL
        where = m.base["path"]
    return {**m.base, "path": where}


def chain_rows(opened: "store.OpenedCache") -> list[dict[str, Any]]:
    """The links of an opened chain, the first first: path, tokens in all, tokens it stores, document."""
    return [{"path": str(c.path), "num_tokens": c.manifest.num_tokens,
             "own_tokens": c.manifest.num_tokens - c.manifest.base_tokens, "document": c.manifest.document}
            for c in opened.chain()]


def describe_storage(m: Manifest) -> str:
    """One line for `info`: lossless, or the quantization scheme the manifest records."""
    c, q = m.compression, m.quant
    if q is None:
        return f"lossless ({c.get('transform', 'none')}, zstd level {c.get('level')})"
    return (f"{q['bits']}-bit (lossy): keys per channel, values per token, groups of {q['group_size']}, "
            f"first {q['exact_tokens']} and last {q.get('recent_tokens', 0)} tokens exact, {q['scale_dtype']} scales, zstd level {c.get('level')}")


WEIGHTS = {"float": "float (as transformers dequantizes them, in the dtype above)",
           "q8": "q8 (int8 weights per output channel, quantized at load: torch's int8 kernel, bfloat16 activations)",
           "q4": "q4 (the GGUF file's 4-bit weights as stored: torch's int4 kernel, bfloat16 activations)",
           "gguf": "gguf (the GGUF file's own low-bit weights, each tensor's blocks as stored, on kvcli's kernels)"}


def describe_weights(m: Manifest) -> str:
    """One line for `info`: the arithmetic the keys/values were computed with (a model must be loaded the same way)."""
    if m.weights == "q4" and m.model.get("source", {}).get("kind") not in ("default", "gguf"):
        return "q4 (4-bit weights in groups of 32, quantized at load: torch's int4 kernel, bfloat16 activations)"
    text = WEIGHTS.get(m.weights, str(m.weights))
    error = m.model.get("weights_error")
    if isinstance(error, dict) and error:  # per file type -> kernel: how far the kernel's weights are from the file's
        parts = [f"{kind} {e.get('layers')} layers, mean |diff| {100 * e['mean_abs'] / e['mean_weight']:.2g}% of mean |w|, max {e['max_abs']:.2g}"
                 for kind, e in error.items() if isinstance(e, dict) and e.get("mean_weight")]
        text += "; against the file: " + "; ".join(parts)
    return text


def layer_rows(m: Manifest) -> list[dict[str, Any]]:
    return [
        {
            "index": layer.index,
            "kind": layer.kind,
            "sliding_window": layer.sliding_window,
            "cached_length": layer.cached_length,
            "seq_length": layer.seq_length,
            "file": layer.file,
            "raw_bytes": layer.raw_bytes,
            "stored_bytes": layer.stored_bytes,
            "ratio": round(layer.stored_bytes / layer.raw_bytes, 4) if layer.raw_bytes else None,
        }
        for layer in m.layers
    ]


def find(folder: Path) -> list[dict[str, Any]]:
    """Every cache directly inside `folder` (or `folder` itself), with its age; broken ones flagged."""
    folder = Path(folder)
    candidates = [folder] if store.is_cache(folder) else sorted(p for p in folder.iterdir() if store.is_cache(p))
    rows = []
    for path in candidates:
        try:
            m = store.read_manifest(path, shards=True)  # a cache missing a shard is listed as broken
        except CacheError as exc:
            rows.append({"path": str(path), "error": str(exc)})
            continue
        row = summary(path, m)
        row["age_s"] = max(0.0, time.time() - os.stat(path / "manifest.json").st_mtime)
        rows.append(row)
    return rows


def changed_source(path: str | os.PathLike, m: Manifest) -> str | None:
    """A warning when the document a cache was made from, found beside the cache under its recorded name (where
    prefill writes a cache by default), has other bytes now; None when it is unchanged or not there."""
    import hashlib

    name = m.document.get("name")
    if not name or name == "-":
        return None
    source = Path(path).parent / name
    try:
        if not source.is_file() or source.stat().st_size > 256 * 1024 * 1024:
            return None
        digest = hashlib.sha256(source.read_bytes()).hexdigest()
    except OSError:
        return None
    if digest == m.document.get("sha256"):
        return None
    return (f"{source} has changed since {path} was made from it; the answers come from the text as it was then "
            f"('kvcli prefill {source}' extends the cache if the document only grew, '--force' rebuilds it)")
