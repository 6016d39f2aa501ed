"""A hub id when the hub cannot be reached: loaded from the local hub cache, or refused at once in one line,
never after the hub client's retries. Whether the hub answers is probed with one quick
connection (through the proxy the environment names, if any), at most once a minute; HF_HUB_OFFLINE counts
as unreachable. Nothing here writes the environment: offline loading is from_pretrained's own argument."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from typing import Any
from urllib.parse import urlsplit

from ...errors import ModelError

PROBE_S = 3.0  # the longest the probe waits for a connection (name lookup included)
REPROBE_S = 60.0  # a long-running server asks again after this long
_probed: dict[str, tuple[float, bool]] = {}  # endpoint -> (when, reachable)
LOCAL_HINT = "pass --model with a local model folder or a .gguf file"


def load_args(source: dict[str, Any]) -> dict[str, Any]:
    """from_pretrained's keyword arguments for a model source: its revision, and for a hub id that the hub cannot
    serve now, local_files_only (ModelError at once when the local hub cache does not hold it either)."""
    args = {"revision": source.get("revision")}
    if source.get("kind") != "hub":
        return args
    from huggingface_hub import constants, try_to_load_from_cache

    endpoint = constants.ENDPOINT
    if not constants.HF_HUB_OFFLINE and reachable(endpoint):
        return args
    if not isinstance(try_to_load_from_cache(source["id"], "config.json", revision=source.get("revision")), str):  # not cached
        why = "the hub is offline (HF_HUB_OFFLINE)" if constants.HF_HUB_OFFLINE else f"the hub ({endpoint}) cannot be reached"
        raise ModelError(f"model '{source['id']}' is not in the local hub cache and {why}", hint=LOCAL_HINT)
    return {**args, "local_files_only": True}


def reachable(endpoint: str) -> bool:
    """Whether a connection to the endpoint (or the proxy for it) opens within PROBE_S; remembered a minute."""
    now = time.monotonic()
    seen = _probed.get(endpoint)
    if seen is not None and now - seen[0] < REPROBE_S:
        return seen[1]
    url = urlsplit(endpoint)
    host, port = url.hostname or "", url.port or (443 if url.scheme == "https" else 80)
    proxy = urllib.request.getproxies().get(url.scheme)
    if proxy and not urllib.request.proxy_bypass(host):
        via = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        host, port = via.hostname or "", via.port or 80
    result: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=PROBE_S).close()
            result.append(True)
        except (OSError, ValueError):
            pass

    thread = threading.Thread(target=probe, name="kvcli-hub-probe", daemon=True)  # a name lookup has no timeout of its own
    thread.start()
    thread.join(PROBE_S)
    _probed[endpoint] = (now, bool(result))
    return bool(result)
