"""Document -> cache directory: frame, run the model over the document in chunks, write the shards."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from .. import __version__

from .prompt import framing as fr
from .cache import layers

from ..format import manifest as mf, writing
from ..format.identity import FRAMING_KEYS
from ..documents import Document
from ..errors import DocumentError, ModelError, UsageError
from .model.models import LoadedModel

SHARED_SLICE = 256  # prefill tokens per turn while answers decode on the model (tests/bench/bench_stall.py)
DEFAULT_CHUNK = 1024  # near one forward's time at a fraction of its peak memory (docs/performance.md, chunk sizes measured)
ANSWER_ROOM = 320  # tokens kept free for a question and its answer
DEFAULT_LEVEL = 1  # zstd level: on byte planes of float32 caches, higher levels are slower and barely smaller
DEFAULT_TRANSFORM = "byteplane"
QUANT_GROUP = 64  # tokens (keys) / channels (values) per scale: chosen by measurement (docs/quantization.md)
QUANT_EXACT = {8: 4, 4: 32}  # first tokens kept in the compute dtype (attention sinks), per bit width: measured, same place
QUANT_RECENT = {8: 0, 4: 0}  # last tokens kept in the compute dtype (the recent window), per bit width: measured, same place

ProgressFn = Callable[[int, int], None]  # (tokens done, tokens total)
# Fingerprint fields that decide whether a cache still fits the model (those fit.check_fits reads).
FINGERPRINT_KEYS = ("model_type", "config_sha256", "weights_sha256", "tokenizer_sha256", "chat_template_sha256",
                    "dtype", "num_layers", "num_kv_heads", "head_dim", "max_positions", "weights")


@dataclass(frozen=True)
class PrefillResult:
    path: Path
    manifest: mf.Manifest
    compute_s: float  # model forward passes
    write_s: float  # compress + write + swap into place
    computed: int = 0  # tokens run through the model (fewer than the cache's when it extends or grew one)
    grown_from: int | None = None  # the tokens of the cache this one replaced by extending it (a document that grew)


def same_setup(m: mf.Manifest, lm: LoadedModel, framing: dict, kv_bits: int | None) -> bool:
    """Whether a cache was made by this model, with this framing asked for (its record before any cut), stored as
    asked (lossless, or quantized to kv_bits bits): all that decides a cache but the document."""
    if (m.quant or {}).get("bits") != kv_bits or m.framing.get("version") not in fr.SUPPORTED_VERSIONS:
        return False
    if any(m.model.get(k) != lm.fingerprint.get(k) for k in FINGERPRINT_KEYS):
        return False
    return all(m.framing.get(k) == framing.get(k) for k in FRAMING_KEYS)


def grew(m: mf.Manifest, document: Document) -> bool:
    """Whether the cache's document is a proper prefix of this one (its text, as UTF-8, hashes to the
    cache's document digest, of the same format and converter): the same document, grown."""
    return document.grew_from(m.document)


def document_token_ids(lm: LoadedModel, document: Document, framing: fr.Framing) -> list[int]:
    """Frame and tokenize a document, refusing one that leaves no room for a question and answer."""
    return document_split(lm, document, framing)[0]


def document_split(lm: LoadedModel, document: Document, framing: fr.Framing,
                   split: tuple[list[int], fr.Framing] | None = None) -> tuple[list[int], fr.Framing]:
    """The ids to cache and the framing (with where the cut falls) that questions follow; see engine/prompt/framing.py.
    split: those already made by the same tokenizer (the fit check before the model loaded), only checked."""
    ids, framing = split or fr.split_document(lm.tokenizer, framing, document.text)
    exc = too_long(document.name, len(ids), lm.max_positions)
    if exc is not None:
        raise exc
    return ids, framing


def too_long(name: str, tokens: int, limit: int | None) -> DocumentError | None:
    """The refusal of a document of `tokens` framed ids that leaves no room for a question and answer (counting
    raises it before any model loads, document_split after)."""
    if limit and tokens + ANSWER_ROOM > limit:
        return DocumentError(f"{name}: {tokens} tokens plus {ANSWER_ROOM} for a question and answer exceed "
                             f"the model's limit of {limit} positions")
    return None


