"""Document -> cache directory: frame, run the model over the document in chunks, write the shards."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from .. import __version__

from .prompt import framing as fr
from .cache import layers

from ..format import manifest as mf, writing
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


@dataclass(frozen=True)
class PrefillResult:
    path: Path
    manifest: mf.Manifest
    compute_s: float  # model forward passes
    write_s: float  # compress + write + swap into place


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
               timing: dict | None = None):
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
    """
    import torch

    from .cache.kvcache import KVCache
    from .scheduling.scheduler import engine_for

    engine = engine_for(lm)
    total = len(ids)
    cache = KVCache.for_model(lm.model.config, reserve=total)
    if progress:
        progress(0, total)  # the total is known before the first chunk: a bar shows 0/N, never 0/?
    start, forward_s, sliced = 0, 0.0, False
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
                progress(min(start, total), total)
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
    kv_bits: int | None = None,
    group_size: int = QUANT_GROUP,
    exact_tokens: int | None = None,
    recent_tokens: int | None = None,
    split: tuple[list[int], fr.Framing] | None = None,
) -> PrefillResult:
    """Compute the document's cache and write it atomically to `out` (replacing only with force).

    kv_bits 8 or 4 stores it group-quantized (lossy, 4-8x smaller than raw; see format/quant.py);
    None (the default) stores it losslessly. split: the document's ids and framing from the fit check made
    with this model's tokenizer before it loaded (counting.Counter.refuse_too_long), so it is tokenized once."""
    if chunk_size < 1:
        raise UsageError(f"--chunk-size must be positive, got {chunk_size}")
    mf.check_kv_bits(kv_bits)
    if exact_tokens is None:
        exact_tokens = QUANT_EXACT.get(kv_bits, 0)
    if recent_tokens is None:
        recent_tokens = QUANT_RECENT.get(kv_bits, 0)
    if not 1 <= group_size <= mf.MAX_GROUP or exact_tokens < 0 or recent_tokens < 0:
        raise UsageError(f"quantization group size {group_size} / exact tokens {exact_tokens} / recent tokens "
                         f"{recent_tokens} out of range")
    frame = fr.choose(lm.tokenizer, framing, system)
    ids, frame = document_split(lm, document, frame, split)
    out = Path(out)
    with writing.atomic_cache_dir(out, force=force) as tmp:
        t0 = time.perf_counter()
        timing: dict = {}
        cache = run_chunks(lm, ids, chunk_size, progress, timing)
        t1 = time.perf_counter()
        if not timing["sliced"]:  # the model to itself: a speed count can go by (its waits for turns left out)
            _record_speed(lm, len(ids), timing["forward_s"])
        states = layers.read(cache)
        del cache
        compression = {"codec": "zstd", "level": level, "transform": transform}
        if kv_bits is not None:
            compression = {**compression, "transform": "none",
                           "quant": quant_spec(states, kv_bits, group_size=group_size, exact_tokens=exact_tokens,
                                              recent_tokens=recent_tokens)}
        entries = write_layers(tmp, states, len(ids), transform=compression["transform"], level=level,
                               quant=compression.get("quant"))
        manifest = mf.Manifest(
            format_version=mf.FORMAT_VERSION,
            kvcli_version=__version__,
            transformers_version=_transformers_version(),
            created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            model={**lm.fingerprint, "source": lm.source},
            framing=frame.record(lm.tokenizer),
            document=document.record(),
            token_ids=ids,
            compression=compression,
            layers=entries,
            provenance=provenance(lm),
        )
        writing.write_file(tmp, mf.MANIFEST_NAME, manifest.dumps())  # written last: no manifest, no cache
    return PrefillResult(path=out, manifest=manifest, compute_s=t1 - t0, write_s=time.perf_counter() - t1)


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
