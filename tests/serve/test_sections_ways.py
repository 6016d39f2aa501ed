"""Sectioned caches through every way in: the warm socket server (`kvcli ask --server`) and the HTTP endpoint answer
them as in process, with the same sections, the same answer and the sources (the socket's records, HTTP's `kvcli`
block, streamed or not); a follow-up is refused there as here. Chains (--after), blends, follow-ups and --kv-bits
are refused with a message saying why, before anything is written."""

from __future__ import annotations

import json

import pytest

from kvcli.errors import UsageError
from kvcli.requests import AskRequest, Sections
from tests.conftest import sample_text
from tests.helpers import assert_clean_error, json_lines, run
from tests.serve_helpers import ThreadServer, short_dir

Q = "What does the licence say about trademarks?"
ASK = ("--max-new-tokens", "4", "--json")


@pytest.fixture(scope="module")
def cached(tiny_model_dir, here):
    folder = here / "docs"
    folder.mkdir()
    doc = here / "long.txt"
    doc.write_text(sample_text(), encoding="utf-8")
    made = run("prefill", doc, "-o", folder / "long.kv", "--model", tiny_model_dir, "--window", "1024", "--no-server")
    assert made.exit_code == 0, made.stderr
    return folder / "long.kv"


@pytest.fixture(scope="module")
def plain(cached, tiny_model_dir, here):
    """A cache of one prompt beside the sectioned one."""
    doc = here / "short.txt"
    doc.write_text(sample_text()[:1200], encoding="utf-8")
    made = run("prefill", doc, "-o", cached.parent / "short.kv", "--model", tiny_model_dir, "--no-server")
    assert made.exit_code == 0, made.stderr
    return cached.parent / "short.kv"


@pytest.fixture(scope="module")
def alone(cached, tiny_model_dir):
    """The in-process answers, to compare each front end with."""
    out = {}
    for extra in ((), ("--sections", "1")):
        result = run("ask", "-c", cached, "--model", tiny_model_dir, Q, *ASK, *extra, "--no-server")
        assert result.exit_code == 0, result.stderr
        out[extra] = json_lines(result.stdout)[0]
    return out


@pytest.fixture(scope="module")
def server():
    srv = ThreadServer(short_dir() / "s.sock")
    yield srv
    srv.close()


def test_sections_go_on_the_wire():
    request = AskRequest(caches=("a.kv",), questions=("Q?",), sections=Sections(count=2, recompute=0.3))
    wire = json.loads(json.dumps(request.to_wire()))
    assert wire["sections"] == {"count": 2, "every": False, "recompute": 0.3}
    assert AskRequest.from_wire(wire).sections == request.sections
    assert AskRequest.from_wire({**wire, "sections": None}).sections is None
    with pytest.raises(UsageError, match="give one"):
        AskRequest.from_wire({**wire, "sections": {"count": 2, "every": True}})


def test_the_socket_server_answers_a_sectioned_cache(cached, alone, tiny_model_dir, server, monkeypatch):
    monkeypatch.setenv("KVCLI_SOCKET", str(server.path))
    for extra, want in alone.items():
        result = run("ask", "-c", cached, "--model", tiny_model_dir, Q, *ASK, *extra, "--server")
        assert result.exit_code == 0, result.stderr
        got = json_lines(result.stdout)[0]
        assert got["served"] is True and want["served"] is False
        assert got["sources"] == want["sources"] and got["document_share"] == want["document_share"]
        assert got["answer_token_ids"] == want["answer_token_ids"] and got["cached_tokens"] == want["cached_tokens"]
        assert "sections of a document longer than the window" in result.stderr
    assert len(alone[("--sections", "1")]["sources"]) == 1
    text = run("ask", "-c", cached, "--model", tiny_model_dir, Q, "--max-new-tokens", "4", "--server")
    assert text.exit_code == 0 and text.stdout.rstrip("\n").split("\n")[-1].startswith("[sources: lines ")
    rows = [c for c in server.server.warm.status()["caches"] if c["path"] == str(cached)]
    from kvcli.format import store

    assert rows and {r["num_tokens"] for r in rows} == {store.read_manifest(cached).document_tokens}
    assert sum(r["answers"] for r in rows) == 3 and all(r["batch"]["asked"] >= 1 for r in rows)


