"""A warm server evicting models, as a user drives it (a script, not collected):

    python tests/bench/bench_evict.py [--rounds 20] [--work DIR]

Starts `kvcli serve --max-memory 3M` (room for nothing idle) in a subprocess, makes three tiny random llamas
(saved as folders, with the default model's tokenizer) and one cache of a 2,000-character document with each,
then asks `kvcli ask --server --json --max-new-tokens 12` through the three in turn, --rounds times: every
question loads a model and evicts the one before. Prints the server's threads and resident memory (from /proc)
after the first round and the last, and whether every answer equals round 1's. The models and caches are kept
in --work (default tests/bench/.bench-evict/) for later runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def kvcli(env: dict, *args, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-m", "kvcli", *map(str, args)], env=env, capture_output=True, text=True,
                       timeout=600)
    if check and p.returncode:
        raise SystemExit(f"kvcli {' '.join(map(str, args))}: exit {p.returncode}\n{p.stderr}")
    return p


def prepare(work: Path, env: dict) -> None:
    """Three tiny models as folders and a cache of the sample document with each (kept for later runs)."""
    sys.path.insert(0, str(REPO))
    from transformers import AutoTokenizer

    from kvcli.engine.model.models import default_gguf_path
    from tests.conftest import tiny_llama

    gguf = default_gguf_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    doc = work / "doc.txt"
    doc.write_text((REPO / "samples" / "document.txt").read_text(encoding="utf-8")[:2000], encoding="utf-8")
    for i in range(3):
        model = work / f"model{i}"
        if not (model / "config.json").exists():
            tiny_llama(len(tok), seed=i).save_pretrained(model)
            tok.save_pretrained(model)
        if not (work / f"c{i}.kv").exists():
            kvcli(env, "prefill", doc, "-o", work / f"c{i}.kv", "--model", model, "--no-server")


def figures(pid: int) -> tuple[int, float]:
    """(threads, resident MB) of a process."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    get = lambda key: next(line.split()[1] for line in status if line.startswith(key))  # noqa: E731
    return int(get("Threads:")), int(get("VmRSS:")) / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--work", type=Path, default=HERE / ".bench-evict")
    args = ap.parse_args()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    sock = Path("/tmp") / f"kvevict-{os.getpid()}.sock"
    env = {**os.environ, "PYTHONPATH": str(REPO), "KVCLI_HOME": str(work / "home"), "KVCLI_AUTOSTART": "0"}
    prepare(work, env)
    server = subprocess.Popen([sys.executable, "-m", "kvcli", "serve", "--socket", sock, "--max-memory", "3M"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            if kvcli(env, "ps", "--socket", sock, check=False).returncode == 0:
                break
            time.sleep(0.2)
        env["KVCLI_SOCKET"] = str(sock)
        first, ok = {}, True
        for r in range(1, args.rounds + 1):
            for i in range(3):
                p = kvcli(env, "ask", "-c", work / f"c{i}.kv", "--model", work / f"model{i}", "--server", "--json",
                          "--max-new-tokens", "12", "Who is the licensor?")
                ids = json.loads(p.stdout.splitlines()[-1])["answer_token_ids"]
                ok &= first.setdefault(i, ids) == ids
            if r in (1, args.rounds):
                time.sleep(0.5)
                threads, rss = figures(server.pid)
                print(f"round {r}: threads {threads}, RSS {rss:.0f} MB", flush=True)
        held = json.loads(kvcli(env, "ps", "--socket", sock, "--json").stdout)
        print(f"answers all equal to round 1's: {ok}; held now: {len(held['models'])} models, {len(held['caches'])} caches")
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main()
