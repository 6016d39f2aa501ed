"""kvcli count (issue 24, item 9) and "a refused request loads nothing".

count reads config.json and the tokenizer without torch where transformers' Auto classes would give the same
(engine/model/light.py): here that is compared with the Auto classes on tiny models of every light type and on
the real default model, and with what prefill caches. Its time estimate comes from the prefills recorded on this
machine (engine/throughput.py): tested as a unit (records in, estimate out) and end to end (a prefill records,
count uses it). A document too long for the model, or a model that does not exist, is refused before any weights
load, in-process and in the server (the weight loader is replaced by one that fails the test).
"""

from __future__ import annotations

import json
import shutil
import statistics

import pytest

from kvcli.documents import decode
from kvcli.engine import counting, throughput
from kvcli.engine.model import light
from tests.conftest import sample_text, tiny_llama
from tests.helpers import assert_clean_error, error_lines, json_lines, run, run_python

TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=2048)
DOC = decode(sample_text()[:3000].encode(), "d.txt")


def _folder(tmp_path, tokenizer_dir, model_type: str, **overrides):
    """A model folder without weights: a tiny config of this type and the real SmolLM2 tokenizer."""
    from transformers import AutoConfig

    folder = tmp_path / f"{model_type}-{len(overrides)}"
    AutoConfig.for_model(model_type, **{**TINY, **overrides}).save_pretrained(folder)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, folder / f.name)
    return folder


def _through_transformers(monkeypatch, *args, **kwargs) -> counting.Counter:
    """A Counter that reads config and tokenizer with transformers' Auto classes (what count did before)."""
    with monkeypatch.context() as m:
        m.setattr(light, "load", lambda folder: "forced for the test")
        counter = counting.Counter(*args, **kwargs)
    assert counter.loaded.startswith("config and tokenizer through transformers")
    return counter


def _same(a: counting.Counter, b: counting.Counter, doc=DOC) -> None:
    assert a.plan == b.plan and a.max_positions == b.max_positions and a.params == b.params and a.dtype == b.dtype
    assert (a.kv_heads, a.head_dim, a.framing) == (b.kv_heads, b.head_dim, b.framing)
    assert a.count(doc) == b.count(doc)


@pytest.mark.parametrize("model_type, overrides", [
    ("llama", {}),
    ("mistral", {"sliding_window": 32}),
    ("mistral", {"sliding_window": None}),
    ("qwen3", {}),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 2}),
    ("granite", {}),
])
@pytest.mark.parametrize("framing, system", [("auto", None), ("plain", None), ("chat", "Answer briefly.")])
def test_light_equals_the_auto_classes(tmp_path, tokenizer_dir, monkeypatch, model_type, overrides, framing, system):
    from transformers import AutoTokenizer

    from kvcli.engine.prompt import framing as fr

    folder = _folder(tmp_path, tokenizer_dir, model_type, **overrides)
    got = counting.Counter(str(folder), framing=framing, system=system)
    assert got.loaded == counting.LIGHT
    _same(got, _through_transformers(monkeypatch, str(folder), framing=framing, system=system))
    auto = AutoTokenizer.from_pretrained(folder)
    assert type(auto) is type(got.tokenizer)
    assert fr.document_ids(auto, got.framing, DOC.text) == fr.document_ids(got.tokenizer, got.framing, DOC.text)
    if overrides.get("sliding_window"):
        assert any(kind == "sliding" for kind, _ in got.plan)  # the case is the one it claims to be


@pytest.mark.parametrize("model_type, overrides, why", [
    ("qwen3", {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 2, "layer_types": None}, "sliding"),
    ("olmo2", {}, "model type"),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rotary"),
])
def test_other_models_are_read_through_transformers_and_say_so(tmp_path, tokenizer_dir, monkeypatch, model_type, overrides, why):
    folder = _folder(tmp_path, tokenizer_dir, model_type, **overrides)
    if "layer_types" in overrides:  # a config.json written without layer_types (older transformers, hand-written)
        import json

        data = json.loads((folder / "config.json").read_text())
        data.pop("layer_types", None)
        (folder / "config.json").write_text(json.dumps(data))
    got = counting.Counter(str(folder))
    assert got.loaded.startswith("config and tokenizer through transformers") and why in got.loaded, got.loaded
    assert got.count(DOC).tokens > 0


