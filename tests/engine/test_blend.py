"""Blending caches prefilled apart into one prompt (engine/cache/blend.py, `ask --blend`).

The composed prompt's ids follow the documented rule; a cached key moved by d equals the key the model
computes at its position + d; with every later document recomputed (fraction 1) the answers equal
generate() on the composed ids (tiny llama, tiny qwen2, the real default model); models whose keys cannot
move, caches that do not join and bad fractions are refused with their exit codes; the CLI says a blended
answer is approximate and --check measures it against a full recompute of the same composed prompt.
"""

from __future__ import annotations

import pytest
import torch

import kvcli
from kvcli.documents import decode
from kvcli.engine.cache import blend
from kvcli.engine.cache.kvcache import KVCache
from kvcli.engine.prefilling import prefill
from kvcli.engine.prompt import framing as fr
from kvcli.errors import BlendError, CacheMismatchError, UsageError
from kvcli.format.store import read_manifest
from tests.conftest import reference_answer, sample_text
from tests.helpers import assert_clean_error, json_lines, run
from tests.architectures import build

SLICES = ((0, 900), (3000, 3900), (6000, 6700))  # three different parts of the sample: ~200 tokens each
QUESTIONS = ("Who grants the licence?", "What does the second part say about patents?")
MAX_NEW = 8
OPTS = kvcli.GenerationOptions(max_new_tokens=MAX_NEW)


def _prefill_all(lm, folder, slices=SLICES, **kw) -> list:
    text, paths = sample_text(), []
    for i, (a, b) in enumerate(slices):
        path = folder / f"doc{i}.kv"
        prefill(lm, decode(text[a:b].encode(), f"doc{i}.txt"), path, **kw)
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def llama_caches(tiny_lm, here) -> list:
    return _prefill_all(tiny_lm, here)


def test_composed_ids_follow_the_rule(tiny_lm, llama_caches):
    tok = tiny_lm.tokenizer
    session = kvcli.Session(tiny_lm, llama_caches, blend=0.0)
    ms = [read_manifest(p) for p in llama_caches]
    framing = fr.Framing.from_record(ms[0].framing)
    head = fr.head_ids(tok, framing)
    sep = tok(fr.SEPARATOR, add_special_tokens=False)["input_ids"]
    assert head and all(m.token_ids[: len(head)] == head for m in ms)
    expected = ms[0].token_ids + sep + ms[1].token_ids[len(head):] + sep + ms[2].token_ids[len(head):]
    assert session.token_ids == expected
    assert session.cache.get_seq_length() == len(expected)
    # fraction 0: only the glue runs forward; every later document's own tokens are moved
    assert session.blended["recomputed_tokens"] == 2 * len(sep)
    assert session.blended["moved_tokens"] == sum(len(m.token_ids) - len(head) for m in ms[1:])
    assert session.prompt_ids("Why?") == expected + fr.question_ids(tok, framing, "Why?", expected)
    partial = kvcli.Session(tiny_lm, llama_caches, blend=0.5)
    assert partial.token_ids == expected
    assert partial.blended["recomputed_tokens"] == 2 * len(sep) + sum(-(-(len(m.token_ids) - len(head)) // 2) for m in ms[1:])


@pytest.mark.parametrize("name,over", [
    ("llama", {}),  # llama3 rope scaling
    ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}}),
    ("qwen2", {}),
    ("qwen3", {}),
])
def test_a_moved_key_equals_the_key_computed_there(tokenizer, name, over):
    model = build(name, tokenizer, **over)
    lm = kvcli.from_objects(model, tokenizer, name=f"tiny-{name}")
    ids = torch.tensor([tokenizer(sample_text()[:800])["input_ids"][:120]])  # [1, 120]
    d = 777
    at0, atd = KVCache.for_model(model.config), KVCache.for_model(model.config)
    with torch.inference_mode():
        model(input_ids=ids, cache=at0, use_cache=True)
        model(input_ids=ids, position_ids=torch.arange(d, d + ids.shape[1])[None], cache=atd, use_cache=True)
    cos, sin = blend.rotation(lm, d)
    for here, there in zip(at0.layers, atd.layers):
        assert not torch.allclose(here.keys, there.keys, atol=1e-2)  # the positions matter ...
        torch.testing.assert_close(blend.move_keys(here.keys, cos, sin), there.keys, atol=2e-4, rtol=1e-3)  # ... one rotation moves them
        torch.testing.assert_close(here.values, there.values, atol=2e-4, rtol=1e-3)  # values carry no position


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_recomputing_everything_is_exact(tokenizer, name, tmp_path):
    model = build(name, tokenizer)
    lm = kvcli.from_objects(model, tokenizer, name=f"tiny-{name}")
    paths = _prefill_all(lm, tmp_path)
    session = kvcli.Session(lm, paths, blend=1.0)
    assert session.blended["moved_tokens"] == 0
    for q in QUESTIONS:
        a = session.ask(q, OPTS)
        assert a.prompt_token_ids[: len(session.token_ids)] == session.token_ids
        assert a.answer_token_ids == reference_answer(model, a.prompt_token_ids, MAX_NEW)
        assert a.blended["documents"] == 3 and a.blended["recompute"] == 1.0
    from kvcli.format import store

    opened = [store.open_cache(p) for p in paths]
    try:  # the other selection rule the benchmark measures: at 1 it recomputes everything too
        last = blend.compose(lm, opened, 1.0, rule="last")
    finally:
        for o in opened:
            o.close()
    assert last.token_ids == session.token_ids and last.moved_tokens == 0
    for here, there in zip(last.cache.states(), session.cache.states()):
        torch.testing.assert_close(here.keys, there.keys)


