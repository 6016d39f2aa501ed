"""Storage settings against restore speed and disk size (a script, not collected by pytest):

    python tests/bench/bench_compression.py [--cache DIR] [--dtypes float32,bfloat16] [--device cpu|cuda]
                                            [--repeats N] [--threads N] [--json]

Takes one cache (default: tests/bench/bench_restore.py's 4,096-token cache of the sample, built there) and
writes its keys/values again with every setting of format/codec.py's COMPRESSION ("small": byte planes, zstd
level 1; "fast": plain bytes, zstd level -1), in each dtype asked for (bfloat16: the float32 values rounded, as
a bfloat16 model's cache holds them), under tests/bench/.bench-compression/. Every shard is read once first (the
page cache warm). Then, settings taking turns in each round, it times restore.load_cache onto --device
(medians of --repeats) and prints per setting: stored/raw, the whole restore in GB/s of raw key/value bytes,
and its stages from RestoreStats (read, hash, decompress on all threads; the device copy on a GPU). The CPU, the
threads and the load average before and after are printed with the numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
WORK = HERE / ".bench-compression"


def rewrite(src: Path, dst: Path, dtype: str, setting: str) -> Path:
    """src's keys/values in `dtype`, stored with `setting`, as a cache at dst (made once)."""
    from kvcli.engine import prefilling as pf
    from kvcli.engine.cache import layers, restore
    from kvcli.format import codec, store, writing
    from kvcli.format import manifest as mf

    if store.is_cache(dst):
        return dst
    transform, level = codec.COMPRESSION[setting]
    with store.open_cache(src) as opened:
        m = opened.manifest
        states = restore.load_cache(opened, room=0).states()
    want = codec.DTYPES[dtype]
    states = [layers.LayerState(s.kind, s.keys.to(want), s.values.to(want), s.seq_length, s.sliding_window) for s in states]
    dst.parent.mkdir(parents=True, exist_ok=True)
    with writing.atomic_cache_dir(dst, force=True) as tmp:
        entries = pf.write_layers(tmp, states, m.num_tokens, transform=transform, level=level)
        made = dataclasses.replace(m, model={**m.model, "dtype": dtype}, layers=entries,
                                   compression={"codec": "zstd", "level": level, "transform": transform})
        writing.write_file(tmp, mf.MANIFEST_NAME, made.dumps())
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", type=Path, help="a lossless cache (default: bench_restore.py's 4,096-token one)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import torch

    import bench_restore
    from kvcli.engine.cache import restore
    from kvcli.format import codec, store

    src = args.cache
    if src is None:
        src = bench_restore.WORK / "doc-4096.kv"
        if not store.is_cache(src):
            bench_restore.WORK.mkdir(exist_ok=True)
            bench_restore.build_cache(src, 4096)
    caches = {(d, s): rewrite(src, WORK / f"{src.stem}-{d}-{s}.kv", d, s)
              for d in args.dtypes.split(",") for s in codec.COMPRESSION}
    for path in caches.values():  # the page cache warm
        for f in path.iterdir():
            f.read_bytes()
    load_before = os.getloadavg()

    def once(path: Path):
        with store.open_cache(path) as opened:
            kv = restore.load_cache(opened, device=args.device, threads=args.threads)
        if args.device.startswith("cuda"):
            kv.arrive()
            torch.cuda.synchronize()
        return kv.restore_stats

    for path in caches.values():
        once(path)  # warm-up: imports, allocator, pinned staging buffers
    runs: dict = {k: [] for k in caches}
    walls: dict = {k: [] for k in caches}
    for _ in range(args.repeats):
        for key, path in caches.items():
            t0 = time.perf_counter()
            stats = once(path)
            walls[key].append(time.perf_counter() - t0)
            stats.rates()  # the device's copy seconds, while its link is at hand
            runs[key].append(stats)
    rows = []
    for (dtype, setting), path in caches.items():
        m = store.read_manifest(path)
        stats = runs[(dtype, setting)]
        wall = statistics.median(walls[(dtype, setting)])

        def med(name: str) -> float:
            return statistics.median(getattr(s, name) for s in stats)

        threads = stats[0].threads
        raw, stored = stats[0].bytes_raw, m.bytes_stored
        rows.append({
            "dtype": dtype, "setting": setting, "transform": m.transform, "level": m.compression.get("level"),
            "bytes_raw": raw, "bytes_stored": stored, "stored_over_raw": stored / raw, "restore_s": wall,
            "restore_gb_s_raw": raw / wall / 1e9,
            "read_gb_s_stored": stored / (med("read_s") / threads) / 1e9,
            "hash_gb_s_stored": stored / (med("hash_s") / threads) / 1e9,
            "decompress_gb_s_raw": raw / (med("decode_s") / threads) / 1e9,
            "copy_gb_s_raw": raw / med("copy_s") / 1e9 if med("copy_s") else None,
            "threads": threads,
        })
    result = {"cache": str(src), "tokens": store.read_manifest(src).num_tokens, "device": args.device,
              "cpu": bench_restore.cpu_info(), "load_before": [round(x, 2) for x in load_before],
              "load_after": [round(x, 2) for x in os.getloadavg()], "repeats": args.repeats, "rows": rows}
    if args.device.startswith("cuda"):
        result["gpu"] = torch.cuda.get_device_name()
    if args.json:
        print(json.dumps(result))
        return
    c = result["cpu"]
    print(f"{src}: {result['tokens']} tokens onto {args.device}{' (' + result['gpu'] + ')' if 'gpu' in result else ''}; "
          f"CPU {c['model']}, {c['usable_cpus']} usable; load {result['load_before']} -> {result['load_after']}; "
          f"medians of {args.repeats}")
    for r in rows:
        copy = f", copy {r['copy_gb_s_raw']:.2f}" if r["copy_gb_s_raw"] else ""
        print(f"  {r['dtype']:9} {r['setting']:6} stored/raw {r['stored_over_raw']:.3f}  restore {r['restore_gb_s_raw']:5.2f} GB/s "
              f"of raw ({r['restore_s'] * 1e3:.0f} ms, {r['threads']} threads); stages on all threads: read "
              f"{r['read_gb_s_stored']:.1f}, hash {r['hash_gb_s_stored']:.1f} GB/s of stored, decompress "
              f"{r['decompress_gb_s_raw']:.2f} GB/s of raw{copy}")


if __name__ == "__main__":
    main()