def test_a_multi_query_model_is_counted_with_the_shape_its_fingerprint_records(tmp_path, tokenizer_dir):
    """count reads heads as prefill's fingerprint does (engine/model/fingerprint.shape): falcon-7b's multi-query
    attention keeps one key/value head, whatever its attention head count."""
    from transformers import AutoConfig

    from kvcli.engine.model.fingerprint import shape

    folder = _folder(tmp_path, tokenizer_dir, "falcon", multi_query=True, new_decoder_architecture=False)
    got = counting.Counter(str(folder))
    assert shape(AutoConfig.from_pretrained(folder))["num_kv_heads"] == got.kv_heads == 1 and got.head_dim == 16
    c = got.count(DOC)
    assert c.bytes_raw == 2 * 1 * 16 * counting.ITEMSIZE[c.dtype] * c.tokens * 4  # keys + values of one head, 4 layers


def test_default_model_light_equals_what_prefill_caches(default_lm, monkeypatch):
    """The real default model: count's ids are the ids prefill caches, for each framing."""
    from kvcli.engine import prefilling as pf
    from kvcli.engine.cache import layers
    from kvcli.engine.prompt import framing as fr

    doc = decode(sample_text().encode(), "document.txt")
    for framing, system in (("auto", None), ("plain", None), ("chat", "You answer from the document.")):
        got = counting.Counter(None, framing=framing, system=system)
        assert got.loaded == counting.LIGHT
        frame = fr.choose(default_lm.tokenizer, framing, system)
        assert got.tokens(doc) == len(pf.document_token_ids(default_lm, doc, frame))
    assert got.plan == layers.plan(default_lm.model.config)
    assert got.max_positions == default_lm.max_positions
    assert got.params == sum(p.numel() for p in default_lm.model.parameters())
    _same(got, _through_transformers(monkeypatch, None, framing="chat", system="You answer from the document."), doc)


# ---- the estimate: records in, estimate out


def _rec(tokens: int, seconds: float) -> dict:
    return {"tokens": tokens, "seconds": seconds}


def test_estimate_without_records_is_the_rough_curve_and_says_so():
    e = throughput.estimate(2000, [], params=int(throughput.REF_PARAMS * 2))
    assert e.seconds == pytest.approx(2 * throughput.curve(2000)) and e.basis == throughput.ROUGH_BASIS
    assert e.error is None and e.records == 0
    assert throughput.estimate(2000, [], params=None).seconds is None


def test_estimate_scales_the_records_along_the_curve():
    k = 5.5  # this machine: 5.5 times the reference curve
    one = throughput.estimate(4000, [_rec(1000, k * throughput.curve(1000))])
    assert one.seconds == pytest.approx(k * throughput.curve(4000)) and one.basis == "1 prefill on this machine"
    assert one.error is None  # one record cannot say how far off it is
    spread = [_rec(2000, f * k * throughput.curve(2000)) for f in (0.9, 1.0, 1.2)]
    e = throughput.estimate(2000, spread)
    assert e.seconds == pytest.approx(k * throughput.curve(2000)) and e.records == 3
    # each record against the estimate of the other two (the median of 0.9 and 1.0 for the 1.2 one): 0.9/1.1 to 1.2/0.95
    assert e.error == pytest.approx(1.2 / 0.95 - 1) and e.basis == "3 prefills on this machine"
    assert (e.low, e.high) == (pytest.approx(e.seconds * 0.9 / 1.1), pytest.approx(e.seconds * 1.2 / 0.95))


def test_estimate_uses_the_records_nearest_in_length():
    near = [_rec(8000, 2 * throughput.curve(8000))] * throughput.NEAREST
    far = [_rec(300, 9 * throughput.curve(300))] * (throughput.NEAREST + 1)
    # 20,000 tokens lie outside the lengths measured (300 to 8,000): no fit, the nearest records set the scale
    assert throughput.estimate(20_000, far + near).seconds == pytest.approx(2 * throughput.curve(20_000))


