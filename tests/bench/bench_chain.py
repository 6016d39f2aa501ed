"""Benchmark (not part of the test run): a chain of caches against one cache of the same tokens, and a grown document.

    python tests/bench/bench_chain.py [--tokens 4000] [--rounds 5] [--json]

Default model, float32, in one process. The sample document (repeated to about --tokens tokens) is split in two
halves: `half1.kv`, then `half2.kv --after half1.kv` (a 2-link chain), and `whole.kv` from the two halves joined
by a blank line (the same token ids: checked). Per round, alternating, each is opened as a new Session (restore)
and asked one question for one token: restore + first token, the median over the rounds, and the chain's over the
whole's (target: at most 1.1). Then a grown document: half1's text prefilled to `grown.kv`, then the whole text
over it; the tokens it computed against the tokens added (target: the added tokens plus the re-tokenized margin).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4000, help="about this many tokens in the whole document")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import kvcli
    from kvcli.documents import decode
    from kvcli.format import store

    lm = kvcli.load()
    sample = (ROOT / "samples" / "document.txt").read_text(encoding="utf-8")
    text = (sample * (1 + args.tokens * 4 // len(sample)))[: args.tokens * 4]  # about 4 characters a token
    cut = text.rfind("\n", 0, len(text) // 2) + 1
    first, second = text[:cut].strip(), text[cut:].strip()
    question = "What does the word Licensor mean?"
    with tempfile.TemporaryDirectory(prefix="kvcli-chain-") as tmp:
        d = Path(tmp)
        kvcli.prefill(lm, decode(first.encode(), "half1.txt"), d / "half1.kv")
        link = kvcli.prefill(lm, decode(second.encode(), "half2.txt"), d / "half2.kv", after=d / "half1.kv")
        whole = kvcli.prefill(lm, decode((first + "\n\n" + second).encode(), "whole.txt"), d / "whole.kv")
        same_ids = link.manifest.token_ids == whole.manifest.token_ids
        times: dict[str, list[float]] = {"chain": [], "whole": []}
        opts = kvcli.GenerationOptions(max_new_tokens=1)
        for _ in range(args.rounds):
            for name, path in (("chain", d / "half2.kv"), ("whole", d / "whole.kv")):
                t0 = time.perf_counter()
                kvcli.Session(lm, path).ask(question, opts)
                times[name].append(time.perf_counter() - t0)
        kvcli.prefill(lm, decode(first.encode(), "grown.txt"), d / "grown.kv")
        before = store.read_manifest(d / "grown.kv").num_tokens
        grown = kvcli.prefill(lm, decode((first + "\n\n" + second).encode(), "grown.txt"), d / "grown.kv")
    chain_s, whole_s = statistics.median(times["chain"]), statistics.median(times["whole"])
    result = {
        "tokens": whole.manifest.num_tokens, "base_tokens": link.manifest.base_tokens, "same_ids": same_ids,
        "restore_first_token_s": {"chain": round(chain_s, 4), "whole": round(whole_s, 4)},
        "chain_over_whole": round(chain_s / whole_s, 3),
        "grown": {"from": before, "to": grown.manifest.num_tokens, "added": grown.manifest.num_tokens - before,
                  "computed": grown.computed, "compute_s": round(grown.compute_s, 3)},
        "cpu_flags": _flags(),
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"{result['tokens']:,} tokens ({result['base_tokens']:,} in the base), ids equal to one cache's: {same_ids}")
    print(f"restore + first token: chain {chain_s:.3f} s, one cache {whole_s:.3f} s, ratio {result['chain_over_whole']}")
    g = result["grown"]
    print(f"grown document: {g['from']:,} -> {g['to']:,} tokens, {g['added']:,} added, {g['computed']:,} computed "
          f"in {g['compute_s']} s")


def _flags() -> str:
    try:
        line = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
    except (OSError, StopIteration):
        return ""
    return " ".join(f for f in line.split() if f.startswith(("avx", "amx", "fma")))


if __name__ == "__main__":
    main()
