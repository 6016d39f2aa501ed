"""A vLLM KV connector that serves kvcli caches: vLLM skips the prefill of any prompt that starts with one.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvcliConnector",
        "kv_connector_module_path": "kvcli.integrations.vllm", "kv_role": "kv_consumer",
        "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"caches": "DIR_OR_URL"}}'

Scheduler side (one instance, in vLLM's engine core): at start, every cache directly under `caches` (a
folder or any fsspec URL, as `kvcli ls`) is indexed by its stored prompt token ids, from manifests only,
and checked against the model vLLM serves with kvcli's fit rules (kvcli/integrations/caches.py; the model,
tokenizer and chat template hashes are recomputed from the served folder, fingerprint.py). A cache that
does not fit is logged once with the reason and never used. For a request, `get_num_new_matched_tokens`
reports the longest prefix of the prompt a cache holds, in whole blocks and never the whole prompt. The
first time a cache is matched its shards are verified (size, digest, decoded layout: kvcli.format.store.verify;
a remote cache is copied once into kvcli's local store, checked as it downloads); a cache that fails is
refused from then on, and the request is prefilled by vLLM as if there were no cache. Its manifest is read
again for every matched request: a cache replaced since it was indexed is indexed again, never mixed.

Worker side (each worker): for each request to load, the cache is opened again, its manifest checked to be
the one the scheduler matched, every layer's shard read (its digest checked before use: BLAKE3,
sha256 in formats 1 and 2) and decoded with kvcli's codec (bounded decompression, 8-/4-bit caches dequantized)
into temporary tensors, and only when every layer decoded are keys and values written into vLLM's paged buffers, through each attention layer's own
`impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)`: the call vLLM's attention makes to
store the keys and values it computed, so the backend's layout (block interiors, ISA-specific packing, KV
dtype scaling) is the backend's business, not assumed here. A load that fails reports its blocks through
`get_block_ids_with_load_errors`; with `"kv_load_failure_policy": "recompute"` vLLM computes them again.

Imports: vllm, torch, kvcli.format, kvcli.remote and kvcli.integrations only (no kvcli.engine, and
transformers only inside fingerprint.py's functions, at engine start).

Extra config (kv_connector_extra_config): `caches` (required), `allow_lossy` (load 8-/4-bit caches,
dequantized; default false), `unchecked` (fingerprint fields not to compare, e.g. ["weights_sha256"]:
an explicit operator choice), `stats_file` (append one JSON line per match, refusal and load: the
connector's counters). Per request (SamplingParams(extra_args={"kv_transfer_params": {...}})):
`{"kvcli": "skip"}` prefills without the connector (benchmarks).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

from .. import remote
from ..errors import KvcliError
from ..format import codec, manifest as mf, store
from . import caches as cx

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger("vllm.kvcli")  # under "vllm": vLLM's logging configuration shows it (kvcli.* would be dropped)


@dataclass
class LoadSpec:
    """One request's load: tokens [start, end) of the cache at `path` into the request's blocks."""

    req_id: str
    path: str  # local cache folder (a remote cache's copy in kvcli's local store)
    manifest_sha256: str
    start: int
    end: int
    block_ids: tuple[list[int], ...]  # per KV cache group


@dataclass
class KvcliConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)


def _layer_kinds(kv_cache_config: "KVCacheConfig") -> dict[str, tuple[str, int | None, Any, int]]:
    """layer name -> (kind, window, spec, group index), from vLLM's own KV cache config."""
    out = {}
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        per_layer = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
        for name in group.layer_names:
            s = per_layer[name] if per_layer else spec
            kind = type(s).__name__
            window = getattr(s, "sliding_window", None)
            if kind == "FullAttentionSpec" and getattr(s, "attention_chunk_size", None) is None:
                out[name] = ("sliding" if window else "full", window, s, g)
            elif kind == "SlidingWindowSpec":
                out[name] = ("sliding", window, s, g)
            else:
                out[name] = (kind, window, s, g)
    return out