def run_chunks(lm: LoadedModel, ids: list[int], chunk_size: int, progress: ProgressFn | None = None,
               timing: dict | None = None, cache=None, start: int = 0):
    """Forward the ids through the model chunk by chunk into a KVCache with room for the whole document.

    Full-attention layers get buffers for the whole document up front and each chunk's keys/values are
    written in place (no concatenation copying the growing cache at every chunk); with kvcli's attention
    (engine/model/attention.py) CPU attention reads grouped key/value heads directly. The chunked prefill then
    costs about what one forward pass over the whole document does, with far less memory. Each chunk
    takes the model's turn from its engine (engine/scheduling/scheduler.py): answers running on the same model
    step between two chunks, never wait for the whole document; while any are decoding, a chunk is cut to
    SHARED_SLICE tokens, so each pause is a fraction of a chunk (as vLLM's and llama.cpp's token budgets do, the
    cut depends on the load: the cache may then differ from an idle prefill's in the last bits, as it does
    between two chunk sizes; answers stay equal to a recompute). `timing`, if given, gets `forward_s` (the
    seconds inside the model's turns, waits excluded) and `sliced` (whether any chunk was cut).
    cache/start: a restored cache holding ids[:start] (a base, or the cache of a document that grew), run on
    from there; progress counts the tokens computed.
    """
    import torch

    from .cache.kvcache import KVCache
    from .scheduling.scheduler import engine_for

    engine = engine_for(lm)
    total = len(ids)
    if cache is None:
        cache, start = KVCache.for_model(lm.model.config, reserve=total), 0
    if progress:
        progress(0, total - start)  # the total is known before the first chunk: a bar shows 0/N, never 0/?
    forward_s, sliced, first = 0.0, False, start
    with torch.inference_mode():
        while start < total:
            with engine.turn():
                t0 = time.perf_counter()
                size = min(chunk_size, SHARED_SLICE) if engine.decoding else chunk_size
                sliced |= size < chunk_size and start + size < total
                chunk = torch.tensor([ids[start : start + size]], device=lm.device)  # [1, size]
                lm.model(input_ids=chunk, cache=cache, use_cache=True, logits_to_keep=1)
                forward_s += time.perf_counter() - t0
            start += size
            if progress:
                progress(min(start, total) - first, total - first)
    if timing is not None:
        timing.update(forward_s=forward_s, sliced=sliced)
    return cache


def prefill(
    lm: LoadedModel,
    document: Document,
    out: str | os.PathLike,
    *,
    system: str | None = None,
    framing: str = "auto",
    chunk_size: int = DEFAULT_CHUNK,
    force: bool = False,
    progress: ProgressFn | None = None,
    transform: str = DEFAULT_TRANSFORM,
    level: int = DEFAULT_LEVEL,
    compression: str | None = None,
    kv_bits: int | None = None,
    group_size: int = QUANT_GROUP,
    exact_tokens: int | None = None,
    recent_tokens: int | None = None,
    split: tuple[list[int], fr.Framing] | None = None,
    after: str | os.PathLike | None = None,
    extend: bool | None = None,
) -> PrefillResult:
    """Compute the document's cache and write it atomically to `out` (replacing only with force).

    after: a cache this one extends (a chain: `prefill --after`): it is restored, only this document's tokens
    run on top of it, and the new cache stores only theirs plus a link to it. extend: where `out` holds this
    document's cache from when it was shorter (same model, framing, base, lossless), only what was added is
    computed (from the first token whose id changed) and the grown cache replaces it; by default unless force
    (which then recomputes all).

    compression: "small" (the default) or "fast" (larger, restored faster: format/codec.py), else transform and level.
    kv_bits 8 or 4 stores it group-quantized (lossy, 4-8x smaller than raw; see format/quant.py);
    None (the default) stores it losslessly. split: the document's ids and framing from the fit check made
    with this model's tokenizer before it loaded (counting.Counter.refuse_too_long), so it is tokenized once."""
    if chunk_size < 1:
        raise UsageError(f"--chunk-size must be positive, got {chunk_size}")
    mf.check_kv_bits(kv_bits)
    if compression is not None:
        from ..format.codec import compression_spec

        transform, level = compression_spec(compression)
    if exact_tokens is None:
        exact_tokens = QUANT_EXACT.get(kv_bits, 0)
    if recent_tokens is None:
        recent_tokens = QUANT_RECENT.get(kv_bits, 0)
    if not 1 <= group_size <= mf.MAX_GROUP or exact_tokens < 0 or recent_tokens < 0:
        raise UsageError(f"quantization group size {group_size} / exact tokens {exact_tokens} / recent tokens "
                         f"{recent_tokens} out of range")
    asked = fr.choose(lm.tokenizer, framing, system)
    out = Path(out)
    with ExitStack() as stack:
        base = stack.enter_context(_open_base(lm, after, asked)) if after is not None else None
        if base is not None:  # the new text's ids after the base's, joined as one document
            new_ids, frame = fr.split_extension(lm.tokenizer, fr.Framing.from_record(base.manifest.framing),
                                                base.manifest.token_ids, document.text)
            ids = base.manifest.token_ids + new_ids
            exc = too_long(document.name, len(ids), lm.max_positions)
            if exc is not None:
                raise type(exc)(f"{exc}; a document extending a cache (--after) is not cut into sections: prefill it alone")
        else:
            ids, frame = document_split(lm, document, asked, split)
        grow = not force if extend is None else extend
        old = _grown_cache(out, lm, document, asked, kv_bits, base, stack) if grow else None
        with writing.atomic_cache_dir(out, force=force or old is not None) as tmp:
            t0 = time.perf_counter()
            timing: dict = {}
            restored, start = _resume(old or base, ids, lm)
            cache = run_chunks(lm, ids, chunk_size, progress, timing, cache=restored, start=start)
            t1 = time.perf_counter()
            if not timing["sliced"] and len(ids) > start:  # the model to itself: a speed count can go by
                _record_speed(lm, len(ids) - start, timing["forward_s"])
            states = layers.read(cache)
            del cache, restored
            if base is not None:  # a link stores its own tokens of every full layer (a window: the chain's last)
                b = base.manifest.num_tokens
                states = [layers.LayerState(s.kind, s.keys[:, :, b:], s.values[:, :, b:], s.seq_length, None)
                          if s.kind == "full" else s for s in states]
            stored = {"codec": "zstd", "level": level, "transform": transform}
            if kv_bits is not None:
                stored = {**stored, "transform": "none",
                          "quant": quant_spec(states, kv_bits, group_size=group_size, exact_tokens=exact_tokens,
                                             recent_tokens=recent_tokens)}
            entries = write_layers(tmp, states, len(ids), transform=stored["transform"], level=level,
                                   quant=stored.get("quant"))
            manifest = mf.Manifest(
                format_version=mf.FORMAT_VERSION,
                kvcli_version=__version__,
                transformers_version=_transformers_version(),
                created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                model={**lm.fingerprint, "source": lm.source},
                framing=frame.record(lm.tokenizer),
                document=document.record(),
                token_ids=ids,
                compression=stored,
                layers=entries,
                provenance=provenance(lm),
                base=_link(out, base) if base is not None else None,
            )
            writing.write_file(tmp, mf.MANIFEST_NAME, manifest.dumps())  # written last: no manifest, no cache
    return PrefillResult(path=out, manifest=manifest, compute_s=t1 - t0, write_s=time.perf_counter() - t1,
                         computed=len(ids) - start, grown_from=old.manifest.num_tokens if old is not None else None)


