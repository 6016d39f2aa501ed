"""Load on the HTTP endpoint: N concurrent streaming OpenAI clients on one cache (not part of the test run).

    python tests/bench/bench_http.py [--clients 16] [--max-tokens 16] [--doc samples/document.txt]

Starts `kvcli.serve.http` in a child process on 127.0.0.1 with the default model and the document's cache,
asks each distinct question alone first, then all clients at once, checks every streamed answer equals the
one asked alone, and prints JSON: requests/s, p50/p95 time to first token, the server's peak memory.
tests/serve/test_http_load.py drives the same functions with a tiny model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

QUESTIONS = ("What does the word Licensor mean?", "When does the patent license terminate?",
             "Is the Work provided with any warranty?", "What must a redistribution include?")
SERVER = """
import sys
from kvcli.serve.http import start
srv = start("127.0.0.1", 0, docs=[sys.argv[1]])
print(srv.port, flush=True)
sys.stdin.read()  # until the parent closes stdin
srv.stop()
"""


class Server:
    """`kvcli.serve.http` in a child process on 127.0.0.1; memory read from /proc."""

    def __init__(self, docs: Path, env: dict | None = None, timeout: float = 300):
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER, str(docs)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)
        ready: list[str] = []
        reader = threading.Thread(target=lambda: ready.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        if not ready or not ready[0].strip().isdigit():
            self.close()
            raise RuntimeError("the server did not start")
        self.base_url = f"http://127.0.0.1:{int(ready[0])}/v1"

    def memory(self) -> dict[str, int]:
        """Resident and peak resident bytes of the server process."""
        fields = {}
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024
        return fields

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(30)
        except Exception:
            self.proc.kill()
            self.proc.wait(30)


def ask_streaming(base_url: str, model: str, question: str, max_tokens: int, timeout: float) -> dict:
    """One streamed chat completion; text and time to first content token."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=timeout)
    t0 = time.perf_counter()
    ttft, parts = None, []
    for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                                max_tokens=max_tokens, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            parts.append(chunk.choices[0].delta.content)
    return {"question": question, "text": "".join(parts), "ttft_s": ttft, "total_s": time.perf_counter() - t0}


def load(base_url: str, model: str, clients: int, max_tokens: int, timeout: float = 300) -> dict:
    """Each distinct question alone, then `clients` at once; every concurrent answer must equal its lone one."""
    lone = [ask_streaming(base_url, model, q, max_tokens, timeout) for q in QUESTIONS]
    alone = {r["question"]: r["text"] for r in lone}
    results: list[dict] = []
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            results.append(ask_streaming(base_url, model, QUESTIONS[i % len(QUESTIONS)], max_tokens, timeout))
        except BaseException as exc:  # reported below, never lost in a thread
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(1.0, timeout - (time.perf_counter() - t0)))
    wall = time.perf_counter() - t0
    ttfts = sorted(r["ttft_s"] for r in results if r["ttft_s"] is not None)
    q = statistics.quantiles(ttfts, n=20, method="inclusive") if len(ttfts) >= 2 else ttfts * 19
    return {
        "clients": clients, "answered": len(results), "errors": [repr(e) for e in errors],
        "identical_to_alone": sum(r["text"] == alone[r["question"]] for r in results),
        "wall_s": round(wall, 3), "requests_per_s": round(len(results) / wall, 3),
        "ttft_p50_s": round(statistics.median(ttfts), 3) if ttfts else None, "ttft_p95_s": round(q[18], 3) if ttfts else None,
        "alone_ttft_median_s": round(statistics.median(r["ttft_s"] for r in lone if r["ttft_s"] is not None), 3),
        "alone_total_median_s": round(statistics.median(r["total_s"] for r in lone), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--doc", default=str(Path(__file__).resolve().parents[2] / "samples" / "document.txt"))
    parser.add_argument("--max-rss-growth-mb", type=float, default=256,
                        help="exit 1 if the server's RSS grows more than this under load")
    args = parser.parse_args()
    import tempfile

    import kvcli

    with tempfile.TemporaryDirectory() as tmp:
        lm = kvcli.load()
        kvcli.prefill(lm, kvcli.read_document(args.doc), Path(tmp) / "doc.kv")
        del lm
        server = Server(Path(tmp), env=dict(os.environ))
        try:
            ask_streaming(server.base_url, "doc.kv", QUESTIONS[0], args.max_tokens, 300)  # loads the model and the cache
            before = server.memory()
            report = load(server.base_url, "doc.kv", args.clients, args.max_tokens)
            report.update(rss_before=before["VmRSS"], rss_after=server.memory()["VmRSS"], peak_rss=server.memory()["VmHWM"])
        finally:
            server.close()
    report["rss_growth_mb"] = round((report["rss_after"] - report["rss_before"]) / 2**20, 1)
    print(json.dumps(report, indent=2))
    if report["rss_growth_mb"] > args.max_rss_growth_mb:
        sys.exit(f"the server's RSS grew {report['rss_growth_mb']} MB under load, above {args.max_rss_growth_mb} MB")


if __name__ == "__main__":
    main()
