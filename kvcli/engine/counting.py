"""Know before you pay: a document's tokens, its cache's size, the room left and the prefill's time, from the
config and tokenizer only.

No weights are loaded and nothing runs through the model. Where the model folder allows it (engine/model/light.py)
torch is not imported either. Sizes on disk are estimates from ratios measured in this repository
(docs/performance.md); times come from this machine's recorded prefills (engine/throughput.py), else a rough curve.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .prompt import framing as fr
from .model import light, models
from .model.fingerprint import shape, text_config
from . import throughput
from .prefilling import too_long
from ..documents import Document
from ..format.dtypes import ITEM_SIZES as ITEMSIZE

# stored / raw for byte planes + zstd level 1, measured on the default model's caches (docs/performance.md)
DISK_RATIO = {"float32": 0.83, "bfloat16": 0.67, "float16": 0.84}
LIGHT = "config.json and tokenizer only (no torch)"


@dataclass
class Count:
    document: str
    tokens: int  # the framed document's ids: what the cache holds
    dtype: str
    bytes_raw: int  # keys and values of every layer
    bytes_on_disk_estimate: int
    max_positions: int | None
    room: int | None  # positions left for a question and its answer
    fits: bool  # room for kvcli's minimum question-and-answer reserve
    prefill_s_estimate: float | None  # None until 3 records give its range, and for a document too long to prefill
    prefill_s_basis: str  # "N prefills on this machine", or the rough curve (engine/throughput.py)
    prefill_s_error: float | None  # relative spread of those records around the estimate (3 or more records)
    prefill_s_reason: str | None  # why no estimate is stated (None when one is)
    prefill_s_range: tuple[float, float] | None = None  # the estimate's low and high, from the records' own misses
    format: str = "text"  # the document's format ("text", "pdf", "html", "docx", "epub")
    pages: int | None = None  # a PDF's pages
    sections: int | None = None  # headings kept (HTML, DOCX, EPUB)
    window: int | None = None  # positions a question's prompt may use: the model's, or a smaller --window
    sectioned: int | None = None  # longer than the window: the sections prefill cuts it into (None: one cache, or refused)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class Counter:
    """A model's tokenizer and config, loaded once for counting many documents."""

    def __init__(self, model: str | None = None, *, revision: str | None = None, dtype: str = "auto",
                 framing: str = "auto", system: str | None = None, trust_remote_code: bool = False,
                 window: int | None = None):
        """window: positions a question's prompt may use (prefill --window), at most the model's."""
        from .sections.build import window_limit

        source = models.resolve(model, revision=revision)
        folder = _light_folder(source)
        got = light.load(folder) if folder is not None else "no local model folder yet"
        if isinstance(got, tuple):
            self.config, self.tokenizer, self.plan = got
            self.loaded = LIGHT
        else:
            from .cache import layers

            # layers.plan refuses models kvcli cannot cache, as prefill would (before their tokenizer is read)
            self.config, self.tokenizer = models.config_and_tokenizer(source, trust_remote_code=trust_remote_code,
                                                                      check=layers.plan)
            self.plan = layers.plan(self.config)
            self.loaded = f"config and tokenizer through transformers, torch imported ({got})"
        self.source = source
        self.framing = fr.choose(self.tokenizer, framing, system)
        self.dtype = _dtype_name(dtype, self.config)
        s = shape(self.config)  # as the loaded model's fingerprint will say
        self.kv_heads, self.head_dim, self.max_positions = s["num_kv_heads"], s["head_dim"], s["max_positions"]
        self.window = window_limit(self.max_positions, window)
        self.params = _parameter_count(self.config, source)
        devices = ["cuda", "mps", "cpu"] if _maybe_accelerator() else ["cpu"]
        self.records = next((r for d in devices if (r := throughput.records(source, self.dtype, d))), [])
        on_cpu = not _maybe_accelerator() or models.pick_device("auto") == "cpu"
        self.dtype_advice = throughput.dtype_advice(source, self.dtype) if on_cpu else None

    def tokens(self, document: Document) -> int:
        """The framed document's ids, as prefill would cache them."""
        return len(fr.document_ids(self.tokenizer, self.framing, document.text))

    def refuse_too_long(self, document: Document) -> tuple[list[int], fr.Framing]:
        """The DocumentError prefill would raise for this document after loading the model, raised now; else
        the document's ids and framing (fr.split_document), which prefill caches without tokenizing it again."""
        split = fr.split_document(self.tokenizer, self.framing, document.text)
        exc = too_long(document.name, len(split[0]), self.max_positions)
        if exc is not None and not self.sectioned():
            raise exc
        return split

    def sectioned(self) -> bool:
        """Whether a document longer than the window becomes a sectioned cache with this model (its keys move by one
        rotation: engine/cache/blend.py; checked again on the loaded model)."""
        from .cache.blend import SUPPORTED_TYPES

        return getattr(self.config, "model_type", None) in SUPPORTED_TYPES and all(k == "full" for k, _w in self.plan)

    def count(self, document: Document) -> Count:
        n = self.tokens(document)
        per_token = 2 * self.kv_heads * self.head_dim * ITEMSIZE[self.dtype]  # keys + values
        raw = sum(per_token * (n if kind == "full" else min(n, window - 1)) for kind, window in self.plan)
        room = self.window - n if self.window else None
        est = throughput.estimate(n, self.records, self.params)
        fits = too_long(document.name, n, self.window) is None
        cut = None if fits or not self.sectioned() else self.sections_of(document)
        reason = est.withheld if fits or cut else "too long for the model: prefill would refuse it"
        return Count(document=document.name, tokens=n, dtype=self.dtype, bytes_raw=raw,
                     bytes_on_disk_estimate=round(raw * DISK_RATIO[self.dtype]), max_positions=self.max_positions,
                     room=room, fits=fits, prefill_s_estimate=None if reason else est.seconds, prefill_s_basis=est.basis,
                     prefill_s_error=est.error, prefill_s_reason=reason,
                     prefill_s_range=None if reason or est.low is None else (est.low, est.high),
                     format=document.format, pages=document.pages, sections=document.sections, window=self.window,
                     sectioned=cut)

    def sections_of(self, document: Document) -> int:
        """How many sections prefill cuts a document longer than the window into (engine/sections/cutting.py)."""
        from .sections import cutting

        def count(texts):
            return [len(ids) for ids in self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]] if texts else []

        return len(cutting.cut(document.text, count))