def _open_base(lm: LoadedModel, after: str | os.PathLike, asked: fr.Framing):
    """The cache a new one extends, its chain opened and checked against this model and the framing asked for."""
    from ..errors import CacheMismatchError
    from ..format import store
    from .model import fit

    opened = store.open_cache(after)
    try:
        fit.check_fits(opened.manifest, lm, str(after))
        if opened.manifest.quant is not None:
            raise CacheMismatchError(f"{after}: is stored {opened.manifest.storage} (lossy); a cache extends only a "
                                     "lossless one, so that its own keys/values are those of the whole prompt")
        record = asked.record(lm.tokenizer)
        if any(opened.manifest.framing.get(k) != record.get(k) for k in FRAMING_KEYS):
            raise CacheMismatchError(f"{after}: was made with another prompt framing (kind, system prompt or template) "
                                     "than the one asked for; a cache extends only one framed the same way")
    except BaseException:
        opened.close()
        raise
    return opened


def _grown_cache(out: Path, lm: LoadedModel, document: Document, asked: fr.Framing, kv_bits: int | None, base,
                 stack: ExitStack):
    """The cache at `out`, opened, if it holds an earlier, shorter version of this document made the same way
    (same model, framing, base, lossless storage): only what was added need be computed. None otherwise."""
    from ..errors import CacheError
    from ..format import store

    if not store.is_cache(out):
        return None
    try:
        old = store.open_cache(out)
    except CacheError:
        return None
    m = old.manifest
    same_base = (m.base or {}).get("manifest_sha256") == (base.manifest.digest if base is not None else None)
    if not (grew(m, document) and same_base and m.quant is None and kv_bits is None
            and same_setup(m, lm, asked.record(lm.tokenizer), None)):
        old.close()
        return None
    return stack.enter_context(old)


