"""The HTTP endpoint on the warm server: one Warm shared by unix-socket and HTTP clients, `kvcli serve
--http`, and follow-ups (`chat`, `ask --follow-up`) through a running server."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

import kvcli  # noqa: E402
from kvcli.engine.prompt.conversation import Chat  # noqa: E402
from kvcli.serve import http  # noqa: E402
from kvcli.serve.docs import WarmProvider  # noqa: E402
from tests.conftest import sample_text  # noqa: E402
from tests.helpers import assert_clean_error, json_lines, piped, run  # noqa: E402
from tests.serve_helpers import ThreadServer, short_dir  # noqa: E402

Q1, Q2, Q3 = "What is the Licensor?", "And the Licensee?", "Say it again."
OPTS = kvcli.GenerationOptions(max_new_tokens=8)


@pytest.fixture(scope="module")
def world(tiny_model_dir):
    root = short_dir()
    lm = kvcli.load(str(tiny_model_dir))
    (root / "docs").mkdir()
    kvcli.prefill(lm, kvcli.documents.decode(sample_text()[:1400].encode(), "a.txt"), root / "docs" / "a.kv")
    kvcli.prefill(lm, kvcli.documents.decode(sample_text()[3000:4000].encode(), "b.txt"), root / "docs" / "b.kv")
    srv = ThreadServer(root / "s.sock")
    web = http.start("127.0.0.1", 0, provider=WarmProvider(srv.server.warm, [root / "docs"]))
    yield {"root": root, "lm": lm, "server": srv, "web": web}
    web.stop()
    srv.close()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def here(world, monkeypatch):
    monkeypatch.chdir(world["root"])
    monkeypatch.setenv("KVCLI_SOCKET", str(world["server"].path))
    return world["root"]


def _served(world) -> dict[str, int]:
    return {os.path.basename(c["path"]): c["answers"] for c in world["server"].server.warm.status()["caches"]}


def test_http_and_socket_clients_share_one_warm_session(world, here):
    before = _served(world).get("a.kv", 0)
    via_socket = json_lines(run("ask", "--cache", "docs/a.kv", "--max-new-tokens", 8, "--json", Q1).stdout)[0]
    c = openai.OpenAI(base_url=world["web"].base_url, api_key="x", max_retries=0, timeout=60)
    r = c.chat.completions.create(model="a.kv", messages=[{"role": "user", "content": Q1}], max_tokens=8)
    assert via_socket["served"] is True and r.choices[0].message.content == via_socket["answer"]
    assert r.usage.prompt_tokens_details.cached_tokens == via_socket["cached_tokens"]
    caches = [c for c in world["server"].server.warm.status()["caches"] if c["path"].endswith("a.kv")]
    assert len(caches) == 1 and _served(world)["a.kv"] == before + 2  # one restore, both answers counted
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="s.sock", messages=[{"role": "user", "content": Q1}])


def test_concurrent_http_clients_decode_together(world, here):
    import threading

    questions = ("What is the Licensor?", "Who may use the work?", "Is there a warranty?", "What is a Contribution?")
    session = kvcli.Session(world["lm"], world["root"] / "docs" / "b.kv")
    alone = [session.ask(q, OPTS).answer for q in questions]
    c = openai.OpenAI(base_url=world["web"].base_url, api_key="x", max_retries=0, timeout=60)
    c.chat.completions.create(model="b.kv", messages=[{"role": "user", "content": questions[0]}], max_tokens=1)  # restore it
    warm = world["server"].server.warm
    batch = lambda: next(c["batch"] for c in warm.status()["caches"] if c["path"].endswith("b.kv"))  # noqa: E731
    asked = batch()["asked"]
    got: dict[int, str] = {}

    def one(i: int) -> None:
        r = c.chat.completions.create(model="b.kv", messages=[{"role": "user", "content": questions[i]}], max_tokens=8)
        got[i] = r.choices[0].message.content

    with _model_turn(warm):  # no step runs until all four are in
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(questions))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while batch()["asked"] < asked + len(questions):
            assert time.monotonic() < deadline, batch()
            time.sleep(0.01)
    for t in threads:
        t.join(timeout=60)
    assert [got[i] for i in range(len(questions))] == alone
    assert batch()["peak_rows"] == len(questions)


def _model_turn(warm):
    """A turn of the one model the warm server holds: its engine runs no step while the test holds it."""
    from kvcli.engine.scheduling.scheduler import engine_for

    (lm,) = [e.obj for e in warm._entries.values() if e.kind == "model"]
    return engine_for(lm).turn()


def test_chat_goes_through_the_server(world, here):
    talk = Chat(kvcli.Session(world["lm"], world["root"] / "docs" / "a.kv"))
    expected = [talk.ask(q, OPTS) for q in (Q1, Q2, Q3)]
    before = _served(world).get("a.kv", 0)
    out = run("chat", "--cache", "docs/a.kv", "--max-new-tokens", 8, "--json", input=f"{Q1}\n{Q2}\n\n{Q3}\n")
    rows = json_lines(out.stdout)
    assert out.exit_code == 0, out.stderr
    assert all(r["served"] for r in rows) and [r["answer_token_ids"] for r in rows] == [a.answer_token_ids for a in expected]
    assert rows[2]["history"] == [{"question": Q1, "answer": expected[0].answer}, {"question": Q2, "answer": expected[1].answer}]
    assert _served(world)["a.kv"] == before + 3
    plain = run("chat", "--cache", "docs/a.kv", "--max-new-tokens", 8, input=f"{Q1}\n{Q2}\n")
    assert plain.stdout == piped([{"question": a.question, "answer": a.answer} for a in expected[:2]])  # labelled, as in-process
    alone = run("chat", "--no-server", "--cache", "docs/a.kv", "--max-new-tokens", 8, "--json", input=f"{Q1}\n{Q2}\n")
    assert [r["answer"] for r in json_lines(alone.stdout)] == [r["answer"] for r in rows[:2]]
    assert not any(r["served"] for r in json_lines(alone.stdout))


def test_ask_follow_up_through_the_server(world, here, tmp_path):
    first = run("ask", "--cache", "docs/a.kv", "--max-new-tokens", 8, "--json", Q1)
    (tmp_path / "t1.jsonl").write_text(first.stdout)
    served = run("ask", "--cache", "docs/a.kv", "--max-new-tokens", 8, "--json", "--follow-up", tmp_path / "t1.jsonl", Q2)
    local = run("ask", "--no-server", "--cache", "docs/a.kv", "--max-new-tokens", 8, "--json", "--follow-up", tmp_path / "t1.jsonl", Q2)
    s, loc = json_lines(served.stdout)[0], json_lines(local.stdout)[0]
    assert s["served"] is True and loc["served"] is False
    assert s["answer_token_ids"] == loc["answer_token_ids"]
    assert s["history"] == loc["history"] == [{"question": Q1, "answer": json_lines(first.stdout)[0]["answer"]}]
    wrong = {k: assert_clean_error(run("ask", *flag, "--cache", "docs/b.kv", "--follow-up", tmp_path / "t1.jsonl", Q2), 2, "another document")
             for k, flag in (("served", ()), ("local", ("--no-server",)))}
    assert wrong["served"] == wrong["local"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_kvcli_serve_http_end_to_end(world, tmp_path):
    sock = short_dir() / "k.sock"
    port = _free_port()
    env = {**os.environ, "KVCLI_API_KEY": "s3cret", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "kvcli", "serve", "--socket", str(sock), "--http", f"127.0.0.1:{port}",
                             "--docs", str(world["root"] / "docs")], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(base + "/models", headers={"Authorization": "Bearer s3cret"}, timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        c = openai.OpenAI(base_url=base, api_key="s3cret", max_retries=0, timeout=60)
        assert {m.id for m in c.models.list()} == {"a.kv", "b.kv"}
        r = c.chat.completions.create(model="b.kv", messages=[{"role": "user", "content": Q1}], max_tokens=8)
        assert r.choices[0].message.content == kvcli.Session(world["lm"], world["root"] / "docs" / "b.kv").ask(Q1, OPTS).answer
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base, api_key="nope", max_retries=0, timeout=30).models.list()
        stopped = subprocess.run([sys.executable, "-m", "kvcli", "serve", "--socket", str(sock), "--stop"], env=env,
                                 capture_output=True, text=True, timeout=120)
        assert stopped.returncode == 0, stopped.stderr
        assert proc.wait(60) == 0
        assert "OpenAI-compatible endpoint on" in proc.stderr.read().decode() and "s3cret" not in " ".join(proc.args)
        with pytest.raises(httpx.HTTPError):
            httpx.get(base + "/models", timeout=5)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)


def test_serve_http_usage_errors(tmp_path):
    assert_clean_error(run("serve", "--socket", tmp_path / "x.sock", "--http", "0.0.0.0:8000"), 2, "needs --api-key")
    assert_clean_error(run("serve", "--socket", tmp_path / "x.sock", "--docs", tmp_path), 2, "goes with --http")
    assert_clean_error(run("serve", "--socket", tmp_path / "x.sock", "--http", "8000"), 2, "HOST:PORT")
    assert_clean_error(run("serve", "--socket", tmp_path / "x.sock", "--http", "127.0.0.1:0", "--docs", tmp_path / "nope"), 2, "not a folder")
    assert not (tmp_path / "x.sock").exists()


@pytest.mark.parametrize("missing", ["uvicorn", "sse_starlette"])
def test_serve_http_without_the_serve_extra_says_how_to_install_it(tmp_path, monkeypatch, missing):
    monkeypatch.setitem(sys.modules, missing, None)  # as if the serve extra were not installed: importing it fails
    for detach in ([], ["--detach"]):
        result = run("serve", "--socket", tmp_path / "x.sock", "--http", "127.0.0.1:0", *detach)
        line = assert_clean_error(result, 1, "the serve extra is not installed", repr(missing))
        assert "unexpected" not in line and "pip install 'kvcli[serve]'" in result.stderr and ".[serve]'" in result.stderr
    assert not (tmp_path / "x.sock").exists()  # nothing was started


def test_a_streamed_answer_outlives_a_short_idle_timeout(world, monkeypatch):
    """The idle timer counts an answer as use until its last chunk is sent, not only while the engine decodes: here
    each event reaches the client late, so the engine ends long before the response, and the server waits."""
    import asyncio
    import threading

    from kvcli.serve.answering import Answering
    from kvcli.serve.server import Server
    from kvcli.serve.warm import Warm

    real_next = Answering.next

    async def late_next(self):
        await asyncio.sleep(0.05)
        return await real_next(self)

    root = short_dir()
    server = Server(root / "s.sock", Warm(), idle_timeout=0.5, log=lambda _line: None)
    server.start(preload=False)
    web = http.start("127.0.0.1", 0, provider=WarmProvider(server.warm, [world["root"] / "docs"], on_use=server.touch))
    stopped = threading.Event()
    loop = threading.Thread(target=lambda: (server.serve_forever(), stopped.set(), web.stop()), daemon=True)  # as `kvcli serve`
    try:
        c = openai.OpenAI(base_url=web.base_url, api_key="x", max_retries=0, timeout=60)
        options = dict(model="a.kv", messages=[{"role": "user", "content": Q1}], max_tokens=60)
        tokens = c.chat.completions.create(**options).usage.completion_tokens  # restored and warm now
        monkeypatch.setattr(Answering, "next", late_next)
        server.touch()
        loop.start()
        alive_at_end = None
        with httpx.stream("POST", web.base_url + "/chat/completions", json={**options, "stream": True}, timeout=60) as r:
            lines = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    alive_at_end = not stopped.is_set()
        assert tokens >= 20 and len(lines) >= tokens and lines[-1] == "data: [DONE]"  # ~3 s after the engine finished
        assert alive_at_end  # the server waited for the answer's last chunk
        loop.join(30)
        assert not loop.is_alive()  # and once idle, the timer stops it
    finally:
        server.stop(hard=True)
        if loop.is_alive():
            loop.join(30)
        else:
            web.stop()
        shutil.rmtree(root, ignore_errors=True)