def test_default_model_exact_at_one_and_checked_below(default_lm, tmp_path):
    paths = _prefill_all(default_lm, tmp_path, slices=SLICES[:2])
    exact = kvcli.ask(default_lm, paths, [QUESTIONS[0]], OPTS, blend=1.0)[0]
    assert exact.answer_token_ids == reference_answer(default_lm.model, exact.prompt_token_ids, MAX_NEW)
    approx = kvcli.Session(default_lm, paths, blend=0.15).ask(QUESTIONS[0], OPTS, check=True)
    assert approx.prompt_token_ids == exact.prompt_token_ids  # the same composed prompt, however much is recomputed
    assert approx.check.blended == approx.blended and approx.check.tokens == len(approx.answer_token_ids)
    assert "2 caches blended (0.15 recomputed" in approx.check.describe()


@pytest.mark.parametrize("name,over,needle", [
    ("gpt2", {}, "absolute positions"),
    ("mistral", {}, "sliding-window"),
    ("gemma3_text", {}, "sliding-window"),
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}, "dynamic"),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                   "original_max_position_embeddings": 2048}}, "yarn"),
    ("phi3", {"sliding_window": None}, "partial rotary"),
])
def test_models_whose_keys_cannot_move_are_refused(tokenizer, plain_tokenizer, name, over, needle):
    tok = plain_tokenizer if name == "gpt2" else tokenizer
    lm = kvcli.from_objects(build(name, tok, **over), tok, name=f"tiny-{name}")
    with pytest.raises(BlendError, match=needle) as err:
        blend.check_supported(lm)
    assert err.value.exit_code == 3


def test_a_refused_model_loads_nothing_more(tokenizer, tmp_path):
    lm = kvcli.from_objects(build("mistral", tokenizer), tokenizer, name="tiny-mistral")
    paths = _prefill_all(lm, tmp_path, slices=SLICES[:2])
    with pytest.raises(BlendError, match="sliding-window"):
        kvcli.Session(lm, paths, blend=0.15)


def test_caches_that_do_not_join_are_refused(tiny_lm, llama_caches, tmp_path, tokenizer):
    plain = prefill(tiny_lm, decode(b"A short plain note about licences.", "n.txt"), tmp_path / "plain.kv", framing="plain")
    with pytest.raises(CacheMismatchError, match="framed differently"):
        kvcli.Session(tiny_lm, [llama_caches[0], plain.path], blend=0.15)
    with pytest.raises(UsageError, match="blended"):
        kvcli.Session(tiny_lm, llama_caches[:2])
    with pytest.raises(UsageError, match="fraction"):
        kvcli.Session(tiny_lm, llama_caches[:2], blend=1.5)
    other = kvcli.from_objects(build("qwen2", tokenizer), tokenizer, name="tiny-qwen2")
    with pytest.raises(CacheMismatchError, match="another model"):
        kvcli.Session(other, llama_caches[:2], blend=0.15)


def test_a_cut_framing_before_the_last_document_goes_into_the_glue(tokenizer):
    cached = tokenizer("The licence ends here", add_special_tokens=False)["input_ids"]
    anchor = tokenizer.decode(cached[-1:])
    cut = fr.Framing("plain", anchor=anchor, anchor_tokens=1, pending=".")
    glue = blend._glue(tokenizer, cut, cached, "doc.kv")
    whole = tokenizer(anchor + "." + fr.SEPARATOR, add_special_tokens=False)["input_ids"]
    assert whole[:1] == cached[-1:] and glue == whole[1:]
    with pytest.raises(BlendError, match="tokenizes differently"):
        blend._glue(tokenizer, cut, cached[:-1], "doc.kv")


# ---- the command line


