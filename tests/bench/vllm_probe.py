"""KvcliConnector plus a probe, for tests/integrations/test_vllm.py: vllm_run.py points vLLM at this module when its config
has a "probe_dir". Runs inside the vLLM venv.

A request whose kv_transfer_params carry {"probe": TAG} has its KV blocks, as vLLM's paged buffers hold them
after its first forward, copied to probe_dir/TAG.pt ({layer name: its blocks}); everything else is
KvcliConnector's own behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvcli.integrations.vllm import KvcliConnector, KvcliConnectorMetadata


@dataclass
class ProbeMetadata(KvcliConnectorMetadata):
    probes: list[tuple[str, tuple[list[int], ...]]] = field(default_factory=list)  # (tag, block ids per KV cache group)


class ProbingConnector(KvcliConnector):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self._probe_dir = Path(self._kv_transfer_config.kv_connector_extra_config["probe_dir"])
        self._tags: dict[str, str] = {}  # scheduler: request id -> tag
        self._groups = {name: g for g, group in enumerate(kv_cache_config.kv_cache_groups)
                        for name in group.layer_names} if kv_cache_config is not None else {}
        self._buffers: dict[str, torch.Tensor] = {}

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        tag = (getattr(request, "kv_transfer_params", None) or {}).get("probe")
        if tag:
            self._tags[request.request_id] = tag
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def build_connector_meta(self, scheduler_output):
        meta = super().build_connector_meta(scheduler_output)
        probes = [(self._tags.pop(new.req_id), tuple(list(b) for b in new.block_ids))
                  for new in scheduler_output.scheduled_new_reqs if new.req_id in self._tags]
        return ProbeMetadata(loads=meta.loads, probes=probes)

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        self._tags.pop(request.request_id, None)
        return super().request_finished(request, block_ids)

    def register_kv_caches(self, kv_caches):
        super().register_kv_caches(kv_caches)
        self._buffers = dict(kv_caches)

    def wait_for_save(self):
        super().wait_for_save()
        for tag, block_ids in self._get_connector_metadata().probes:
            out = {name: t[torch.tensor(block_ids[self._groups[name]], dtype=torch.long)].clone()
                   for name, t in self._buffers.items()}
            torch.save(out, self._probe_dir / f"{tag}.pt")