def fit_check(model: str | None = None, *, revision: str | None = None, framing: str = "auto", system: str | None = None,
              trust_remote_code: bool = False):
    """For prefill's front ends: the check that refuses a document too long for the model before its weights
    load (a Counter: config and tokenizer only); it returns the ids and framing prefill then caches."""
    return Counter(model, revision=revision, framing=framing, system=system, trust_remote_code=trust_remote_code).refuse_too_long


def _light_folder(source: dict) -> Path | None:
    """The local folder holding the model's config.json and tokenizer files, if there is one already."""
    if source["kind"] == "folder":
        return Path(source["path"])
    if source["kind"] in ("default", "gguf"):
        return next((f for f in models.gguf_folders(source["sha256"]) if (f / "config.json").is_file()), None)
    return None


def _dtype_name(dtype: str, config: Any) -> str:
    """The dtype prefill would compute in (auto: float32 on CPU, the model's own on an accelerator); torch is
    imported only when an accelerator may be there to ask about."""
    if dtype != "auto":
        return dtype
    if not _maybe_accelerator():
        return "float32"
    from ..format.codec import dtype_name

    return dtype_name(models.pick_dtype(dtype, models.pick_device("auto"), config))


def _maybe_accelerator() -> bool:
    """Whether a CUDA or MPS device might be present, without importing torch (false: surely the CPU)."""
    import glob
    import platform
    import sys

    if "torch" in sys.modules:
        return True
    return bool(glob.glob("/dev/nvidia[0-9]*") or glob.glob("/dev/dxg") or os.path.exists("/proc/driver/nvidia")) or (
        sys.platform == "darwin" and platform.machine() == "arm64")


def _parameter_count(config: Any, source: dict) -> int | None:
    """Parameters, without weights or torch: the safetensors headers of a local model folder (exact), else
    from the config for a llama-like decoder (embeddings, attention, MLP, norms; within a few percent)."""
    folder = _light_folder(source)
    return (_safetensors_count(folder) if folder is not None else None) or _config_count(config)


def _safetensors_count(folder) -> int | None:
    """Sum of the tensors' element counts in *.safetensors headers (8-byte length, then JSON)."""
    import json
    import math
    import struct

    total = 0
    for f in sorted(folder.glob("*.safetensors")):
        try:
            with open(f, "rb") as fh:
                (size,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(size))
        except (OSError, ValueError, struct.error):
            return None
        total += sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    return total or None


def _config_count(config: Any) -> int | None:
    text = text_config(config)
    try:
        h, layers_n, vocab = text.hidden_size, text.num_hidden_layers, text.vocab_size
        heads = text.num_attention_heads
        kv = getattr(text, "num_key_value_heads", None) or heads
        hd = getattr(text, "head_dim", None) or h // heads
        inter = getattr(text, "intermediate_size", None) or 4 * h
    except (AttributeError, TypeError, ZeroDivisionError):
        return None
    mlp = (3 if getattr(text, "hidden_act", "silu") in ("silu", "swiglu") else 2) * h * inter
    per_layer = h * heads * hd * 2 + 2 * h * kv * hd + mlp + 2 * h
    tied = getattr(config, "tie_word_embeddings", True)
    return vocab * h * (1 if tied else 2) + layers_n * per_layer + h
