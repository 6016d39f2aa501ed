"""The CLI through a warm server says what it says in-process: every warning, refusals that load nothing,
every address the server listens on, one set of counters."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.conftest import sample_text
from tests.helpers import assert_clean_error, REPO, run, served_and_local, run_python
from tests.serve_helpers import ThreadServer, kvcli_cmd, short_dir


@pytest.fixture(scope="module")
def short_cache(here, short_model_dir):
    doc = here / "short.txt"
    doc.write_text(sample_text()[:2500], encoding="utf-8")
    assert run("prefill", doc, "--model", short_model_dir).exit_code == 0
    return here / "short.kv"


# ---- every warning both ways


def test_room_warning_both_ways(short_cache, server, monkeypatch):
    served, local = served_and_local("ask", "-c", short_cache, "--max-new-tokens", "2000", "--json", "Who?")
    assert served.exit_code == local.exit_code == 0, (served.stderr, local.stderr)
    assert "positions are left" in local.stderr and served.stderr == local.stderr


def test_convert_dtype_warning_both_ways(cache_dir, server, monkeypatch):
    served, local = served_and_local("ask", "-c", cache_dir, "--dtype", "bfloat16", "--convert-dtype",
                          "--max-new-tokens", "2", "--json", "Who?")
    assert served.exit_code == local.exit_code == 0, (served.stderr, local.stderr)
    assert "converted to bfloat16" in local.stderr and served.stderr == local.stderr


def test_chat_warnings_both_ways(short_cache, server, monkeypatch):
    """chat in-process warns of the room left at each turn, as a served chat does; the cache's own warnings
    come once per chat through the server, as in-process."""
    served = run("chat", "-c", short_cache, "--max-new-tokens", "2000", "--json", "--server", input="Who?\n")
    local = run("chat", "-c", short_cache, "--max-new-tokens", "2000", "--json", "--no-server", input="Who?\n")
    assert served.exit_code == local.exit_code == 0, (served.stderr, local.stderr)
    assert local.stderr.count("positions are left") == 1 and served.stderr == local.stderr
    lines = "Who?\nAnd then?\n"
    args = ("chat", "-c", short_cache, "--dtype", "bfloat16", "--convert-dtype", "--max-new-tokens", "2", "--json")
    served = run(*args, "--server", input=lines)
    local = run(*args, "--no-server", input=lines)
    assert local.stderr.count("converted to bfloat16") == 1 and served.stderr == local.stderr


def test_follow_up_warning_both_ways(short_cache, server, monkeypatch, tmp_path):
    first = run("ask", "-c", short_cache, "--max-new-tokens", "4", "--json", "--no-server", "Who?")
    earlier = tmp_path / "a.json"
    earlier.write_text(first.stdout, encoding="utf-8")
    served, local = served_and_local("ask", "-c", short_cache, "--follow-up", earlier, "--max-new-tokens", "2000",
                          "--json", "And?")
    assert served.exit_code == local.exit_code == 0, (served.stderr, local.stderr)
    assert "positions are left" in local.stderr and served.stderr == local.stderr


# ---- a refused request loads nothing


def test_dtype_refusal_loads_no_model_in_the_server(cache_dir, server):
    result = run("ask", "-c", cache_dir, "--dtype", "bfloat16", "Q?", "--server")
    assert_clean_error(result, 3, "dtype", "--convert-dtype")
    assert server.server.warm.status()["models"] == []  # 0.2 kept a bfloat16 copy of the model, 0 answers


def test_dtype_refusal_loads_no_model_in_process(cache_dir, monkeypatch):
    from kvcli.engine.model import models

    def no_load(*a, **k):
        raise AssertionError("a model was loaded for a refused request")

    monkeypatch.setattr(models, "load", no_load)
    assert_clean_error(run("ask", "-c", cache_dir, "--dtype", "bfloat16", "Q?", "--no-server"), 3, "dtype", "--convert-dtype")


def test_prefill_onto_an_existing_cache_is_refused_before_loading(cache_dir, doc_file, tiny_model_dir, server, monkeypatch):
    line = assert_clean_error(run("prefill", doc_file, "--model", tiny_model_dir, "--server"), 1, "already exists", "--force")
    assert server.server.warm.status()["models"] == []
    # in a fresh process: refused without importing torch (0.2 loaded the model first, ~7 s)
    code = ("import sys, time\nfrom kvcli.cli import app\nt0 = time.perf_counter()\n"
            f"try:\n    app(['prefill', {str(doc_file)!r}, '--model', {str(tiny_model_dir)!r}, '--no-server'], prog_name='kvcli')\n"
            "except SystemExit as e:\n    code = e.code\n"
            "print(code, 'torch' in sys.modules, round(time.perf_counter() - t0, 2))\n")
    proc = run_python(code)
    code, torch_loaded, seconds = proc.stdout.split()
    assert code == "1" and torch_loaded == "False", (proc.stdout, proc.stderr, line)


# ---- every address


def test_ps_shows_every_address(cache_dir, server):
    server.server.listening("http", "http://127.0.0.1:9/v1")
    s = json.loads(run("ps", "--json").stdout)
    assert s["addresses"] == {"socket": str(server.path), "http": "http://127.0.0.1:9/v1"}
    text = run("ps").stdout
    assert str(server.path) in text and "http://127.0.0.1:9/v1" in text


def test_ps_shows_the_host_tier_only_when_it_has_a_limit(monkeypatch):
    from kvcli.cli.output import human_bytes
    from kvcli.engine.cache import tiers

    monkeypatch.setattr(tiers, "HOST", tiers.HostTier())
    for host_memory, shown in ((None, False), (3 << 20, True)):
        s = ThreadServer(short_dir() / "h.sock", host_memory=host_memory)
        monkeypatch.setenv("KVCLI_SOCKET", str(s.path))
        try:
            status, text = json.loads(run("ps", "--json").stdout), run("ps").stdout
        finally:
            s.close()
        assert ("host_tier" in status) == shown and ("host tier:" in text) == shown, text
    assert status["host_tier"]["limit"] == 3 << 20 and f"host tier: 0 cache(s), 0 B of {human_bytes(3 << 20)}" in text, text


def test_detach_prints_every_address(here, tmp_path):
    pytest.importorskip("uvicorn")
    folder = short_dir()
    sock = folder / "d.sock"
    env = {**os.environ, "KVCLI_HOME": str(folder), "PYTHONPATH": str(REPO), "KVCLI_SOCKET": str(sock)}
    up = subprocess.run(kvcli_cmd("serve", "--detach", "--socket", sock, "--http", "127.0.0.1:0", "--docs", here),
                        capture_output=True, text=True, env=env, timeout=300)
    try:
        assert up.returncode == 0, up.stderr
        assert up.stdout.strip().isdigit()  # stdout: the pid alone, as before
        assert f"socket {sock}" in up.stderr and "http http://127.0.0.1:" in up.stderr, up.stderr
        ps = subprocess.run(kvcli_cmd("ps", "--json", "--socket", sock), capture_output=True, text=True, env=env, timeout=60)
        addresses = json.loads(ps.stdout)["addresses"]
        assert addresses["socket"] == str(sock) and addresses["http"].startswith("http://127.0.0.1:")
        assert addresses["http"] in up.stderr and addresses["http"].split(":")[-1] != "0/v1"
    finally:
        subprocess.run(kvcli_cmd("serve", "--stop", "--socket", sock), capture_output=True, env=env, timeout=120)


# ---- one set of counters


def test_one_set_of_counters(cache_dir, server):
    from kvcli.serve.server import COUNTERS, counters_line

    assert run("ask", "-c", cache_dir, "--max-new-tokens", "2", "--server", "A?", "B?").exit_code == 0
    assert run("ask", "-c", cache_dir, "--max-new-tokens", "2", "--server", "C?").exit_code == 0
    for _ in range(3):
        run("ps")  # looking changes nothing
    s = json.loads(run("ps", "--json").stdout)
    assert {k: s[k] for k in COUNTERS} == {"requests": 2, "socket_requests": 2, "http_requests": 0, "answers": 3, "prefills": 0,
                                           "failed": 0, "refused": 0, "cancelled": 0, "busy": 0}
    assert sum(c["answers"] for c in s["caches"]) == s["answers"] == 3
    assert counters_line(s) in run("ps").stdout
    server.close()
    assert any(counters_line(s) in line for line in server.logs), server.logs
    server.close = lambda: None
