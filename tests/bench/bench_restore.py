"""Restore speed against the machine's own limits (issue 25; a script, not collected by pytest):

    python tests/bench/bench_restore.py [--cache DIR] [--repeats N] [--threads N] [--json]

With no --cache, the sample document is cut (repeated) to 4,096 framed tokens and prefilled with the
default model (float32, the default lossless codec) into tests/bench/.bench-restore/doc-4096.kv, reused by later
runs. Everything is measured warm: every shard file is read once first, nothing is dropped from the page
cache. Reported, each the median of --repeats runs, in GB/s:

- page-cache read of the shard files (os.readv into one reused buffer per thread, all threads),
- hash of the stored bytes (the manifest's shard hash, all threads),
- decompress + transform into final buffers (no reading, no hash, all threads),
- full restore (kvcli.engine.cache.restore.load_cache: open, read, verify, decode into the cache object),
  as raw cache bytes / seconds, plus its ratio to the page-cache read speed.

Stored-byte rates count shard bytes; "raw" rates count the tensors' bytes. CPU model, flags of interest,
thread count and the load average (before and after) are printed with the numbers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
SAMPLES = HERE.parents[1] / "samples"
WORK = HERE / ".bench-restore"


def cpu_info() -> dict:
    model, flags = "?", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == "?":
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    wanted = ("sse4_2", "avx", "avx2", "avx512f", "sha_ni", "bmi2")
    return {"model": model, "flags": [f for f in wanted if f in flags], "cpus": os.cpu_count(),
            "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()}


def build_cache(path: Path, tokens: int) -> Path:
    """A real 4,096-token cache of the sample document (default model, default codec)."""
    from kvcli import bench, documents
    from kvcli.engine import prefilling as pf
    from kvcli.engine.model import models
    from kvcli.engine.prompt import framing as fr

    lm = models.load()
    frame = fr.choose(lm.tokenizer, "auto", None)
    doc = bench.document_of(lm, frame, documents.read(SAMPLES / "document.txt"), tokens)
    pf.prefill(lm, doc, path, force=True)
    return path


FRESH = """
import sys, time
import numpy as np, torch
from kvcli.engine.cache import restore
from kvcli.format import store
from kvcli.format.codec import DTYPES
path, kind = sys.argv[1], sys.argv[2]
with store.open_cache(path) as opened:
    t0 = time.perf_counter()
    if kind == "restore":
        restore.load_cache(opened)
    else:  # the same buffers allocated (and kept) and one byte per page written: the cost of fresh memory alone
        kept = []
        for e in opened.manifest.layers:
            for shape in (e.key_shape, e.value_shape):
                room = (*shape[:2], shape[2] + restore.ROOM_TOKENS, shape[3])
                kept.append(torch.empty(room, dtype=DTYPES[opened.manifest.dtype]))
                kept[-1].view(torch.uint8).view(-1).numpy()[::4096] = 1
    print(time.perf_counter() - t0)
