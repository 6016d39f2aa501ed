"""The OpenAI-compatible HTTP endpoint, driven by the official `openai` client against uvicorn on 127.0.0.1.

A tiny random llama (saved as a folder, real tokenizer and chat template) answers; each answer is checked
against the in-process Session and against generate() on the full prompt ids without a cache.
"""

from __future__ import annotations

import json
import shutil
import threading
import time

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("sse_starlette")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import kvcli  # noqa: E402
from kvcli.documents import decode  # noqa: E402
from kvcli.errors import UsageError  # noqa: E402
from kvcli.serve import http  # noqa: E402
from kvcli.serve.docs import DocsProvider, Opened  # noqa: E402
from tests.conftest import reference_answer, sample_text  # noqa: E402
from tests.helpers import error_lines, run  # noqa: E402

MAX = 8
Q1, Q2 = "What does the word Licensor mean?", "And the Licensee?"


@pytest.fixture(scope="module")
def docs(tiny_model_dir, tmp_path_factory):
    """A folder with two caches of the tiny model (one with a system message) and its loaded model."""
    folder = tmp_path_factory.mktemp("docs")
    lm = kvcli.load(str(tiny_model_dir))
    kvcli.prefill(lm, decode(sample_text()[:1500].encode(), "licence.txt"), folder / "licence.kv")
    kvcli.prefill(lm, decode(sample_text()[3000:4000].encode(), "brief.txt"), folder / "brief.kv", system="Be brief.")
    return folder, lm


@pytest.fixture(scope="module")
def server(docs):
    provider = DocsProvider([docs[0]])
    srv = http.start("127.0.0.1", 0, provider=provider)
    yield srv, provider
    srv.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0].base_url, api_key="unused", max_retries=0, timeout=120)


def _alone(docs, name: str, question: str, history=(), max_new: int = MAX):
    folder, lm = docs
    return kvcli.Session(lm, folder / name).ask(question, kvcli.GenerationOptions(max_new_tokens=max_new), history=list(history))


def test_models_list_and_retrieve(client, docs):
    models = {m.id: m for m in client.models.list()}
    assert set(models) == {"licence.kv", "brief.kv"}
    meta = models["licence.kv"].model_extra["kvcli"]
    manifest = kvcli.read_manifest(docs[0] / "licence.kv")
    assert meta["num_tokens"] == manifest.num_tokens and meta["bytes_on_disk"] == manifest.bytes_stored
    assert meta["model"] == manifest.model["source"]["name"] and meta["document"] == "licence.txt"
    assert models["brief.kv"].model_extra["kvcli"]["system"] == "Be brief."
    assert client.models.retrieve("licence.kv").id == "licence.kv"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope.kv")


def test_models_lists_only_caches_that_open(docs, tmp_path):
    folder = tmp_path / "docs"
    for name in ("good.kv", "edited.kv", "no-shard.kv"):
        shutil.copytree(docs[0] / "licence.kv", folder / name)
    manifest = folder / "edited.kv" / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"licence.txt"', '"other.txt"'))  # its checksum no longer holds
    (folder / "no-shard.kv" / "layer_001.safetensors.zst").unlink()
    (folder / "junk.kv").mkdir()
    (folder / "junk.kv" / "manifest.json").write_text("{")
    srv = http.start("127.0.0.1", 0, docs=[folder])
    try:
        listed = httpx.get(srv.base_url + "/models", timeout=30)
        assert listed.status_code == 200 and [m["id"] for m in listed.json()["data"]] == ["good.kv"]
        for name in ("edited.kv", "no-shard.kv", "junk.kv"):
            assert httpx.get(f"{srv.base_url}/models/{name}", timeout=30).status_code == 404
        assert httpx.get(srv.base_url + "/models/good.kv", timeout=30).status_code == 200
    finally:
        srv.stop()