@pytest.fixture(scope="module")
def cli_caches(tiny_model_dir, here) -> list:
    text, paths = sample_text(), []
    for i, (a, b) in enumerate(SLICES[:2]):
        doc = here / f"cli{i}.txt"
        doc.write_text(text[a:b], encoding="utf-8")
        result = run("prefill", doc, "--model", tiny_model_dir)
        assert result.exit_code == 0, result.stderr
        paths.append(doc.with_suffix(".kv"))
    return paths


def test_cli_blend_answers_once_and_says_it_is_approximate(cli_caches):
    a, b = cli_caches
    result = run("ask", "--cache", a, "--cache", b, "--blend", "--max-new-tokens", MAX_NEW, QUESTIONS[0])
    assert result.exit_code == 0, result.stderr
    assert result.stdout.count("\n") == 1 and result.stdout.strip()
    assert "approximate" in result.stderr and "2 caches blended" in result.stderr
    [answer] = json_lines(run("ask", "-c", a, "-c", b, "--blend", "--recompute", "0.3", "--json", "--max-new-tokens", MAX_NEW,
                              QUESTIONS[0]).stdout)
    assert answer["blended"]["documents"] == 2 and answer["blended"]["recompute"] == 0.3
    assert answer["blended"]["caches"] == [str(a), str(b)] and answer["cache"] == f"{a} + {b}"
    assert answer["answer"] == run("ask", "-c", a, "-c", b, "--blend", "--recompute", "0.3", "--max-new-tokens", MAX_NEW,
                                   QUESTIONS[0]).stdout.removesuffix("\n")
    several = json_lines(run("ask", "-c", a, "-c", b, "--json", "--max-new-tokens", MAX_NEW, QUESTIONS[0]).stdout)
    assert [x["cache"] for x in several] == [str(a), str(b)] and all("blended" not in x for x in several)  # no --blend: one by one


def test_cli_check_measures_a_blend_against_the_recompute(cli_caches):
    a, b = cli_caches
    result = run("ask", "-c", a, "-c", b, "--blend", "--recompute", "1", "--check", "--max-new-tokens", MAX_NEW, QUESTIONS[0])
    assert result.exit_code == 0, result.stderr
    assert f"kvcli: check: {a} + {b}: 2 caches blended (1 recomputed, differences expected): identical" in result.stderr
    result = run("ask", "-c", a, "-c", b, "--blend", "--recompute", "0", "--check", "--json", "--max-new-tokens", MAX_NEW, QUESTIONS[0])
    [answer] = json_lines(result.stdout)
    check = answer["check"]
    assert result.exit_code == (0 if check["identical"] else 4)
    assert check["blended"]["recompute"] == 0.0 and 0.0 <= check["agreement"] <= 1.0 and check["kl_mean"] >= 0.0