"""


def fresh_s(path: Path, kind: str, repeats: int) -> float:
    """Median seconds of the first restore (or buffer allocation) in a new process: every page of the cache's
    buffers is new memory there, which the repeated in-process restores mostly reuse."""
    import subprocess
    import sys

    runs = [float(subprocess.run([sys.executable, "-c", FRESH, str(path), kind], check=True, capture_output=True,
                                 text=True).stdout) for _ in range(repeats)]
    return statistics.median(runs)


def rounds(stages: dict, repeats: int) -> dict:
    """{name: (median wall s, median CPU s of all threads, wall runs)}; the stages take turns in each round, so
    a change in the machine's load falls on all of them alike."""
    walls: dict = {k: [] for k in stages}
    cpus: dict = {k: [] for k in stages}
    for _ in range(repeats):
        for name, fn in stages.items():
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            walls[name].append(time.perf_counter() - t0)
            cpus[name].append(time.process_time() - c0)
    return {k: (statistics.median(walls[k]), statistics.median(cpus[k]), walls[k]) for k in stages}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", type=Path, help="an existing cache directory (default: build one)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="restore threads (default: kvcli's choice)")
    ap.add_argument("--fresh", type=int, default=3, help="restores in new processes (0: none)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import torch

    from kvcli.engine.cache import restore
    from kvcli.format import store
    from kvcli.format.codec import DTYPES, decode_layer

    path = args.cache
    if path is None:
        path = WORK / f"doc-{args.tokens}.kv"
        if not store.is_cache(path):
            WORK.mkdir(exist_ok=True)
            build_cache(path, args.tokens)
    m = store.read_manifest(path)
    files = [path / e.file for e in m.layers]
    stored, raw = m.bytes_stored, m.bytes_raw
    default = getattr(restore, "default_threads", lambda n: min(n, max(2, os.cpu_count() or 2)))  # older kvcli: its rule
    workers = args.threads or default(len(m.layers))
    load_before = os.getloadavg()

    # Warm the page cache: every shard read once.
    for f in files:
        f.read_bytes()

    biggest = max(e.stored_bytes for e in m.layers)

    def read_all() -> None:
        def one(chunk: list[Path]) -> None:
            buf = bytearray(biggest)
            for f in chunk:
                fd = os.open(f, os.O_RDONLY)
                try:
                    os.readv(fd, [buf])
                finally:
                    os.close(fd)
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(one, [files[i::workers] for i in range(workers)]))

    blobs = [f.read_bytes() for f in files]
    algo = getattr(m, "shard_hash", "sha256")  # the hash this cache's manifest names (older kvcli: sha256)

    def hasher(name: str):
        if name == "blake3":
            import blake3  # not a kvcli dependency: measured only where installed

            return lambda b: blake3.blake3(b).digest()
        return lambda b: hashlib.new(name, b).digest()

    def hash_rate(name: str) -> float | None:
        """GB/s of stored bytes hashed with `name` on all threads (median), None if it is not available."""
        try:
            fn = hasher(name)
        except ImportError:
            return None
        def run() -> None:
            with ThreadPoolExecutor(workers) as pool:
                list(pool.map(fn, blobs))
        return stored / rounds({"h": run}, args.repeats)["h"][0] / 1e9

    def hash_all() -> None:
        one = hasher(algo)
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(one, blobs))

    dtype = DTYPES[m.dtype]
    outs = [(torch.empty(e.key_shape, dtype=dtype), torch.empty(e.value_shape, dtype=dtype)) for e in m.layers]

    def decode_all() -> None:
        def one(i: int) -> None:
            e = m.layers[i]
            decode_layer(blobs[i], name=e.file, transform=m.transform, dtype=dtype, key_shape=e.key_shape,
                         value_shape=e.value_shape, decoded_bytes=e.decoded_bytes, out=outs[i], quant=m.quant)
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(one, range(len(m.layers))))

    def restore_all() -> None:
        with store.open_cache(path) as opened:
            restore.load_cache(opened, threads=args.threads)

    restore_all()  # warm-up (imports, allocator)
    r = rounds({"read": read_all, "hash": hash_all, "decode": decode_all, "restore": restore_all}, args.repeats)
    others = {name: hash_rate(name) for name in ("sha256", "sha1", "blake2b", "blake3")}
    blobs.clear()
    fresh = {k: fresh_s(path, k, args.fresh) for k in ("restore", "allocate")} if args.fresh else None
    t_read, t_hash, t_dec, t_res = (r[k][0] for k in ("read", "hash", "decode", "restore"))
    result = {
        "cache": str(path), "tokens": m.num_tokens, "layers": len(m.layers), "dtype": m.dtype,
        "transform": m.transform, "hash": algo, "bytes_raw": raw, "bytes_stored": stored, "threads": workers,
        "torch_threads": torch.get_num_threads(), "cpu": cpu_info(),
        "load_before": [round(x, 2) for x in load_before], "load_after": [round(x, 2) for x in os.getloadavg()],
        "page_cache_read_gb_s": stored / t_read / 1e9,
        "hash_gb_s": stored / t_hash / 1e9,
        "decode_gb_s_raw": raw / t_dec / 1e9,
        "restore_gb_s_raw": raw / t_res / 1e9,
        "restore_gb_s_stored": stored / t_res / 1e9,
        "restore_s": t_res,
        "restore_over_read": t_read / t_res,  # stored-byte rate of restore / of a plain read
        "raw_restore_over_read": (raw / t_res) / (stored / t_read),  # raw-byte rate of restore / stored read rate
        "hash_alternatives_gb_s": others,  # the same bytes, other hashes (blake3 only where installed)
        "fresh_process_s": fresh,  # first restore in a new process / allocating its buffers there
        "cpu_s": {k: r[k][1] for k in r},  # CPU seconds of all threads: less sensitive to other jobs than wall time
        "runs_s": {k: r[k][2] for k in r},
    }
    if args.json:
        print(json.dumps(result))
        return
    c = result["cpu"]
    print(f"{path}: {m.num_tokens} tokens, {len(m.layers)} layers, {m.dtype}, {m.transform}, hash {algo}; "
          f"raw {raw / 1e6:.1f} MB, stored {stored / 1e6:.1f} MB")
    print(f"CPU {c['model']} ({', '.join(c['flags'])}), {c['usable_cpus']} usable, {workers} threads; "
          f"load {result['load_before']} -> {result['load_after']}; medians of {args.repeats}")
    print(f"  page-cache read     {result['page_cache_read_gb_s']:6.2f} GB/s of stored bytes")
    print(f"  hash ({algo:8})     {result['hash_gb_s']:6.2f} GB/s of stored bytes")
    print(f"  decompress+planes   {result['decode_gb_s_raw']:6.2f} GB/s of raw bytes")
    print(f"  full restore        {result['restore_gb_s_raw']:6.2f} GB/s of raw bytes ({t_res * 1e3:.1f} ms), "
          f"{result['restore_gb_s_stored']:.2f} GB/s of stored")
    print(f"  restore / read      {result['restore_over_read']:.2f} (stored bytes), "
          f"{result['raw_restore_over_read']:.2f} (raw restore over stored read)")
    print("  other hashes        " + ", ".join(f"{k} {v:.2f}" if v else f"{k} (not installed)" for k, v in others.items())
          + " GB/s of stored bytes")
    if fresh:
        print(f"  in a new process    restore {raw / fresh['restore'] / 1e9:.2f} GB/s of raw ({fresh['restore'] * 1e3:.0f} ms); "
              f"allocating and touching its buffers alone {fresh['allocate'] * 1e3:.0f} ms")
    cpu = result["cpu_s"]
    print("  CPU s (all threads) " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in cpu.items())
          + f"; restore {raw / cpu['restore'] / 1e9:.2f} GB/s of raw per CPU second")


if __name__ == "__main__":
    main()