def test_completion_equals_asking_in_process_and_recompute(client, docs):
    r = client.chat.completions.create(model="licence.kv", messages=[{"role": "user", "content": Q1}], max_tokens=MAX)
    alone = _alone(docs, "licence.kv", Q1)
    assert r.choices[0].message.content == alone.answer and r.choices[0].finish_reason == alone.finish_reason
    assert r.usage.prompt_tokens == len(alone.prompt_token_ids) and r.usage.completion_tokens == len(alone.answer_token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens == alone.cached_tokens > 100
    assert alone.answer_token_ids == reference_answer(docs[1].model, alone.prompt_token_ids, MAX)
    assert r.object == "chat.completion" and r.model == "licence.kv" and r.id.startswith("chatcmpl-")


def test_follow_up_equals_generate_on_the_whole_conversation(client, docs):
    first = _alone(docs, "brief.kv", Q1)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": Q1},
                {"role": "assistant", "content": first.answer}, {"role": "user", "content": Q2}]
    r = client.chat.completions.create(model="brief.kv", messages=messages, max_completion_tokens=MAX, temperature=0)
    alone = _alone(docs, "brief.kv", Q2, [(Q1, first.answer)])
    assert r.choices[0].message.content == alone.answer
    assert alone.answer_token_ids == reference_answer(docs[1].model, alone.prompt_token_ids, MAX)
    assert r.usage.prompt_tokens == len(alone.prompt_token_ids) and r.usage.prompt_tokens_details.cached_tokens == alone.cached_tokens


@pytest.mark.parametrize(("model", "system"), [("licence.kv", "You are a careful lawyer."), ("brief.kv", "Be long.")])
def test_a_system_message_is_honoured_after_the_document(client, docs, model, system):
    """A client's own system message (most send one) goes after the document, before the question: the answer is
    the one to that prompt, equal to generate() on it."""
    r = client.chat.completions.create(model=model, messages=[{"role": "system", "content": system},
                                                              {"role": "user", "content": Q1}], max_tokens=MAX)
    alone = _alone(docs, model, f"{system}\n\n{Q1}")
    assert r.choices[0].message.content == alone.answer and r.usage.prompt_tokens == len(alone.prompt_token_ids)
    assert alone.answer_token_ids == reference_answer(docs[1].model, alone.prompt_token_ids, MAX)
    first = _alone(docs, model, f"{system}\n\n{Q1}")  # a follow-up: the system message stays before the first question
    r2 = client.chat.completions.create(model=model, messages=[{"role": "system", "content": system}, {"role": "user", "content": Q1},
                                                               {"role": "assistant", "content": first.answer},
                                                               {"role": "user", "content": Q2}], max_tokens=MAX)
    assert r2.choices[0].message.content == _alone(docs, model, Q2, [(f"{system}\n\n{Q1}", first.answer)]).answer
    same = client.chat.completions.create(model="brief.kv", messages=[{"role": "system", "content": "Be brief."},
                                                                      {"role": "user", "content": Q1}], max_tokens=MAX)
    assert same.choices[0].message.content == _alone(docs, "brief.kv", Q1).answer  # the cache's own: already in it


def test_legacy_completions_answer_the_prompt_as_the_question(client, docs):
    r = client.completions.create(model="licence.kv", prompt=Q1, max_tokens=MAX)
    alone = _alone(docs, "licence.kv", Q1)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == "licence.kv"
    assert r.choices[0].text == alone.answer and r.choices[0].finish_reason == alone.finish_reason
    assert r.usage.prompt_tokens == len(alone.prompt_token_ids) and r.usage.completion_tokens == len(alone.answer_token_ids)
    chunks = list(client.completions.create(model="licence.kv", prompt=Q1, max_tokens=MAX, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == alone.answer
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [alone.finish_reason]
    short = client.completions.create(model="licence.kv", prompt=Q1)  # the legacy endpoint's default max_tokens: 16
    assert len(_alone(docs, "licence.kv", Q1, max_new=16).answer_token_ids) >= short.usage.completion_tokens
    for bad, param in (({"echo": True}, "echo"), ({"suffix": "x"}, "suffix"), ({"best_of": 2}, "best_of"), ({"n": 2}, "n")):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="licence.kv", prompt=Q1, **bad)
        assert err.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="licence.kv", prompt=["one", "two"])
    assert err.value.body["param"] == "prompt"