def test_http_answers_a_sectioned_cache_with_its_sources(cached, plain, alone, tiny_model_dir):
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    pytest.importorskip("sse_starlette")
    httpx = pytest.importorskip("httpx")
    from kvcli.serve import http
    from kvcli.serve.docs import DocsProvider

    want = alone[()]
    srv = http.start("127.0.0.1", 0, provider=DocsProvider([cached.parent], model=str(tiny_model_dir)))
    try:
        url = srv.base_url + "/chat/completions"
        body = {"model": "long.kv", "messages": [{"role": "user", "content": Q}], "max_tokens": 4}
        got = httpx.post(url, json=body, timeout=120)
        assert got.status_code == 200, got.text
        out = got.json()
        assert out["choices"][0]["message"]["content"] == want["answer"]
        assert out["kvcli"]["sources"] == want["sources"] and out["kvcli"]["document_share"] == want["document_share"]
        streamed = httpx.post(url, json={**body, "stream": True}, timeout=120)
        chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == want["answer"]
        closing = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        assert len(closing) == 1 and closing[0]["kvcli"]["sources"] == want["sources"]
        assert all("kvcli" not in c for c in chunks if c is not closing[0])
        follow = {**body, "messages": [{"role": "user", "content": "Who?"}, {"role": "assistant", "content": "Me."},
                                       {"role": "user", "content": Q}]}
        refused = httpx.post(url, json=follow, timeout=120)
        assert refused.status_code == 400 and "a follow-up cannot continue it" in refused.text
        blend = {**body, "model": "long.kv", "documents": ["long.kv", "short.kv"]}
        refused = httpx.post(url, json=blend, timeout=120)
        assert refused.status_code == 409 and "cannot be blended" in refused.text
    finally:
        srv.stop()


def test_http_sections_field_builds_the_request_ask_builds():
    pytest.importorskip("starlette")
    from kvcli.serve import openai_api as oa

    body = {"model": "long.kv", "messages": [{"role": "user", "content": Q}]}
    assert oa.parse_chat(body).sections is None
    assert oa.parse_chat({**body, "sections": 2}).sections == Sections(count=2)  # ask --sections 2
    assert oa.parse_chat({**body, "sections": "all"}).sections == Sections(every=True)  # ask --all
    assert oa.parse_chat({**body, "sections": 1, "recompute": 0.5}).sections == Sections(count=1, recompute=0.5)
    assert oa.parse_completion({"model": "long.kv", "prompt": Q, "sections": 3}).sections == Sections(count=3)
    for bad in (0, -1, 1.5, True, "2", "every", [1], {"count": 1}):
        with pytest.raises(oa.ApiError) as err:
            oa.parse_chat({**body, "sections": bad})
        assert err.value.status == 400 and err.value.param == "sections" and '"all"' in err.value.message
    for bad in (-0.1, 1.5, "0.5"):
        with pytest.raises(oa.ApiError) as err:
            oa.parse_chat({**body, "sections": 1, "recompute": bad})
        assert err.value.status == 400 and err.value.param == "recompute"
    with pytest.raises(oa.ApiError) as err:
        oa.parse_chat({**body, "sections": 1, "documents": ["long.kv", "short.kv"]})
    assert err.value.param == "sections" and "never blended" in err.value.message
    with pytest.raises(oa.ApiError) as err:
        oa.parse_chat({**body, "recompute": 0.5})
    assert err.value.param == "recompute" and "or sections" in err.value.message


@pytest.fixture(scope="module")
def chosen(cached, tiny_model_dir):
    """In-process answers with the sections chosen by --all and by --sections 1 --recompute 1."""
    out = {}
    for extra in (("--all",), ("--sections", "1", "--recompute", "1")):
        result = run("ask", "-c", cached, "--model", tiny_model_dir, Q, *ASK, *extra, "--no-server")
        assert result.exit_code == 0, result.stderr
        out[extra] = json_lines(result.stdout)[0]
    return out


