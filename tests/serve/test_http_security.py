"""What the HTTP endpoint refuses before any model work: foreign Host names (DNS rebinding), bodies that are
not JSON (HTML forms), other origins (CORS), oversized bodies, max_tokens above the server's cap; and what
it never says: server paths, in /v1/models or in errors."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("sse_starlette")
httpx = pytest.importorskip("httpx")

import kvcli  # noqa: E402
from kvcli.documents import decode  # noqa: E402
from kvcli.errors import KvcliError, UsageError  # noqa: E402
from kvcli.serve import http  # noqa: E402
from kvcli.serve.docs import DocsProvider  # noqa: E402
from tests.conftest import sample_text  # noqa: E402

Q = "What does the word Licensor mean?"


@pytest.fixture(scope="module")
def folder(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("private-docs")
    lm = kvcli.load(str(tiny_model_dir))
    kvcli.prefill(lm, decode(sample_text()[:800].encode(), "licence.txt"), folder / "licence.kv")
    return folder


@pytest.fixture(scope="module")
def server(folder):
    srv = http.start("127.0.0.1", 0, docs=[folder], max_tokens=16, allow_hosts=["kvcli.example.org"],
                     allow_origins=["https://app.example.org"])
    yield srv
    srv.stop()


def _chat(**over):
    return {"model": "licence.kv", "messages": [{"role": "user", "content": Q}], "max_tokens": 2, **over}


def _is_openai_error(r) -> bool:
    return set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_foreign_host_header_is_refused(server):
    base = server.base_url
    r = httpx.get(base + "/models", headers={"Host": "attacker.example"}, timeout=30)
    assert r.status_code == 400 and "licence" not in r.text
    r = httpx.post(base + "/chat/completions", json=_chat(), headers={"Host": f"rebound.example:{server.port}"}, timeout=30)
    assert r.status_code == 400
    for host in (f"127.0.0.1:{server.port}", f"localhost:{server.port}", "kvcli.example.org"):  # loopback, bound, --allow-host
        assert httpx.get(base + "/models", headers={"Host": host}, timeout=30).status_code == 200, host


def test_allowed_hosts_and_bad_names():
    assert http.allowed_hosts("127.0.0.1") == ["localhost", "127.0.0.1", "[::1]"]
    assert "[::1]" in http.allowed_hosts("::1") and "10.0.0.5" in http.allowed_hosts("10.0.0.5", ["Box.Lan"])
    assert "box.lan" in http.allowed_hosts("10.0.0.5", ["Box.Lan"])
    for bad in ("a/b", "ex*ample.org", ""):
        with pytest.raises(UsageError):
            http.allowed_hosts("127.0.0.1", [bad])
    with pytest.raises(UsageError):
        http.check_origins(["app.example.org"])  # no scheme: not what a browser sends


def test_post_that_is_not_json_is_415(server):
    base = server.base_url
    body = json.dumps(_chat())
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        headers = {"Content-Type": kind} if kind else {}
        r = httpx.post(base + "/chat/completions", content=body.encode(), headers=headers, timeout=30)
        assert r.status_code == 415 and _is_openai_error(r), (kind, r.text)
    r = httpx.post(base + "/chat/completions", content=body.encode(), headers={"Content-Type": "application/json; charset=utf-8"}, timeout=60)
    assert r.status_code == 200


def test_cors_allows_no_other_origin(server):
    base = server.base_url
    pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    r = httpx.options(base + "/chat/completions", headers={"Origin": "https://evil.example", **pre}, timeout=30)
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = httpx.get(base + "/models", headers={"Origin": "https://evil.example"}, timeout=30)
    assert "access-control-allow-origin" not in r.headers  # the page cannot read the answer
    r = httpx.options(base + "/chat/completions", headers={"Origin": "https://app.example.org", **pre}, timeout=30)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example.org"


def test_oversized_body_is_413(server):
    base = server.base_url
    big = json.dumps(_chat(user="x" * (http.DEFAULT_MAX_BODY + 10))).encode()
    r = httpx.post(base + "/chat/completions", content=big, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 413 and _is_openai_error(r)

    def chunks():  # no Content-Length: counted as it streams
        for _ in range(8):
            yield b" " * (1 << 20)

    r = httpx.post(base + "/chat/completions", content=chunks(), headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 413


def test_body_is_never_read_past_the_cap():
    """At the ASGI level: count what the app takes from receive() for a body far over the cap."""
    app = http.create_app(DocsProvider([]), max_body=1000)
    taken = []

    async def receive():
        taken.append(100)
        return {"type": "http.request", "body": b" " * 100, "more_body": len(taken) < 10_000}

    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
             "query_string": b"", "headers": [(b"host", b"127.0.0.1:1"), (b"content-type", b"application/json")],
             "scheme": "http", "server": ("127.0.0.1", 1), "client": ("127.0.0.1", 2), "root_path": "", "http_version": "1.1"}
    asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 413
    assert sum(taken) <= 1000 + 100


def test_max_tokens_above_the_cap_is_400_in_openai_shape(server):
    base = server.base_url
    for field in ("max_tokens", "max_completion_tokens"):
        body = {"model": "licence.kv", "messages": [{"role": "user", "content": Q}], field: 1_000_000}
        r = httpx.post(base + "/chat/completions", json=body, timeout=30)
        assert r.status_code == 400 and _is_openai_error(r)
        err = r.json()["error"]
        assert err["param"] == field and "at most 16" in err["message"] and err["type"] == "invalid_request_error"
    r = httpx.post(base + "/chat/completions", json=_chat(max_tokens=16), timeout=60)
    assert r.status_code == 200


def test_stop_as_a_string_is_one_stop(server):
    from kvcli.serve import openai_api as oa

    assert oa.parse_chat(_chat(stop="ab")).stop == ("ab",)  # OpenAI's string form: one stop, not 'a' and 'b'
    with pytest.raises(oa.ApiError):
        oa.parse_chat(_chat(stop=["a", ""]))


def test_not_a_number_is_400_naming_the_field(server):
    """NaN and Infinity (Python's json reads them) in a number field: a 400 naming it, never a 500."""
    for field, extra in (("recompute", {"documents": ["licence.kv", "licence.kv"]}), ("temperature", {}), ("top_p", {})):
        for value in ("NaN", "Infinity", "-Infinity"):
            body = json.dumps(_chat(**extra))[:-1] + f', "{field}": {value}}}'
            r = httpx.post(server.base_url + "/chat/completions", content=body, headers={"Content-Type": "application/json"}, timeout=60)
            assert r.status_code == 400 and _is_openai_error(r), (field, value, r.text)
            assert r.json()["error"]["param"] == field, (field, value, r.text)


def test_no_server_paths_in_models_or_errors(server, folder, tmp_path):
    base = server.base_url
    r = httpx.get(base + "/models", timeout=30)
    assert r.status_code == 200 and str(folder) not in r.text and str(folder.parent) not in r.text
    assert "path" not in r.json()["data"][0]["kvcli"]
    one = httpx.get(base + "/models/licence.kv", timeout=30)
    assert one.status_code == 200 and str(folder.parent) not in one.text
    # a cache that no longer fits: 409, named by its id
    docs = tmp_path / "docs"
    shutil.copytree(folder / "licence.kv", docs / "broken.kv")
    (docs / "junk.kv").mkdir()
    (docs / "junk.kv" / "manifest.json").write_text("{")
    manifest = docs / "broken.kv" / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"licence.txt"', '"other.txt"'))
    srv = http.start("127.0.0.1", 0, docs=[docs])
    try:
        listed = httpx.get(srv.base_url + "/models", timeout=30)
        assert str(tmp_path) not in listed.text
        r = httpx.post(srv.base_url + "/chat/completions", json=_chat(model="broken.kv"), timeout=60)
        assert r.status_code == 409 and _is_openai_error(r)
        assert str(tmp_path) not in r.text and "broken.kv" in r.json()["error"]["message"]
    finally:
        srv.stop()


class _Failing(DocsProvider):
    def open(self, model_id):
        raise KvcliError(f"{self.folders[0]}/secret.kv: cannot load /home/someone/models/private-model (disk full)")


def test_no_server_paths_in_500(folder):
    srv = http.start("127.0.0.1", 0, provider=_Failing([folder]))
    try:
        r = httpx.post(srv.base_url + "/chat/completions", json=_chat(), timeout=30)
    finally:
        srv.stop()
    assert r.status_code == 500 and _is_openai_error(r)
    message = r.json()["error"]["message"]
    assert str(folder) not in message and "/home/someone" not in message
    assert message == "secret.kv: cannot load private-model (disk full)"