def test_stream_matches_and_ends_with_done(client, server, docs):
    chunks = list(client.chat.completions.create(model="licence.kv", messages=[{"role": "user", "content": Q2}],
                                                 max_tokens=MAX, stream=True, stream_options={"include_usage": True}))
    alone = _alone(docs, "licence.kv", Q2)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == alone.answer
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [alone.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(alone.answer_token_ids)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == alone.cached_tokens
    body = {"model": "licence.kv", "messages": [{"role": "user", "content": Q2}], "max_tokens": 3, "stream": True}
    raw = httpx.post(server[0].base_url + "/chat/completions", json=body, timeout=60)
    assert raw.headers["content-type"].startswith("text/event-stream")
    events = [line for line in raw.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and all(json.loads(e[6:])["object"] == "chat.completion.chunk" for e in events[:-1])


def test_sampling_options_and_stop(client, docs):
    kw = dict(model="licence.kv", messages=[{"role": "user", "content": Q1}], max_tokens=6, temperature=0.9, top_p=0.9)
    a = client.chat.completions.create(seed=7, **kw).choices[0].message.content
    assert client.chat.completions.create(seed=7, **kw).choices[0].message.content == a
    greedy = _alone(docs, "licence.kv", Q1)
    cut = greedy.answer[2:5]
    r = client.chat.completions.create(model="licence.kv", messages=[{"role": "user", "content": Q1}], max_tokens=MAX, stop=[cut])
    assert r.choices[0].message.content == greedy.answer[: greedy.answer.find(cut)] and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("override, param", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": 3}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"n": 2}, "n"), ({"stop": [1]}, "stop"), ({"seed": "x"}, "seed"), ({"logprobs": True}, "logprobs"),
    ({"messages": [{"role": "assistant", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"messages": []}, "messages"), ({"model": None}, "model"),
])
def test_bad_body_is_400_naming_the_field(client, override, param):
    body = {"model": "licence.kv", "messages": [{"role": "user", "content": Q1}], **override}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**body)
    assert err.value.status_code == 400 and err.value.body["param"] == param and param in err.value.body["message"]


def test_other_errors_in_openai_shape(client, server):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="../elsewhere.kv", messages=[{"role": "user", "content": Q1}])
    assert err.value.body["code"] == "model_not_found"
    base = server[0].base_url
    for r, status in ((httpx.post(base + "/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"}, timeout=30), 400),
                      (httpx.get(base + "/nowhere", timeout=30), 404), (httpx.get(base + "/chat/completions", timeout=30), 405)):
        assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert "Traceback" not in r.text


def test_cache_that_no_longer_fits_is_409_with_the_cli_message(client, docs, tiny_model_dir, tmp_path):
    folder = tmp_path / "docs"
    shutil.copytree(docs[0] / "licence.kv", folder / "broken.kv")
    manifest = folder / "broken.kv" / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"licence.txt"', '"other.txt"'))
    srv = http.start("127.0.0.1", 0, docs=[folder])
    try:
        c = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=60)
        with pytest.raises(openai.ConflictError) as err:
            c.chat.completions.create(model="broken.kv", messages=[{"role": "user", "content": Q1}])
    finally:
        srv.stop()
    cli = run("ask", "--cache", folder / "broken.kv", Q1)
    assert cli.exit_code == 3
    message = err.value.body["message"]  # the CLI's message, the server's folder taken out (the id names the cache)
    assert str(folder) not in message and message.startswith("broken.kv")
    assert error_lines(cli)[0] == f"kvcli: error: {str(folder)}/{message}"
    # a cache built for another model: 409 too (the server told to answer with another model)
    other = tmp_path / "other-model"
    shutil.copytree(tiny_model_dir, other)
    from tests.conftest import tiny_llama

    tiny_llama(docs[1].tokenizer.__len__(), seed=1).save_pretrained(other)
    srv = http.start("127.0.0.1", 0, provider=DocsProvider([docs[0]], model=str(other)))
    try:
        c = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=60)
        with pytest.raises(openai.ConflictError, match="built for another model .* differs in .*weights"):
            c.chat.completions.create(model="licence.kv", messages=[{"role": "user", "content": Q1}])
    finally:
        srv.stop()