def _layer_index(name: str) -> int:
    from vllm.model_executor.models.utils import extract_layer_index

    return extract_layer_index(name)


class KvcliConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        if not extra.get("caches"):
            raise ValueError("KvcliConnector: kv_connector_extra_config needs \"caches\": a folder or URL of kvcli caches")
        self._root = str(extra["caches"])
        self._block_size = vllm_config.cache_config.block_size
        self._stats = cx.stats_writer(extra.get("stats_file"))
        self._layers = _layer_kinds(kv_cache_config) if kv_cache_config is not None else {}
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler(vllm_config, extra)
        else:
            self._kv_caches: dict[str, torch.Tensor] = {}
            self._failed_blocks: set[int] = set()
            self._opened: dict[str, str] = {}

    # ------------------------------------------------------------------ scheduler side

    def _init_scheduler(self, vllm_config: "VllmConfig", extra: dict[str, Any]) -> None:
        from . import fingerprint

        started = time.perf_counter()
        self._pending: dict[str, LoadSpec] = {}
        self._ready: dict[str, tuple[str, tuple]] = {}  # location -> (local path, shard signature) once verified
        self._refused: dict[str, str] = {}
        mc = vllm_config.model_config
        text = mc.hf_text_config
        self._disabled = None
        if vllm_config.parallel_config.tensor_parallel_size != 1 or vllm_config.parallel_config.pipeline_parallel_size != 1:
            self._disabled = "tensor/pipeline parallel serving is not supported by this connector yet (heads and layers are not split)"
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            logger.warning("KvcliConnector: kv_load_failure_policy is %r: a cache that fails at load time (changed or damaged "
                           "after it was verified) fails its request; set \"kv_load_failure_policy\": \"recompute\" to have "
                           "vLLM prefill it instead", self._kv_transfer_config.kv_load_failure_policy)
        names = sorted(self._layers, key=_layer_index)
        kinds = tuple((self._layers[n][0], self._layers[n][1]) for n in names)
        specs = [self._layers[n][2] for n in names]
        heads = {getattr(s, "num_kv_heads", None) for s in specs}
        dims = {getattr(s, "head_size", None) for s in specs}
        try:
            hashes = fingerprint.of_folder(mc.model, revision=mc.revision, tokenizer=mc.tokenizer,
                                           trust_remote_code=mc.trust_remote_code)
        except Exception as exc:  # noqa: BLE001 (a model transformers cannot describe here: every cache refused, said why)
            logger.warning("KvcliConnector: cannot fingerprint %s (%s: %s); caches will be refused", mc.model,
                           exc.__class__.__name__, exc)
            hashes = {}
        self._engine = cx.EngineModel(
            model_type=getattr(mc.hf_config, "model_type", None),
            num_layers=getattr(text, "num_hidden_layers", None),
            num_kv_heads=heads.pop() if len(heads) == 1 else None,
            head_dim=dims.pop() if len(dims) == 1 else None,
            dtype=str(mc.dtype).removeprefix("torch."),
            block_size=self._block_size,
            layers=kinds,
            max_positions=getattr(text, "max_position_embeddings", None),
            vocab_size=getattr(text, "vocab_size", None),
            hashes=hashes,
            unchecked=frozenset(extra.get("unchecked") or ()),
            allow_lossy=bool(extra.get("allow_lossy", False)),
        )
        self._index, refused = self._build()
        logger.info("KvcliConnector: %d cache(s) under %s fit %s, %d refused (%.1f s)", len(self._index),
                    remote.shown(self._root), mc.model,
                    len(refused), time.perf_counter() - started)

    def _build(self) -> tuple[cx.CacheIndex, dict[str, str]]:
        if self._disabled:
            logger.warning("KvcliConnector: disabled: %s", self._disabled)
            return cx.CacheIndex(self._block_size), {}
        try:
            return cx.build_index(self._root, self._engine, log=self._refuse)
        except KvcliError as exc:
            logger.warning("KvcliConnector: cannot read caches at %s: %s", self._root, exc)
            return cx.CacheIndex(self._block_size), {}

    def _refuse(self, location: str, reason: str) -> None:
        """Log a refusal once per cache (and reason)."""
        if self._refused.get(location) == reason:
            return
        self._refused[location] = reason
        logger.warning("KvcliConnector: refusing cache %s: %s", remote.shown(location), reason)
        self._stats(event="refused", cache=remote.shown(location), reason=reason)

    def _drop(self, entry: cx.Entry) -> None:
        index = cx.CacheIndex(self._block_size)
        for e in self._index.entries:
            if e is not entry:
                index.add(e)
        self._index = index
        self._ready.pop(entry.location, None)

    def _prepare(self, entry: cx.Entry) -> str | None:
        """The local, verified folder of `entry`, or None (refused, logged). Re-reads the manifest every time."""
        try:
            if remote.is_url(entry.location):
                from ..remote import local_store

                local = str(local_store.fetch(entry.location))
            else:
                local = entry.location
            m = store.read_manifest(local, shards=True)
            sha = m.to_json()["manifest_sha256"]
            if sha != entry.manifest_sha256:
                return self._reindex(entry, local, m, sha)
            signature = tuple((os.stat(Path(local) / layer.file).st_size, os.stat(Path(local) / layer.file).st_mtime_ns)
                              for layer in m.layers)
            ready = self._ready.get(entry.location)
            if ready != (local, signature):
                started = time.perf_counter()
                store.verify(local)
                self._ready[entry.location] = (local, signature)
                self._stats(event="verified", cache=remote.shown(entry.location), seconds=round(time.perf_counter() - started, 4))
            return local
        except (KvcliError, OSError) as exc:
            self._refuse(entry.location, str(exc))
            self._drop(entry)
            return None

    def _reindex(self, entry: cx.Entry, local: str, m: mf.Manifest, sha: str) -> None:
        """The cache was replaced after it was indexed: drop the old entry, index the new manifest if it fits
        (verified on its next match); this request is prefilled by vLLM."""
        self._drop(entry)
        reason = cx.refusal(m, self._engine)
        self._refuse(entry.location, "the manifest changed since it was indexed (cache replaced); "
                                     + ("indexed again" if reason is None else f"the new one is refused: {reason}"))
        if reason is None:
            self._refused.pop(entry.location, None)
            self._index.add(cx.Entry(entry.location, m, sha))
        return None

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        params = getattr(request, "kv_transfer_params", None) or {}
        if params.get("kvcli") == "skip":
            return 0, False
        ids = list(request.prompt_token_ids or [])
        while True:
            hit = self._index.match(ids)
            if hit is None:
                return 0, False
            entry, n = hit
            local = self._prepare(entry)
            if local is not None:
                break
        new = n - num_computed_tokens
        self._stats(event="match", request=request.request_id, cache=remote.shown(entry.location), prompt_tokens=len(ids),
                    matched_tokens=n, local_computed=num_computed_tokens, load_tokens=max(new, 0))
        if new <= 0:
            return 0, False
        self._pending[request.request_id] = LoadSpec(request.request_id, local, entry.manifest_sha256,
                                                     num_computed_tokens, n, ())
        return new, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        if num_external_tokens <= 0:
            self._pending.pop(request.request_id, None)  # not loaded after all (e.g. no blocks): nothing to do

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KvcliConnectorMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            spec = self._pending.pop(new.req_id, None)
            if spec is None:
                continue
            spec.block_ids = tuple(list(b) for b in new.block_ids)
            meta.loads.append(spec)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            spec = self._pending.get(req_id)
            if spec is None or req_id not in cached.resumed_req_ids or cached.new_block_ids[i] is None:
                continue
            self._pending.pop(req_id)  # resumed after preemption: new_block_ids are all of its blocks
            spec.block_ids = tuple(list(b) for b in cached.new_block_ids[i])
            meta.loads.append(spec)
        # requests that were matched but not scheduled this step stay pending
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._pending.pop(request.request_id, None)
        return False, None

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._kv_caches = dict(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        # Called before the forward when this step has synchronous loads (ours always are), and also in the
        # steps vLLM runs without a forward (set_forward_context(None, ...): attn_metadata is None there);
        # nothing here reads attn_metadata: slots come from the scheduler's block ids, buffers and the
        # write from the attention layers themselves.
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvcliConnectorMetadata)
        if getattr(forward_context, "attn_metadata", None) is None:  # a step without a forward (ExampleConnector returns here)
            self._stats(event="no_forward_step", loads=len(meta.loads))
        for spec in meta.loads:
            started = time.perf_counter()
            try:
                n = self._load(spec, forward_context)
            except Exception as exc:  # noqa: BLE001 (any failure: vLLM recomputes these blocks, the server goes on)
                bad = {b for group in spec.block_ids for b in group[spec.start // self._block_size:
                                                                    -(-spec.end // self._block_size)]}
                self._failed_blocks |= bad
                logger.warning("KvcliConnector: loading %s for request %s failed, %d block(s) left to vLLM: %s",
                               spec.path, spec.req_id, len(bad), exc)
                self._stats(event="load_failed", request=spec.req_id, cache=spec.path, error=str(exc))
                continue
            self._stats(event="loaded", request=spec.req_id, cache=spec.path, tokens=n, start=spec.start,
                        seconds=round(time.perf_counter() - started, 4))

    def _load(self, spec: LoadSpec, forward_context: "ForwardContext") -> int:
        layers = forward_context.no_compile_layers
        with store.open_cache(spec.path) as cache:
            m = cache.manifest
            if m.to_json()["manifest_sha256"] != spec.manifest_sha256:
                raise KvcliError(f"{spec.path}: manifest changed since the scheduler matched it (cache replaced)")
            dtype = codec.DTYPES[m.dtype]
            decoded: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
            for name in self._kv_caches:
                kind, _window, _spec, _group = self._layers[name]
                i = _layer_index(name)
                entry = m.layers[i]
                data = cache.read_shard(i)  # size and sha256 checked against the manifest before use
                k, v = codec.decode_layer(data, name=str(cache.path / entry.file), transform=m.transform, dtype=dtype,
                                          key_shape=entry.key_shape, value_shape=entry.value_shape,
                                          decoded_bytes=entry.decoded_bytes, quant=m.quant)
                del data
                # [1, heads, tokens, dim] -> [tokens, heads, dim] for the tokens to load
                decoded[name] = (k[0, :, spec.start:spec.end].transpose(0, 1).contiguous(),
                                 v[0, :, spec.start:spec.end].transpose(0, 1).contiguous())
        # every layer decoded: now write (never half a cache into the paged buffers)
        pos = torch.arange(spec.start, spec.end, dtype=torch.long)
        for name, (k, v) in decoded.items():
            layer = layers[name]
            group = self._layers[name][3]
            blocks = torch.tensor(spec.block_ids[group], dtype=torch.long)
            slots = blocks[pos // self._block_size] * self._block_size + pos % self._block_size
            kv_cache = layer.kv_cache
            if kv_cache.data_ptr() != self._kv_caches[name].data_ptr():
                raise KvcliError(f"layer {name}: its kv_cache is not the buffer vLLM registered")
            layer.impl.do_kv_cache_update(layer, k.to(kv_cache.device), v.to(kv_cache.device), kv_cache,
                                          slots.to(kv_cache.device))
        return spec.end - spec.start

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous, done in start_load_kv before the forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # a consumer: kvcli prefill writes caches, vLLM does not

    def wait_for_save(self):
        return  # nothing is saved (save_kv_layer)

    def get_block_ids_with_load_errors(self) -> set[int]:
        bad, self._failed_blocks = self._failed_blocks, set()
        return bad