def test_records_are_kept_per_model_dtype_and_device(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCLI_HOME", str(tmp_path))
    src = {"kind": "folder", "path": "/models/a"}
    throughput.record(src, "float32", "cpu", 10, 1.0)  # too short to say anything about speed: not kept
    assert throughput.records(src, "float32", "cpu") == []
    for i in range(throughput.KEEP + 3):
        throughput.record(src, "float32", "cpu", 1000 + i, 2.0, threads=2)
    kept = throughput.records(src, "float32", "cpu")
    assert len(kept) == throughput.KEEP and kept[-1]["tokens"] == 1000 + throughput.KEEP + 2 and kept[-1]["threads"] == 2
    assert throughput.records(src, "bfloat16", "cpu") == [] and throughput.records(src, "float32", "cuda") == []
    assert throughput.records({"kind": "folder", "path": "/models/b"}, "float32", "cpu") == []
    assert throughput.records({"kind": "object", "name": "in-memory"}, "float32", "cpu") == []


def test_a_prefill_records_its_speed_and_count_uses_it(tmp_path, tiny_model_dir, monkeypatch):
    import kvcli

    monkeypatch.setenv("KVCLI_HOME", str(tmp_path / "home"))
    doc = tmp_path / "d.txt"
    doc.write_text(sample_text()[:2500], encoding="utf-8")
    before = json_lines(run("count", doc, "--model", tiny_model_dir, "--json").stdout)[0]
    assert before["prefill_s_basis"] == throughput.ROUGH_BASIS and before["prefill_s_estimate"] is None
    assert before["prefill_s_reason"] == "no prefill of this model recorded on this machine yet"
    built = run("prefill", doc, "--model", tiny_model_dir, "-o", tmp_path / "d.kv", "--no-server")
    assert built.exit_code == 0, built.stderr
    source = {"kind": "folder", "path": str(tiny_model_dir.resolve())}
    (rec,) = throughput.records(source, "float32", "cpu")
    assert rec["tokens"] == kvcli.read_manifest(tmp_path / "d.kv").num_tokens == before["tokens"]
    (c,) = json_lines(run("count", doc, "--model", tiny_model_dir, "--json").stdout)
    assert c["prefill_s_basis"] == "1 prefill on this machine" and c["prefill_s_error"] is None
    assert c["prefill_s_estimate"] is None and "3 are needed" in c["prefill_s_reason"]  # its error is not known yet
    for _ in range(2):  # two more prefills as long and as fast: the records agree, so the estimate is stated
        throughput.record(source, "float32", "cpu", rec["tokens"], rec["seconds"])
    (c,) = json_lines(run("count", doc, "--model", tiny_model_dir, "--json").stdout)
    assert c["prefill_s_estimate"] == pytest.approx(rec["seconds"])  # same length: the measured time itself
    assert c["prefill_s_error"] == pytest.approx(0, abs=1e-3) and c["prefill_s_reason"] is None
    assert c["prefill_s_range"] == [pytest.approx(rec["seconds"])] * 2  # records that agree: no spread
    human = run("count", doc, "--model", tiny_model_dir)
    assert "3 prefills on this machine" in human.stderr and counting.LIGHT in human.stderr and "~" in human.stdout


def test_an_estimate_states_the_range_its_records_miss_by(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("KVCLI_HOME", str(tmp_path))
    doc = tmp_path / "d.txt"
    doc.write_text(sample_text()[:2500], encoding="utf-8")
    (c,) = json_lines(run("count", doc, "--model", tiny_model_dir, "--json").stdout)
    source = {"kind": "folder", "path": str(tiny_model_dir.resolve())}
    for seconds in (9.0, 10.0, 12.0):  # records of this length that disagree (a busy machine now and then)
        throughput.record(source, "float32", "cpu", c["tokens"], seconds)
    (c,) = json_lines(run("count", doc, "--model", tiny_model_dir, "--json").stdout)
    assert c["prefill_s_estimate"] == pytest.approx(10.0) and c["prefill_s_reason"] is None
    # each record against the estimate from the other two: 9 against 11, 12 against 9.5
    assert c["prefill_s_range"] == [pytest.approx(10.0 * 9 / 11), pytest.approx(10.0 * 12 / 9.5)]
    assert c["prefill_s_error"] == pytest.approx(12 / 9.5 - 1)
    human = run("count", doc, "--model", tiny_model_dir)
    assert human.exit_code == 0 and "~10 s (8-13 s)" in human.stdout and "±" not in human.stdout
    assert "prefill time from 3 prefills on this machine" in human.stderr
    for seconds in (9.0, 10.0, 12.0, 40.0) * 5:  # 23 records, one in four far off: still stated, with a range that says so
        throughput.record(source, "float32", "cpu", c["tokens"], seconds)
    (c,) = json_lines(run("count", doc, "--model", tiny_model_dir, "--json").stdout)
    low, high = c["prefill_s_range"]
    assert c["prefill_s_reason"] is None and low < c["prefill_s_estimate"] < high and high > 3 * c["prefill_s_estimate"]
    human = run("count", doc, "--model", tiny_model_dir)
    assert "no estimate yet" not in human.stdout + human.stderr and "23 prefills on this machine" in human.stderr


def test_no_estimate_for_a_document_too_long_to_prefill(tmp_path, gpt2_dir, monkeypatch):
    monkeypatch.setenv("KVCLI_HOME", str(tmp_path))
    source = {"kind": "folder", "path": str(gpt2_dir.resolve())}
    for seconds in (1.0, 1.1, 1.2):
        throughput.record(source, "float32", "cpu", 1000, seconds)
    doc = tmp_path / "long.txt"
    doc.write_text(sample_text(8000), encoding="utf-8")  # more than its 1,024 learned positions, which cannot move
    result = run("count", doc, "--model", gpt2_dir, "--json")
    (c,) = json_lines(result.stdout)
    assert result.exit_code == 1 and not c["fits"] and c["prefill_s_estimate"] is None and c["prefill_s_range"] is None
    assert c["prefill_s_reason"] == "too long for the model: prefill would refuse it" and c["sectioned"] is None
    human = run("count", doc, "--model", gpt2_dir)
    assert human.exit_code == 1 and "(too long)" in human.stdout and "~" not in human.stdout
    assert "too long for the model (prefill would refuse it)" in human.stderr and "hint: " in human.stderr


def test_a_document_longer_than_the_window_is_counted_as_its_sections(tmp_path, short_model_dir, monkeypatch):
    import kvcli

    monkeypatch.setenv("KVCLI_HOME", str(tmp_path))
    doc = tmp_path / "long.txt"
    doc.write_text(sample_text(), encoding="utf-8")  # 2,247 tokens: more than its 1,024 positions, which move
    result = run("count", doc, "--model", short_model_dir, "--json")
    assert result.exit_code == 0, result.stderr
    (c,) = json_lines(result.stdout)
    assert not c["fits"] and c["window"] == 1024 and c["sectioned"] > 1
    assert "prefill would refuse" not in (c["prefill_s_reason"] or "")
    human = run("count", doc, "--model", short_model_dir)
    assert human.exit_code == 0 and f"{c['sectioned']} sections" in human.stdout and "too long" not in human.stdout
    assert f"prefill makes a sectioned cache of {c['sectioned']} sections" in human.stderr and "error" not in human.stderr
    made = run("prefill", doc, "--model", short_model_dir, "-o", tmp_path / "long.kv", "--no-server")
    assert made.exit_code == 0, made.stderr
    assert len(kvcli.read_manifest(tmp_path / "long.kv").sections.parts) == c["sectioned"]  # as many as prefill cut
    narrow = json_lines(run("count", doc, "--model", short_model_dir, "--window", "700", "--json").stdout)[0]
    assert narrow["window"] == 700 and narrow["room"] == 700 - c["tokens"] and narrow["sectioned"] == c["sectioned"]
    short = tmp_path / "short.txt"
    short.write_text(sample_text()[:1500], encoding="utf-8")
    (one,) = json_lines(run("count", short, "--model", short_model_dir, "--json").stdout)
    assert one["fits"] and one["sectioned"] is None


# ---- a refused request loads nothing


@pytest.fixture
def no_weights(monkeypatch):
    """Loading any model's weights fails the test."""
    from transformers import AutoModelForCausalLM

    def refuse(*a, **k):
        raise AssertionError("model weights were loaded for a request that is refused")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)


@pytest.fixture(scope="module")
def gpt2_dir(plain_tokenizer, tmp_path_factory):
    """A tiny GPT-2 folder (1,024 learned positions): its keys cannot move, so a longer document cannot be cut into
    sections (engine/sections) and is refused."""
    from tests.architectures import build

    folder = tmp_path_factory.mktemp("gpt2")
    build("gpt2", plain_tokenizer).save_pretrained(folder)
    plain_tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("where", ["--no-server", "--server"])
def test_a_document_too_long_is_refused_before_loading(tmp_path, gpt2_dir, no_weights, where, request):
    long = tmp_path / "long.txt"
    long.write_text(sample_text(8000), encoding="utf-8")
    if where == "--server":
        server = request.getfixturevalue("server")
    result = run("prefill", long, "--model", gpt2_dir, "-o", tmp_path / "long.kv", where)
    assert_clean_error(result, 1, "long.txt", "exceed the model's limit of 1024 positions")
    assert not (tmp_path / "long.kv").exists()
    if where == "--server":
        assert server.server.warm.status()["models"] == []


def test_of_several_documents_only_the_too_long_one_is_refused(tmp_path, gpt2_dir):
    long, short = tmp_path / "long.txt", tmp_path / "short.txt"
    long.write_text(sample_text(8000), encoding="utf-8")
    short.write_text(sample_text()[:1500], encoding="utf-8")
    result = run("prefill", long, short, "--model", gpt2_dir, "-o", tmp_path / "out", "--no-server")
    assert result.exit_code == 1 and "exceed the model's limit" in result.stderr
    assert (tmp_path / "out" / "short.kv").is_dir() and not (tmp_path / "out" / "long.kv").exists()


@pytest.fixture(scope="module")
def cache(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("count-cache")
    (folder / "d.txt").write_text(sample_text()[:1500], encoding="utf-8")
    built = run("prefill", folder / "d.txt", "--model", tiny_model_dir, "--no-server")
    assert built.exit_code == 0, built.stderr
    return folder / "d.kv"


@pytest.mark.parametrize("where", ["--no-server", "--server"])
@pytest.mark.parametrize("command", ["prefill", "ask"])
def test_an_unknown_model_is_refused_before_loading(tmp_path, cache, no_weights, where, command, request):
    if where == "--server":
        server = request.getfixturevalue("server")
    args = [cache.with_suffix(".txt"), "-o", tmp_path / "d.kv"] if command == "prefill" else ["-c", cache, "Q?"]
    result = run(command, *args, "--model", tmp_path / "no-such-model", where)
    assert_clean_error(result, 1, "no-such-model", "no such model folder")
    assert not (tmp_path / "d.kv").exists()
    if where == "--server":
        assert server.server.warm.status()["models"] == []


@pytest.mark.parametrize("command", ["ask", "chat"])
def test_a_dtype_mismatch_is_refused_before_loading(cache, no_weights, command):
    args = ["Q?"] if command == "ask" else []
    result = run(command, "-c", cache, "--dtype", "bfloat16", "--no-server", *args, input="Q?\n")
    assert_clean_error(result, 3, "dtype", "--convert-dtype")


def test_records_of_several_lengths_fit_this_machines_curve():
    a, b = 4e-3, 6e-8  # a machine whose attention weighs less than the reference curve's
    recs = [_rec(n, a * n + b * n * n) for n in (1000, 1500, 2500, 4500, 6000)]  # each one within 1.5x of the others
    e = throughput.estimate(4000, recs)
    assert e.seconds == pytest.approx(a * 4000 + b * 4000 ** 2) and e.error == pytest.approx(0, abs=1e-9)
    far = throughput.estimate(40_000, recs)  # far outside the lengths measured: the nearest records scale the curve
    assert far.seconds == pytest.approx(throughput.curve(40_000) * statistics.median(
        r["seconds"] / throughput.curve(r["tokens"]) for r in recs))


@pytest.fixture
def unreachable_hub(monkeypatch, tmp_path):
    """HF_HUB_OFFLINE unset, a hub endpoint nobody listens on, and an empty local hub cache (returned)."""
    import socket

    from huggingface_hub import constants

    with socket.socket() as s:  # a port just freed: connecting to it is refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


@pytest.mark.parametrize("command", ["prefill", "ask"])
def test_a_hub_id_not_cached_fails_at_once_when_the_hub_cannot_be_reached(tmp_path, cache, no_weights, unreachable_hub, command):
    args = [cache.with_suffix(".txt"), "-o", tmp_path / "d.kv"] if command == "prefill" else ["-c", cache, "Q?"]
    result = run(command, *args, "--model", "kvcli-test/no-such-model", "--no-server")
    line = assert_clean_error(result, 1, "'kvcli-test/no-such-model' is not in the local hub cache", "cannot be reached")
    assert result.stderr.splitlines() == [line, "hint: pass --model with a local model folder or a .gguf file"]


def test_a_hub_id_in_the_local_cache_loads_when_the_hub_cannot_be_reached(tmp_path, tiny_model_dir, unreachable_hub):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = unreachable_hub / "models--kvcli-test--tiny"
    shutil.copytree(tiny_model_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    doc = tmp_path / "d.txt"
    doc.write_text(sample_text()[:800], encoding="utf-8")
    built = run("prefill", doc, "--model", "kvcli-test/tiny", "--no-server")
    assert built.exit_code == 0, built.stderr
    assert "Retrying" not in built.stderr and "error" not in built.stderr, built.stderr
    import kvcli

    assert kvcli.read_manifest(tmp_path / "d.kv").model["source"]["id"] == "kvcli-test/tiny"


def test_the_samples_readme_states_the_sample_documents_token_count():
    from tests.conftest import SAMPLES

    result = run("count", str(SAMPLES / "document.txt"), "--json")
    assert result.exit_code == 0, result.stderr
    tokens = json_lines(result.stdout)[0]["tokens"]
    assert f"{tokens:,} tokens with the default model" in (SAMPLES / "README.md").read_text()


# ---- count against prefill


def test_count_matches_prefill_without_the_weights(cache, tiny_model_dir, tmp_path):
    import kvcli

    no_weights = tmp_path / "config-only"
    shutil.copytree(tiny_model_dir, no_weights, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    result = run("count", cache.with_suffix(".txt"), "--model", no_weights, "--json")
    assert result.exit_code == 0, result.stderr
    (c,) = json_lines(result.stdout)
    m = kvcli.read_manifest(cache)
    assert c["tokens"] == m.num_tokens and c["bytes_raw"] == m.bytes_raw and c["dtype"] == "float32"
    assert c["bytes_on_disk_estimate"] == round(0.83 * m.bytes_raw)
    assert c["max_positions"] == 8192 and c["room"] == 8192 - m.num_tokens and c["fits"] is True
    assert (c["prefill_s_estimate"] is None) == (c["prefill_s_reason"] is not None)  # stated, or why not
    human = run("count", cache.with_suffix(".txt"), "--model", no_weights)
    assert human.exit_code == 0 and f"{m.num_tokens:,}" in human.stdout and "estimate" in human.stderr


def test_count_flags_a_document_too_long(tmp_path, gpt2_dir):
    long = tmp_path / "long.txt"
    long.write_text(sample_text(8000), encoding="utf-8")
    result = run("count", long, "--model", gpt2_dir, "--json")
    assert result.exit_code == 1 and "long.txt" in error_lines(result)[0]
    (c,) = json_lines(result.stdout)
    assert c["tokens"] > 1024 and c["fits"] is False and c["room"] < 0 and c["sectioned"] is None


def test_count_imports_no_model_code(cache, tiny_model_dir):
    code = ("import sys, time, resource\nfrom kvcli.cli import app\nt0 = time.perf_counter()\n"
            f"try:\n    app(['count', {str(cache.with_suffix('.txt'))!r}, '--model', {str(tiny_model_dir)!r}, '--json'], prog_name='kvcli')\n"
            "except SystemExit as e:\n    assert e.code in (0, None), e.code\n"
            "import json\nprint(json.dumps({'torch': 'torch' in sys.modules,"
            " 'modeling': sorted(m for m in sys.modules if m.startswith('transformers.models.') and '.modeling_' in m),"
            " 's': time.perf_counter() - t0, 'rss_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))\n")
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    # no model code: 0.2 built the model on the meta device (transformers.models.llama.modeling_llama and
    # its imports); and no torch: config.json and the tokenizer are read without it (engine/model/light.py)
    assert got["modeling"] == [] and got["torch"] is False, got
    (c,) = json_lines(proc.stdout.strip().splitlines()[0])
    assert (c["prefill_s_estimate"] is None) == (c["prefill_s_reason"] is not None)  # stated, or why not


def test_count_parameters_match_the_model(tiny_model_dir):
    counter = counting.Counter(str(tiny_model_dir))
    model = tiny_llama(counter.tokenizer.__len__())
    assert counter.params == sum(p.numel() for p in model.parameters())


# ---- a model that is not where it was


def test_moved_model_folder_is_named(cache, tiny_model_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    moved_cache = tmp_path / "c.kv"
    assert run("prefill", cache.with_suffix(".txt"), "-o", moved_cache, "--model", model).exit_code == 0
    model.rename(tmp_path / "moved")
    result = run("ask", "-c", moved_cache, "Q?")
    line = assert_clean_error(result, 1, str(model), "no longer exists")
    assert "Repo id" not in result.stderr and "--model" in result.stderr
    assert run("ask", "-c", moved_cache, "Q?", "--model", tmp_path / "moved", "--max-new-tokens", "2").exit_code == 0, line


@pytest.mark.parametrize("spec", ["./nope", "ABSOLUTE", "sub/nope", "not a model"])
def test_missing_model_path_is_not_a_hub_id(cache, tmp_path, spec, monkeypatch):
    (tmp_path / "sub").mkdir()  # "sub/nope": relative, under a folder that exists here
    monkeypatch.chdir(tmp_path)
    spec = str(tmp_path / "nope") if spec == "ABSOLUTE" else spec
    line = assert_clean_error(run("prefill", cache.with_suffix(".txt"), "-o", tmp_path / "x.kv", "--model", spec), 1, spec, "no such model folder")
    assert "hub" not in line and not (tmp_path / "x.kv").exists()


def test_count_says_which_dtype_prefills_faster_where_the_cpu_has_native_bfloat16(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("KVCLI_HOME", str(tmp_path / "home"))
    doc = tmp_path / "d.txt"
    doc.write_text(sample_text()[:2500], encoding="utf-8")
    source = {"kind": "folder", "path": str(tiny_model_dir.resolve())}
    monkeypatch.setattr(throughput, "native_bfloat16", lambda: None)
    assert "bfloat16" not in run("count", doc, "--model", tiny_model_dir).stderr  # no native bfloat16: nothing to advise
    monkeypatch.setattr(throughput, "native_bfloat16", lambda: "avx512_bf16")
    hint = run("count", doc, "--model", tiny_model_dir)
    assert hint.exit_code == 0 and "natively (avx512_bf16)" in hint.stderr and "--dtype float32 --dtype bfloat16" in hint.stderr
    for _ in range(3):
        throughput.record(source, "float32", "cpu", 2000, 4.0)
        throughput.record(source, "bfloat16", "cpu", 2000, 2.0)
    for dtype, words in (("float32", "bfloat16 prefills 2.00x as fast as float32"), ("bfloat16", "bfloat16 prefills 2.00x as fast as float32")):
        told = run("count", doc, "--model", tiny_model_dir, "--dtype", dtype)
        assert told.exit_code == 0 and words in told.stderr and "6 recorded prefills" in told.stderr, told.stderr
        assert json_lines(run("count", doc, "--model", tiny_model_dir, "--dtype", dtype, "--json").stdout)[0]["dtype"] == dtype  # never switched
