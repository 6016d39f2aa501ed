"""Fuzz the cache reader: a damaged or crafted cache gives exit 3 and one error line, never more.

A real small cache is mutated many ways (byte flips, truncation, extension, manifest edits with and
without a recomputed checksum, type confusion, huge shapes, path traversal in shard names, symlinks,
FIFOs, crafted zstd/safetensors payloads whose sha256 is recomputed so the decoder itself is hit).
Each mutation runs through `kvcli verify` and `kvcli ask --model DIR`, in a worker process that
- caps its address space (RLIMIT_AS) a little above what a normal ask needs: a huge allocation fails;
- records every write-like file operation (audit hook) and every unpickling: none may happen outside
  the test's own temporary folder, and nothing is ever unpickled;
- checks that reading never changes the cache folder.
Seeded (KVCLI_FUZZ_SEED) and time-bounded (KVCLI_FUZZ_SECONDS for the random rounds, after the fixed
catalogue). Run this file alone with `python -m pytest tests/format/test_fuzz.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests import fuzz_cases
from tests.fuzz_cases import REPO, RANDOM_SECONDS, RSS_GROWTH_LIMIT, SEED


def _check(record: dict, reference: str) -> str | None:
    """None if the outcome is allowed, else why not."""
    if "mutate_error" in record:
        return f"mutation failed: {record['mutate_error']}"
    if record["changed"]:
        return "reading changed the cache folder"
    for cmd in ("verify", "ask"):
        r = record[cmd]
        if "Traceback" in r["stderr"] or "Traceback" in r["stdout"]:
            return f"{cmd}: traceback"
        ok_allowed = record["expect"] == "ok" or (record["expect"] == "model" and cmd == "verify")
        if r["code"] == 0:
            if not ok_allowed:
                return f"{cmd}: exit 0 for a bad cache"
            if cmd == "ask" and r["stdout"] != reference:
                return f"ask: answer {r['stdout']!r} differs from the pristine {reference!r}"
            continue
        if record["expect"] == "ok":
            return f"{cmd}: exit {r['code']} for a harmless change: {r['stderr'].strip()!r}"
        if r["code"] != 3:
            return f"{cmd}: exit {r['code']} (want 3): {r['stderr'].strip()!r}"
        lines = [line for line in r["stderr"].splitlines() if line.strip()]
        if len(lines) != 1 or not lines[0].startswith("kvcli: error: "):
            return f"{cmd}: stderr is not one error line: {r['stderr']!r}"
        if record["cache"] not in lines[0]:
            return f"{cmd}: error does not name the cache: {lines[0]!r}"
        if r["stdout"]:
            return f"{cmd}: wrote to stdout: {r['stdout']!r}"
    return None


def _run_worker(scratch: Path, pristine: Path, model: Path, seconds: float, quant: bool = False) -> list[dict]:
    """Run the fuzz worker in its own process; the results, after checking every one and the limits."""
    scratch.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCLI_", "HF_", "TRANSFORMERS_"))}
    env.update(HOME=str(scratch / "home"), KVCLI_HOME=str(scratch / "kvcli-home"), TMPDIR=str(scratch), HF_HOME=str(scratch / "hf"),
               HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", PYTHONDONTWRITEBYTECODE="1", PYTHONPATH=str(REPO),
               KVCLI_FUZZ_SEED=str(SEED), KVCLI_FUZZ_SECONDS=str(seconds),
               KVCLI_AUTOSTART="0")  # every ask in the worker itself, under its limits: no background server
    cfg = {"scratch": str(scratch), "pristine": str(pristine), "model": str(model), "quant": quant}
    proc = subprocess.run([sys.executable, fuzz_cases.__file__, json.dumps(cfg)], cwd=scratch, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((scratch / "results.json").read_text())
    results = summary["results"]
    failures = [(r["n"], r["label"], why) for r in results if (why := _check(r, summary["reference"]))]
    print(f"\nfuzz: {len(results)} cases in {summary['seconds']} s, address space capped at {summary['as_limit'] >> 20} MiB, "
          f"max RSS {summary['rss_before'] >> 20} -> {summary['rss_after'] >> 20} MiB")
    assert not failures, "\n".join(f"#{n} {label}: {why}" for n, label, why in failures[:40])
    assert not summary["violations"], summary["violations"]
    assert summary["rss_after"] - summary["rss_before"] < RSS_GROWTH_LIMIT
    return results


def test_fuzz_damaged_and_crafted_caches(pristine, tiny_model_dir, tmp_path):
    results = _run_worker(tmp_path / "scratch", pristine, tiny_model_dir, RANDOM_SECONDS)
    expects = [r["expect"] for r in results]
    assert expects.count("bad") > 300 and expects.count("model") >= 8 and expects.count("ok") >= 5
    labels = " ".join(r["label"] for r in results)
    for needle in ("bit flips", "truncated", "extended", "plain edit", "type confusion", "2**24", "'../", "symlink", "bomb", "random"):
        assert needle in labels, needle
    # nothing was written next to the pristine cache, and no temporary folder was left anywhere
    assert sorted(p.name for p in pristine.parent.iterdir()) == ["doc.txt", "pristine.kv"]


def test_fuzz_quantized_caches(pristine_q, tiny_model_dir, tmp_path):
    """The same worker on a 4-bit cache: its quantization fields and schemes, crafted payloads for its
    layout (lying headers, non-finite scales, bombs) and damage; a short random round after them."""
    results = _run_worker(tmp_path / "scratch", pristine_q, tiny_model_dir, min(RANDOM_SECONDS, 3.0), quant=True)
    expects = [r["expect"] for r in results]
    assert expects.count("bad") > 100 and "model" in expects and expects.count("ok") >= 2
    labels = " ".join(r["label"] for r in results)
    for needle in ("quant bits", "keys.codes", "keys.recent", "recent_tokens", "NaN", "bomb", "format version 1", "random"):
        assert needle in labels, needle