def test_cli_refusals_and_their_exit_codes(cli_caches, tmp_path, tokenizer):
    a, b = cli_caches
    assert_clean_error(run("ask", "-c", a, "--recompute", "0.2", "q"), 2, "--blend")
    assert_clean_error(run("ask", "-c", a, "--blend", "q"), 2, "at least twice")
    assert_clean_error(run("ask", "-c", a, "-c", b, "--blend", "--recompute", "2", "q"), 2, "fraction")
    folder = tmp_path / "mistral"
    build("mistral", tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    doc = tmp_path / "m.txt"
    doc.write_text(sample_text()[:600], encoding="utf-8")
    assert run("prefill", doc, "--model", folder).exit_code == 0
    m = doc.with_suffix(".kv")
    assert_clean_error(run("ask", "-c", m, "-c", m, "--blend", "q"), 3, "sliding-window")
    assert_clean_error(run("ask", "-c", a, "-c", m, "--blend", "q"), 3, "another model")


# ---- HTTP: a request names several documents (extra_body)


def test_http_documents_field_blends_the_caches(tiny_model_dir, tmp_path):
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    pytest.importorskip("sse_starlette")
    openai = pytest.importorskip("openai")
    from kvcli.serve import http
    from kvcli.serve.docs import DocsProvider

    lm = kvcli.load(str(tiny_model_dir))
    a, b = _prefill_all(lm, tmp_path, slices=SLICES[:2])
    alone = kvcli.Session(lm, [a, b], blend=1.0).ask(QUESTIONS[0], OPTS)
    srv = http.start("127.0.0.1", 0, provider=DocsProvider([tmp_path]))
    try:
        client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": QUESTIONS[0]}]
        got = client.chat.completions.create(model="kvcli-blend", messages=messages, max_tokens=MAX_NEW,
                                             extra_body={"documents": [a.name, b.name], "recompute": 1.0})
        assert got.choices[0].message.content == alone.answer
        assert got.usage.prompt_tokens == len(alone.prompt_token_ids)
        blended = got.model_extra["kvcli"]["blended"]
        assert blended["documents"] == 2 and blended["recompute"] == 1.0 and "caches" not in blended  # no server paths
        first = client.chat.completions.create(model=a.name, messages=messages, max_tokens=MAX_NEW,
                                               extra_body={"documents": [a.name, b.name]})  # the first's id, the default fraction
        assert first.model_extra["kvcli"]["blended"]["recompute"] == blend.DEFAULT_RECOMPUTE
        for extra, status, param in (({"documents": [a.name]}, 400, "documents"),
                                     ({"documents": [a.name, b.name], "recompute": 2}, 400, "recompute"),
                                     ({"recompute": 0.5}, 400, "recompute"),
                                     ({"documents": [a.name, "nope.kv"]}, 404, "documents")):
            with pytest.raises(openai.APIStatusError) as err:
                client.chat.completions.create(model="kvcli-blend" if "documents" in extra else a.name, messages=messages,
                                               max_tokens=MAX_NEW, extra_body=extra)
            assert err.value.status_code == status and err.value.body["param"] == param
        with pytest.raises(openai.APIStatusError) as err:
            client.chat.completions.create(model=b.name, messages=messages, max_tokens=MAX_NEW,
                                           extra_body={"documents": [a.name, b.name]})
        assert err.value.status_code == 400 and err.value.body["param"] == "model"
    finally:
        srv.stop()


# ---- the warm server (unix socket)


def test_served_blend_prints_what_the_in_process_one_prints(cli_caches, monkeypatch):
    from tests.serve_helpers import ThreadServer, short_dir

    a, b = cli_caches
    s = ThreadServer(short_dir() / "s.sock")
    monkeypatch.setenv("KVCLI_SOCKET", str(s.path))
    try:
        args = ("ask", "-c", a, "-c", b, "--blend", "--recompute", "0.3", "--json", "--ids", "--max-new-tokens", MAX_NEW, QUESTIONS[0])
        served, local = run(*args, "--server"), run(*args, "--no-server")
        assert served.exit_code == local.exit_code == 0, (served.stderr, local.stderr)
        [x], [y] = json_lines(served.stdout), json_lines(local.stdout)
        assert x["served"] and not y["served"]
        assert x["answer_token_ids"] == y["answer_token_ids"] and x["prompt_token_ids"] == y["prompt_token_ids"]
        assert x["blended"]["recompute"] == y["blended"]["recompute"] == 0.3 and x["cache"] == y["cache"] == f"{a} + {b}"
        assert served.stderr == local.stderr and "approximate" in served.stderr
        again = run(*args, "--server")  # the blend is held warm: answered again from the same entry
        assert json_lines(again.stdout)[0]["answer_token_ids"] == x["answer_token_ids"]
    finally:
        s.close()


def test_a_chain_link_blends_as_its_whole_prompt(tiny_lm, llama_caches, tmp_path):
    text = sample_text()
    link = prefill(tiny_lm, decode(text[7000:7600].encode(), "more.txt"), tmp_path / "more.kv", after=llama_caches[1]).path
    assert read_manifest(link).base is not None  # a link: its own tokens stored, its base's restored with it
    session = kvcli.Session(tiny_lm, [llama_caches[0], link], blend=1.0)
    head = fr.head_ids(tiny_lm.tokenizer, session.framing)
    whole = read_manifest(link).token_ids  # the chain's ids: its base's and its own
    assert session.token_ids[-(len(whole) - len(head)):] == whole[len(head):]
    a = session.ask(QUESTIONS[0], OPTS)
    assert a.answer_token_ids == reference_answer(tiny_lm.model, a.prompt_token_ids, MAX_NEW)


def test_a_server_that_does_not_echo_the_blend_is_not_used(monkeypatch):
    from kvcli.cli import served
    from kvcli.cli.output import Output
    from kvcli.errors import ServerError
    from kvcli.requests import AskRequest, Blend
    from kvcli.serve import client

    closed = []

    class Older:  # a server from before blending: it accepts the ask without the echo (it would answer each cache alone)
        accepted = {"event": "accepted", "op": "ask"}

        def close(self) -> None:
            closed.append(True)

    monkeypatch.setattr(client, "open_request", lambda *_a, **_k: Older())
    request = AskRequest(caches=("a.kv", "b.kv"), questions=("Q?",), blend=Blend(0.15))
    assert served.run(Output(quiet=True), None, request, []) is None  # this process blends instead
    with pytest.raises(ServerError, match="cannot blend"):
        served.run(Output(quiet=True), True, request, [])
    assert closed == [True, True]
