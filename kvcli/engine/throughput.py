"""Prefill speed as measured on this machine: every prefill records its tokens and seconds under KVCLI_HOME,
and `kvcli count` estimates a document's prefill from the records of the same model, dtype, device and CPU.

A time grows as n * (a + b * n) (per-token work, plus attention over every earlier position). Records of
lengths that differ enough fit a and b for this machine, used for lengths around them; otherwise the records
nearest in length set the scale of the reference curve (the median of measured / curve). How far off an estimate
is comes from the records themselves: each one estimated from the others (leave one out), its time over that
estimate, gives the range stated beside the estimate and its largest miss (from 3 records on). Without records the
curve alone is used, scaled by parameter count from the 135M default model on a 2-core CPU. An estimate is stated
once its range is known; otherwise `withheld` says why not.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..format.identity import sha256_json
from ..home import kvcli_home, remember

# The curve's shape, fitted to the 135M default model's recompute times on a 2-core CPU (`kvcli bench
# samples/document.txt --tokens 1024 --tokens 4096`), and that model's parameters (the scale for other models).
A, B, REF_PARAMS = 1.44e-3, 2.4e-7, 134.5e6
MIN_TOKENS = 256  # shorter prefills are mostly fixed costs: not recorded
KEEP = 32  # records kept per model, dtype, device and machine
NEAREST = 5  # records (nearest in length) that set the scale
SPAN = 1.5  # records whose lengths differ this much fit this machine's own a + b * n, for lengths around them
ROUGH_BASIS = "a rough curve (the 135M default model on a 2-core CPU, scaled by parameter count)"
MIN_RECORDS = 3  # records needed before a range (and so an estimate) is stated


@dataclass(frozen=True)
class Estimate:
    seconds: float | None
    basis: str  # "N prefills on this machine" or ROUGH_BASIS
    error: float | None  # the largest relative miss of this estimator on the records, each left out in turn (3 or more)
    records: int
    low: float | None = None  # the estimate times the smallest and the largest (measured / estimated) of those misses
    high: float | None = None

    @property
    def withheld(self) -> str | None:
        """Why this estimate is not to be stated (None: it is): no records, too few to know its error, or too far off."""
        if not self.records:
            return "no prefill of this model recorded on this machine yet"
        if self.error is None:
            return f"{self.basis}; {MIN_RECORDS} are needed to know how far off an estimate is"
        return None


def curve(n: int) -> float:
    return n * (A + B * n)


def _cpuinfo(key: str) -> str:
    """The first value of `key` in /proc/cpuinfo (Linux), or ""."""
    try:
        lines = Path("/proc/cpuinfo").read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith(key)), "")


def machine() -> dict[str, Any]:
    """What makes prefill speed differ between machines, as far as it is known without torch."""
    cpu = _cpuinfo("model name")
    if not cpu:
        import platform

        cpu = platform.processor() or platform.machine()
    return {"cpu": cpu, "cpus": os.cpu_count(), "omp_threads": os.environ.get("OMP_NUM_THREADS")}


NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # x86 CPU flags of native bfloat16 arithmetic


def native_bfloat16() -> str | None:
    """The CPU flag that says this machine computes bfloat16 natively (x86 Linux), or None."""
    flags = set(_cpuinfo("flags").split())
    return next((f for f in NATIVE_BF16_FLAGS if f in flags), None)


def dtype_advice(source: dict[str, Any], dtype: str, device: str = "cpu") -> str | None:
    """Which of float32 and bfloat16 prefills faster here, from this machine's records of both, or how to find
    out; None where the CPU has no native bfloat16. Advice only: a cache's dtype is part of its identity."""
    if device != "cpu" or dtype not in ("float32", "bfloat16") or not (flag := native_bfloat16()):
        return None
    other = "bfloat16" if dtype == "float32" else "float32"
    mine, theirs = records(source, dtype, device), records(source, other, device)
    if not mine or not theirs:
        return (f"this CPU computes bfloat16 natively ({flag}); `kvcli bench DOC --dtype float32 --dtype bfloat16` "
                "measures which dtype is faster here")
    n = int(statistics.median([r["tokens"] for r in mine + theirs]))
    a, b = estimate(n, mine).seconds, estimate(n, theirs).seconds
    if not a or not b:
        return None
    faster, ratio = (dtype, b / a) if a <= b else (other, a / b)
    return (f"on this machine {faster} prefills {ratio:.2f}x as fast as {other if faster == dtype else dtype} "
            f"({len(mine) + len(theirs)} recorded prefills, around {n:,} tokens); `kvcli bench` also times decode")