def test_http_chooses_sections_as_ask_does(cached, plain, alone, chosen, tiny_model_dir):
    """The `sections` field (and `recompute` with it) answers as `ask --sections N`, `--all` and `--recompute F` do: the same
    answer from the same sections; a cache of one prompt refuses it (400), naming the field."""
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    pytest.importorskip("sse_starlette")
    httpx = pytest.importorskip("httpx")
    from kvcli.serve import http
    from kvcli.serve.docs import DocsProvider

    provider = DocsProvider([cached.parent], model=str(tiny_model_dir))
    srv = http.start("127.0.0.1", 0, provider=provider)
    try:
        url = srv.base_url + "/chat/completions"
        body = {"model": "long.kv", "messages": [{"role": "user", "content": Q}], "max_tokens": 4}
        for extra, fields in ((("--sections", "1"), {"sections": 1}), (("--all",), {"sections": "all"}),
                              (("--sections", "1", "--recompute", "1"), {"sections": 1, "recompute": 1})):
            want = alone[extra] if extra in alone else chosen[extra]
            got = httpx.post(url, json={**body, **fields}, timeout=120)
            assert got.status_code == 200, got.text
            out = got.json()
            assert out["choices"][0]["message"]["content"] == want["answer"], extra
            assert out["kvcli"]["sources"] == want["sources"] and out["kvcli"]["document_share"] == want["document_share"]
            assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == want["cached_tokens"]
        assert len(chosen[("--all",)]["sources"]) == 7 > len(alone[("--sections", "1")]["sources"]) == 1
        streamed = httpx.post(url, json={**body, "sections": 1, "stream": True}, timeout=120)
        chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
        closing = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        assert closing[0]["kvcli"]["sources"] == alone[("--sections", "1")]["sources"]
        text = httpx.post(srv.base_url + "/completions", json={"model": "long.kv", "prompt": Q, "max_tokens": 4, "sections": 1},
                          timeout=120)
        assert text.status_code == 200 and text.json()["choices"][0]["text"] == alone[("--sections", "1")]["answer"]
        refused = httpx.post(url, json={**body, "model": "short.kv", "sections": 1}, timeout=120)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "sections" and "'short.kv' is not a sectioned cache" in error["message"]
        assert str(cached.parent) not in refused.text
        refused = httpx.post(url, json={**body, "sections": 0}, timeout=120)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "sections"
        assert httpx.post(url, json=body, timeout=120).status_code == 200  # no field: the defaults
        held = [c["path"] for c in provider.warm.status()["caches"]]
        assert len(held) == 4 and not any("short.kv" in p for p in held), held  # sections 1, all, recompute 1, the defaults
    finally:
        srv.stop()
        provider.warm.close()


def test_chains_blends_and_kv_bits_are_refused_saying_why(cached, plain, tiny_model_dir, here):
    doc, short = here / "long.txt", here / "short.txt"
    m = ("--model", tiny_model_dir, "--no-server")
    assert_clean_error(run("prefill", short, "-o", here / "c1.kv", "--after", cached, *m), 2,
                       "is a sectioned cache", "--after extends only a cache of one prompt")
    assert_clean_error(run("prefill", doc, "-o", here / "c2.kv", "--after", plain, "--window", "1024", *m), 2,
                       "--window", "(--after) is not cut")
    assert_clean_error(run("prefill", doc, "-o", here / "c3.kv", "--window", "1024", "--kv-bits", "8", *m), 2,
                       "--kv-bits does not apply to a sectioned cache")
    for order in ((cached, plain), (plain, cached)):
        blended = run("ask", "--blend", "-c", order[0], "-c", order[1], "Who?", *m)
        assert_clean_error(blended, 3, f"{cached}: a sectioned cache", "cannot be blended")
    assert_clean_error(run("ask", "-c", cached, "Who?", "--follow-up", here / "earlier.json", *m), 2,
                       "--follow-up cannot continue a sectioned cache's prompt")
    assert not any((here / f"c{i}.kv").exists() for i in (1, 2, 3))
    both = run("ask", "-c", cached, "-c", plain, "Who?", "--max-new-tokens", "2", "--json", *m)  # one after the other
    assert both.exit_code == 0, both.stderr
    first, second = json_lines(both.stdout)
    assert first["sources"] and "sources" not in second