def test_api_key_is_required_and_checked(docs):
    srv = http.start("127.0.0.1", 0, docs=[docs[0]], api_key="s3cret")
    try:
        bad = openai.OpenAI(base_url=srv.base_url, api_key="wrong", max_retries=0, timeout=30)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        assert httpx.get(srv.base_url + "/models", timeout=30).status_code == 401
        good = openai.OpenAI(base_url=srv.base_url, api_key="s3cret", max_retries=0, timeout=30)
        assert {m.id for m in good.models.list()} == {"licence.kv", "brief.kv"}
    finally:
        srv.stop()


def test_only_loopback_without_a_key():
    http.check_bind("127.0.0.1", None)
    http.check_bind("::1", None)
    http.check_bind("localhost", None)
    http.check_bind("0.0.0.0", "key")
    for host in ("0.0.0.0", "192.168.1.5", "::", "example.org"):
        with pytest.raises(UsageError, match="needs --api-key"):
            http.check_bind(host, None)
    assert http.parse_address("[::1]:8080") == ("::1", 8080)
    with pytest.raises(UsageError, match="HOST:PORT"):
        http.parse_address("8080")


def test_busy_is_503_and_the_first_request_still_finishes(docs):
    from kvcli.engine.scheduling.scheduler import engine_for

    provider = DocsProvider([docs[0]], batch_size=1)  # one answer decoding per model, none waiting (max_queue=0)
    srv = http.start("127.0.0.1", 0, provider=provider, max_queue=0)
    c = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=60)
    body = dict(model="licence.kv", messages=[{"role": "user", "content": Q1}], max_tokens=MAX)
    c.chat.completions.create(**{**body, "max_tokens": 1})  # restores it (and loads its model)
    engine = engine_for(provider.open("licence.kv").session.lm)
    results = []
    held = engine.turn()
    held.__enter__()  # no step runs: the first request stays in the engine
    try:
        asked = engine.asked
        first = threading.Thread(target=lambda: results.append(c.chat.completions.create(**body)))
        first.start()
        deadline = time.monotonic() + 30
        while engine.asked == asked:
            assert time.monotonic() < deadline, "the first request never reached the engine"
            time.sleep(0.01)
        with pytest.raises(openai.InternalServerError) as err:  # its row is the model's one and no one may wait
            c.chat.completions.create(**{**body, "max_tokens": 1})
        assert err.value.status_code == 503 and err.value.body["code"] == "busy"
        assert err.value.response.headers["retry-after"] == "1"
    finally:
        held.__exit__(None, None, None)
    first.join(60)
    srv.stop()
    assert results and results[0].choices[0].message.content == _alone(docs, "licence.kv", Q1).answer


class _GatedProvider:
    """Opens wait at a gate (a slow restore, held open by the test); counts the opens that reached it."""

    def __init__(self, inner):
        self.inner, self.gate, self.entered = inner, threading.Event(), 0
        self.warm = inner.warm

    def models(self):
        return self.inner.models()

    def open(self, model_id):
        self.entered += 1
        assert self.gate.wait(60), "the test never opened the gate"
        return self.inner.open(model_id)


def _post_all(url: str, body: dict, count: int) -> tuple[list, list[threading.Thread]]:
    """`count` requests at once, each in its own thread; results fill with (status, Retry-After, seconds, JSON)."""
    results: list = []

    def one() -> None:
        began = time.monotonic()
        r = httpx.post(url, json=body, timeout=60)
        results.append((r.status_code, r.headers.get("retry-after"), time.monotonic() - began, r.json()))

    threads = [threading.Thread(target=one) for _ in range(count)]
    for t in threads:
        t.start()
    return results, threads


def test_past_every_thread_a_request_is_503_at_once(docs):
    """A request finding every one of the app's threads held (here 3, each in a slow open) is refused at once, never
    queued in front of the pool; listing models still answers; once the opens go on, the 3 are answered."""
    from tests.helpers import wait_until

    provider = _GatedProvider(DocsProvider([docs[0]]))
    srv = http.start("127.0.0.1", 0, provider=provider, workers=3)
    body = {"model": "licence.kv", "messages": [{"role": "user", "content": Q1}], "max_tokens": MAX}
    results, threads = _post_all(srv.base_url + "/chat/completions", body, 8)
    try:
        wait_until(lambda: provider.entered == 3 and len(results) == 5, timeout=30)
        assert all(r[0] == 503 and r[1] == "1" and r[3]["error"]["code"] == "busy" for r in results), results
        assert max(r[2] for r in results) < 10  # at once, not after the opens
        assert httpx.get(srv.base_url + "/models", timeout=10).status_code == 200  # listing waits for no answer thread
        assert provider.entered == 3
    finally:
        provider.gate.set()
        for t in threads:
            t.join(120)
    try:
        answered = [r for r in results if r[0] == 200]
        assert len(answered) == 3, results
        assert {r[3]["choices"][0]["message"]["content"] for r in answered} == {_alone(docs, "licence.kv", Q1).answer}
        r = httpx.post(srv.base_url + "/chat/completions", json=body, timeout=60)  # every thread was given back
        assert r.status_code == 200, r.text
    finally:
        srv.stop()
        provider.warm.close()