def model_key(source: dict[str, Any]) -> str | None:
    """The model, as both prefill (after loading) and count (before) name it; None for an in-memory model."""
    if source.get("sha256"):  # a GGUF model; its q4 weights prefill at another speed (engine/model/stored.py)
        return f"sha256:{source['sha256']}" + (f"+{source['weights']}" if source.get("weights", "float") != "float" else "")
    field = {"folder": "path", "hub": "id"}.get(source.get("kind"))  # what names a folder or a hub model
    return f"{source['kind']}:{source.get(field)}" if field else None


def _path(key: str, dtype: str, device: str) -> Path:
    return kvcli_home() / "throughput" / f"{sha256_json([key, dtype, device, machine()])[:32]}.json"


def records(source: dict[str, Any], dtype: str, device: str) -> list[dict[str, Any]]:
    """This machine's recorded prefills of this model in this dtype on this device type."""
    key = model_key(source)
    if key is None:
        return []
    try:
        data = json.loads(_path(key, dtype, device).read_text())
        return [r for r in data["records"] if r["tokens"] > 0 and r["seconds"] > 0]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def record(source: dict[str, Any], dtype: str, device: str, tokens: int, seconds: float, threads: int | None = None) -> None:
    """Add one measured prefill (compute only: forward passes, not writing); never fails the prefill."""
    key = model_key(source)
    if key is None or tokens < MIN_TOKENS or seconds <= 0:
        return
    kept = records(source, dtype, device)[-(KEEP - 1):]
    kept.append({"tokens": tokens, "seconds": round(seconds, 4), "threads": threads, "at": round(time.time())})
    body = {"model": key, "dtype": dtype, "device": device, "machine": machine(), "records": kept}
    remember(_path(key, dtype, device), json.dumps(body, indent=1) + "\n")


def estimate(tokens: int, recs: list[dict[str, Any]], params: int | None = None) -> Estimate:
    """Seconds to prefill `tokens` from these records (see the module's docstring), else the rough curve."""
    if not recs:
        if not params:
            return Estimate(None, ROUGH_BASIS, None, 0)
        return Estimate(curve(tokens) * params / REF_PARAMS, ROUGH_BASIS, None, 0)
    basis = f"{len(recs)} prefill{'s' if len(recs) != 1 else ''} on this machine"
    seconds = _point(tokens, recs)
    if len(recs) < MIN_RECORDS:
        return Estimate(seconds, basis, None, len(recs))
    ratios = [r["seconds"] / _point(r["tokens"], recs[:i] + recs[i + 1:]) for i, r in enumerate(recs)]
    error = max(abs(q - 1) for q in ratios)
    return Estimate(seconds, basis, error, len(recs), seconds * min(min(ratios), 1.0), seconds * max(max(ratios), 1.0))


def _point(tokens: int, recs: list[dict[str, Any]]) -> float:
    """The estimate itself: this machine's fitted curve for lengths around those measured, else the curve scaled by
    the records nearest in length."""
    import math

    lengths = [r["tokens"] for r in recs]
    fitted = _fit(recs) if max(lengths) >= SPAN * min(lengths) and min(lengths) / SPAN <= tokens <= max(lengths) * SPAN else None
    if fitted is not None:
        a, b = fitted
        return a * tokens + b * tokens ** 2
    near = sorted(recs, key=lambda r: abs(math.log(r["tokens"] / max(tokens, 1))))[:NEAREST]
    return statistics.median([r["seconds"] / curve(r["tokens"]) for r in near]) * curve(tokens)


def _fit(recs: list[dict[str, Any]]) -> tuple[float, float] | None:
    """a, b of t = a * n + b * n^2 by least squares on relative error (both at least 0), or None."""
    sxx = sxy = syy = sx = sy = 0.0
    for r in recs:
        x, y = r["tokens"] / r["seconds"], r["tokens"] ** 2 / r["seconds"]  # a * x + b * y should be 1
        sxx, sxy, syy, sx, sy = sxx + x * x, sxy + x * y, syy + y * y, sx + x, sy + y
    det = sxx * syy - sxy * sxy
    if det <= 0:
        return None
    a, b = (sx * syy - sy * sxy) / det, (sy * sxx - sx * sxy) / det
    return (a, b) if a >= 0 and b >= 0 else None
