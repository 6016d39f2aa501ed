"""16 concurrent streaming OpenAI clients on one cache, against a server in its own process on 127.0.0.1.

Bounded in count (16 clients, 8 tokens each) and time (every request and the whole run time out).
All must be answered, each identical to the same question asked alone, and the server must stay up. Its
memory growth under load is a measurement, not a unit test's bound: tests/bench/bench_http.py reports it
(rss_growth_mb) and fails above --max-rss-growth-mb.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import kvcli  # noqa: E402
from kvcli.documents import decode  # noqa: E402
from tests.bench.bench_http import QUESTIONS, Server, ask_streaming, load  # noqa: E402
from tests.conftest import sample_text  # noqa: E402

CLIENTS = 16
MAX_TOKENS = 8


def test_sixteen_concurrent_streaming_clients(tiny_model_dir, tmp_path, session_home):
    lm = kvcli.load(str(tiny_model_dir))
    kvcli.prefill(lm, decode(sample_text()[:6000].encode(), "licence.txt"), tmp_path / "doc.kv")
    env = {**os.environ, "KVCLI_HOME": str(session_home), "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    server = Server(tmp_path, env=env, timeout=120)
    try:
        ask_streaming(server.base_url, "doc.kv", QUESTIONS[0], MAX_TOKENS, timeout=120)  # loads the model and the cache
        report = load(server.base_url, "doc.kv", CLIENTS, MAX_TOKENS, timeout=120)
        assert report["errors"] == [] and report["answered"] == CLIENTS, report
        assert report["identical_to_alone"] == CLIENTS, report
        assert server.proc.poll() is None and httpx.get(server.base_url.removesuffix("/v1") + "/health", timeout=10).status_code == 200
        # and asking alone through the server equals asking in-process
        session = kvcli.Session(lm, tmp_path / "doc.kv")
        c = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)
        r = c.chat.completions.create(model="doc.kv", messages=[{"role": "user", "content": QUESTIONS[0]}], max_tokens=MAX_TOKENS)
        assert r.choices[0].message.content == session.ask(QUESTIONS[0], kvcli.GenerationOptions(max_new_tokens=MAX_TOKENS)).answer
    finally:
        server.close()
    print(f"\nhttp load (tiny model): {report}")