def test_past_the_queue_while_a_cache_is_restored_is_503_at_once(docs, monkeypatch):
    """Requests waiting for their cache to be restored count as waiting: past the batch width plus max_queue they are
    refused at once (503, Retry-After), not held until the restore ends; the ones within it are answered."""
    from kvcli.engine import answer
    from tests.helpers import wait_until

    gate, real = threading.Event(), answer.open_session
    entered = []

    def slow_open(spec, lend):
        entered.append(spec)
        assert gate.wait(60), "the test never opened the gate"
        return real(spec, lend)

    monkeypatch.setattr(answer, "open_session", slow_open)
    provider = DocsProvider([docs[0]], batch_size=1)
    srv = http.start("127.0.0.1", 0, provider=provider, max_queue=1)  # 1 decoding + 1 waiting may wait for the restore
    body = {"model": "licence.kv", "messages": [{"role": "user", "content": Q1}], "max_tokens": MAX}
    results, threads = _post_all(srv.base_url + "/chat/completions", body, 6)
    try:
        wait_until(lambda: len(entered) == 1 and len(results) == 4, timeout=30)
        assert all(r[0] == 503 and r[1] == "1" and r[3]["error"]["code"] == "busy" for r in results), results
        assert max(r[2] for r in results) < 10
    finally:
        gate.set()
        for t in threads:
            t.join(120)
    try:
        answered = [r for r in results if r[0] == 200]
        assert len(answered) == 2 and len(entered) == 1, results
        assert {r[3]["choices"][0]["message"]["content"] for r in answered} == {_alone(docs, "licence.kv", Q1).answer}
    finally:
        srv.stop()
        provider.warm.close()


def test_client_gone_mid_stream_stops_its_generation(server, client, docs):
    _srv, provider = server
    session = provider.open("licence.kv").session
    from tests.conftest import TokenCounter

    counter = TokenCounter(session.lm.model)
    try:
        stream = client.chat.completions.create(model="licence.kv", messages=[{"role": "user", "content": Q1}],
                                                max_tokens=2000, stream=True)
        for n, _chunk in enumerate(stream):
            if n == 3:
                break
        stream.close()
        from kvcli.engine.scheduling.scheduler import engine_for

        deadline = time.monotonic() + 30
        while engine_for(session.lm).busy and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(counter.calls) < 400, len(counter.calls)  # stopped long before 2000 tokens
    finally:
        counter.close()
    r = client.chat.completions.create(model="licence.kv", messages=[{"role": "user", "content": Q1}], max_tokens=MAX)
    assert r.choices[0].message.content == _alone(docs, "licence.kv", Q1).answer


def test_client_gone_before_a_whole_answer_stops_its_generation(server, docs):
    """Not streaming: a client that hangs up while its answer is computed takes its row out within a step."""
    import httpx

    from kvcli.engine.scheduling.scheduler import engine_for
    from tests.conftest import TokenCounter

    srv, provider = server
    opened = provider.open("licence.kv")
    session = opened.session
    opened.release()
    engine = engine_for(session.lm)
    counter = TokenCounter(session.lm.model)
    try:
        body = {"model": "licence.kv", "messages": [{"role": "user", "content": Q1}], "max_tokens": 2000}
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
            httpx.post(srv.base_url + "/chat/completions", json=body, timeout=httpx.Timeout(30, read=1.0))
        gave_up, left_at = len(counter.calls), time.monotonic()
        while engine.busy and time.monotonic() < left_at + 30:
            time.sleep(0.01)
        stopped_after = time.monotonic() - left_at
        assert not engine.busy  # nobody is decoding for the client that left
        assert len(counter.calls) < 2000 and stopped_after < 5, (len(counter.calls), stopped_after)
        assert len(counter.calls) - gave_up < 300, (gave_up, len(counter.calls))  # a few polls' worth of steps, not the answer
    finally:
        counter.close()