def _resume(opened, ids: list[int], lm: LoadedModel):
    """A cache restored from `opened` (a base, or the cache of a document that grew) holding the longest start of
    `ids` it can, and that length; (None, 0) when nothing can be kept. A sliding-window layer cannot be cut back
    (it no longer holds the tokens before its window): such a model resumes from the chain below, else from zero."""
    from .cache.kvcache import FullLayer
    from .cache.restore import load_cache

    while opened is not None:
        m = opened.manifest
        keep = _common(m.token_ids, ids)
        sliding = any(e.kind == "sliding" for e in m.layers)
        if keep >= m.base_tokens and (keep == m.num_tokens or not sliding) and keep > 0:
            cache = load_cache(opened, device=lm.device, dtype=lm.dtype, room=len(ids) - m.num_tokens)
            for layer in cache.layers:
                if isinstance(layer, FullLayer) and keep < m.num_tokens:
                    layer.crop(keep - m.num_tokens)  # [1, kv_heads, keep, head_dim] kept
            return cache, keep
        opened = opened.base
    return None, 0


def _common(a: list[int], b: list[int]) -> int:
    """Length of the longest common start of two id lists."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _link(out: Path, base) -> dict:
    """A link's record of its base: its digest, tokens, and path relative to the new cache's folder (absolute when
    the two share no root)."""
    target = base.path.resolve()
    try:
        recorded = os.path.relpath(target, out.resolve())
    except ValueError:  # another drive
        recorded = str(target)
    return {"manifest_sha256": base.manifest.digest, "path": recorded, "num_tokens": base.manifest.num_tokens}


def quant_spec(states: list[layers.LayerState], bits: int, *, group_size: int = QUANT_GROUP,
               exact_tokens: int | None = None, recent_tokens: int | None = None) -> dict:
    """The manifest's compression.quant block for these states (float32 scales only if float16 would overflow)."""
    from ..format.quant import choose_scale_dtype

    if exact_tokens is None:
        exact_tokens = QUANT_EXACT[bits]
    if recent_tokens is None:
        recent_tokens = QUANT_RECENT[bits]
    tensors = [t for s in states for t in (s.keys, s.values)]
    try:
        scale_dtype = choose_scale_dtype(tensors)
    except ValueError as exc:
        raise ModelError(str(exc)) from None
    return {"bits": bits, "group_size": group_size, "exact_tokens": exact_tokens, "recent_tokens": recent_tokens,
            "scale_dtype": scale_dtype, **mf.QUANT_AXES}


def write_layers(directory: Path, states: list[layers.LayerState], num_tokens: int, *, transform: str, level: int,
                 quant: dict | None = None) -> list[mf.LayerEntry]:
    """Compress and write every layer in parallel threads (zstd and torch copies release the GIL)."""
    from ..format.codec import encode_layer
    from ..format.store import shard_digest

    def one(i: int) -> mf.LayerEntry:
        state = states[i]
        keys, values = state.keys.detach().to("cpu"), state.values.detach().to("cpu")
        enc = encode_layer(keys, values, transform=transform, level=level, quant=quant)
        name = mf.shard_name(i)
        writing.write_file(directory, name, enc.data)
        return mf.LayerEntry(
            index=i,
            kind=state.kind,
            cached_length=keys.shape[-2],
            seq_length=state.seq_length,
            sliding_window=state.sliding_window,
            file=name,
            key_shape=tuple(keys.shape),
            value_shape=tuple(values.shape),
            raw_bytes=enc.raw_bytes,
            decoded_bytes=enc.decoded_bytes,
            stored_bytes=len(enc.data),
            digest=shard_digest(enc.data),  # format 3: BLAKE3 (store.SHARD_HASH)
        )

    with ThreadPoolExecutor(max_workers=min(len(states), os.cpu_count() or 2)) as pool:
        entries = list(pool.map(one, range(len(states))))
    for entry in entries:
        if entry.seq_length != num_tokens:
            raise RuntimeError(f"layer {entry.index} counted {entry.seq_length} tokens, expected {num_tokens}")
    return entries


def _record_speed(lm: LoadedModel, tokens: int, seconds: float) -> None:
    """Remember this prefill's speed for `kvcli count`'s estimates on this machine (engine/throughput.py)."""
    import torch

    from . import throughput
    from ..format.codec import dtype_name

    throughput.record(lm.source, dtype_name(lm.dtype), lm.device.type, tokens, seconds, threads=torch.get_num_threads())


def provenance(lm: LoadedModel) -> dict[str, str]:
    """What computes the keys/values here: torch build, device type, attention implementation."""
    import torch

    from .model import attention

    return {
        "torch_version": torch.__version__,
        "device_type": lm.device.type,
        "attn_implementation": attention.kernel_name(getattr(lm.model.config, "_attn_implementation", None)),
    }


def _transformers_version() -> str:
    import transformers

    return transformers.__version__