def test_plain_cli_never_imports_the_http_stack():
    from tests.helpers import run_python

    code = ("import sys\nfrom kvcli.cli import app\nfrom typer.testing import CliRunner\n"
            "CliRunner().invoke(app, ['ask', '--help'])\n"
            "bad = [m for m in ('starlette', 'uvicorn', 'sse_starlette', 'openai', 'kvcli.serve.http') if m in sys.modules]\n"
            "print(bad)")
    out = run_python(code)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_provider_reopens_a_replaced_cache_and_bounds_open_sessions(docs, tmp_path):
    folder, lm = docs
    work = tmp_path / "docs"
    work.mkdir()
    for name in ("licence.kv", "brief.kv"):
        shutil.copytree(folder / name, work / name)
    provider = DocsProvider([work], max_memory=1)  # nothing stays once given back: the LRU is bounded by memory
    held = provider.open("licence.kv")
    first = held.session
    second = provider.open("licence.kv")
    assert second.session is first  # while in use, one restore serves every request
    second.release()
    held.release()
    kvcli.prefill(lm, decode(sample_text()[6000:7000].encode(), "new.txt"), work / "licence.kv", force=True)
    again = provider.open("licence.kv")
    assert again.session is not first
    assert again.session.token_ids == kvcli.read_manifest(work / "licence.kv").token_ids != first.token_ids
    again.release()
    brief = provider.open("brief.kv")
    assert [c["path"] for c in provider.warm.status()["caches"]] == [str(work / "brief.kv")]  # the rest went
    brief.release()
    assert provider.open("missing.kv") is None and provider.open("../docs") is None


class _CountingProvider:
    """Counts sessions lent and given back (a warm LRU must not keep an entry pinned forever)."""

    def __init__(self, inner):
        self.inner, self.lent, self.back = inner, 0, 0

    def models(self):
        return self.inner.models()

    def open(self, model_id):
        opened = self.inner.open(model_id)
        if opened is None:
            return None
        self.lent += 1

        def release():
            self.back += 1

        def both():
            opened.release()
            release()

        return Opened(session=opened.session, release=both, lease=opened.lease)


def test_every_session_lent_is_given_back_once(docs):
    provider = _CountingProvider(DocsProvider([docs[0]]))
    srv = http.start("127.0.0.1", 0, provider=provider)
    c = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=60)
    msg = [{"role": "user", "content": Q1}]
    try:
        c.chat.completions.create(model="licence.kv", messages=msg, max_tokens=3)
        list(c.chat.completions.create(model="licence.kv", messages=msg, max_tokens=3, stream=True))
        with pytest.raises(openai.BadRequestError):
            c.chat.completions.create(model="brief.kv", messages=[{"role": "user", "content": "word " * 9000}])  # too long: after the open
        stream = c.chat.completions.create(model="licence.kv", messages=msg, max_tokens=500, stream=True)
        next(iter(stream))
        stream.close()
        deadline = time.monotonic() + 30
        while provider.back < provider.lent and time.monotonic() < deadline:
            time.sleep(0.05)
        assert provider.lent == 4 and provider.back == 4
    finally:
        srv.stop()


def test_a_stopped_server_leaves_no_answer_threads(docs):
    """The app's one pool of answer threads (not one per model) ends with the server."""
    provider = DocsProvider([docs[0]])
    srv = http.start("127.0.0.1", 0, provider=provider)
    c = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=60)
    for _ in range(3):
        c.chat.completions.create(model="licence.kv", messages=[{"role": "user", "content": Q1}], max_tokens=2)
    pool = srv.server.config.app.state.workers
    threads = list(pool._threads)
    assert threads  # the answers were read in the app's pool
    srv.stop()
    provider.warm.close()  # its engines too, as `kvcli serve` closes them
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
