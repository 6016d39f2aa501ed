"""--check (cached answer vs one forward without cache), exit code 4, provenance in the manifest, and
caches whose token ids no tokenizer output can hold (refused, exit 3)."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

import kvcli
from kvcli.documents import decode
from kvcli.errors import CHECK_DIFFERS_EXIT, CacheMismatchError
from kvcli.format import manifest as mf
from tests.conftest import reference_answer, sample_text
from tests.helpers import assert_clean_error, json_lines, run, piped

QUESTIONS = ("What does the word Licensor mean?", "Is the Work provided with any warranty?")
OPTS = kvcli.GenerationOptions(max_new_tokens=10)


@pytest.fixture(scope="module")
def api_cache(tiny_lm, tmp_path_factory):
    path = tmp_path_factory.mktemp("check") / "doc.kv"
    kvcli.prefill(tiny_lm, decode(sample_text()[:1500].encode(), "licence.txt"), path, chunk_size=100)
    return path


@pytest.fixture(scope="module")
def cli_cache(tiny_model_dir, tmp_path_factory):
    doc = tmp_path_factory.mktemp("check-cli") / "licence.txt"
    doc.write_text(sample_text()[:1500], encoding="utf-8")
    result = run("prefill", doc, "--model", tiny_model_dir, "--chunk-size", "100")
    assert result.exit_code == 0, result.stderr
    return doc.with_suffix(".kv")


def _body(cache) -> dict:
    return json.loads((cache / "manifest.json").read_bytes())


def _reseal(cache, body: dict) -> None:
    """Write an edited manifest with a recomputed checksum: what a forger would do."""
    body["manifest_sha256"] = mf.checksum(body)
    (cache / "manifest.json").write_text(json.dumps(body, indent=1, sort_keys=True))


def _perturbed(states, scale: float = 3.0):
    """The same layer states with noise on every layer's keys and values (a lossy or damaged cache)."""
    import torch

    g = torch.Generator().manual_seed(1)
    return [dataclasses.replace(s, keys=s.keys + scale * torch.randn(s.keys.shape, generator=g),
                                values=s.values + scale * torch.randn(s.values.shape, generator=g)) for s in states]


# ---------------------------------------------------------------------------------------------------- the API


def test_check_on_an_exact_cache(tiny_lm, api_cache):
    session = kvcli.Session(tiny_lm, api_cache)
    for q in QUESTIONS:
        a = session.ask(q, OPTS, check=True)
        c = a.check
        assert isinstance(c, kvcli.Check)
        assert c.identical and c.first_divergence is None and c.divergences == []
        assert c.tokens == len(a.answer_token_ids) == 10
        assert 0 <= c.max_logit_diff < 1e-3  # float32 on CPU: rounding only
        assert (c.dtype, c.device) == ("float32", "cpu")
        assert a.answer_token_ids == reference_answer(tiny_lm.model, a.prompt_token_ids, 10)  # what "identical" claims
        body = a.to_json()
        assert body["check"] == {"identical": True, "tokens": 10, "first_divergence": None, "max_logit_diff": c.max_logit_diff,
                                 "divergences": [], "dtype": "float32", "device": "cpu", "agreement": 1.0,
                                 "kl_mean": c.kl_mean, "storage": "lossless", "weights": "float"}
        assert 0 <= c.kl_mean < 1e-6
        json.dumps(body)
    assert "check" not in session.ask(QUESTIONS[0], OPTS).to_json()  # only when asked for


def test_check_finds_where_a_perturbed_cache_diverges(tiny_lm, api_cache):
    import torch

    session = kvcli.Session(tiny_lm, api_cache)
    from kvcli.engine.cache.kvcache import KVCache

    session.cache = KVCache.from_states(_perturbed(session.states))
    a = session.ask(QUESTIONS[0], OPTS, check=True)
    c = a.check
    assert not c.identical and c.divergences and c.first_divergence == c.divergences[0].position
    assert c.max_logit_diff > 0.1
    # teacher-forced reference: the uncached forward over the same ids, position by position
    ids = torch.tensor([a.prompt_token_ids + a.answer_token_ids[:-1]])
    with torch.inference_mode():
        ref = tiny_lm.model(input_ids=ids).logits[0, len(a.prompt_token_ids) - 1 :]
    for d in c.divergences:
        assert d.cached_token == a.answer_token_ids[d.position] != d.recompute_token  # greedy: the answer is the cached top
        assert d.recompute_token == int(ref[d.position].argmax())
        top2 = ref[d.position].topk(2).values
        assert d.margin == pytest.approx(float(top2[0] - top2[1]), abs=1e-4) and d.margin >= 0 and d.cached_margin >= 0
        assert 0 < d.logit_diff <= c.max_logit_diff
    assert "DIFFERS" in c.describe() and f"token {c.first_divergence} of 10" in c.describe()


def test_check_compares_raw_logits_when_sampling(tiny_lm, api_cache):
    """Sampling picks tokens the logits' top need not agree with; the check still compares the raw logits."""
    session = kvcli.Session(tiny_lm, api_cache)
    a = session.ask(QUESTIONS[1], kvcli.GenerationOptions(max_new_tokens=8, temperature=1.5, seed=3), check=True)
    assert a.check.tokens == len(a.answer_token_ids) and a.check.identical and a.check.max_logit_diff < 1e-3


# ---------------------------------------------------------------------------------------------------- the CLI


def test_cli_check_plain_prints_one_stderr_line_per_answer(cli_cache):
    result = run("ask", "-c", cli_cache, "--check", "--max-new-tokens", "8", *QUESTIONS)
    assert result.exit_code == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("kvcli: check:")]
    assert len(lines) == 2 and all("identical to a full recompute over 8 tokens" in line for line in lines), result.stderr
    assert result.stdout.count("==> ") == 2 and "check" not in result.stdout  # two answers, each after its separator line
    as_json = run("ask", "-c", cli_cache, "--check", "--json", "--max-new-tokens", "8", *QUESTIONS)
    assert as_json.exit_code == 0 and "kvcli: check:" not in as_json.stderr
    answers = json_lines(as_json.stdout)
    assert [a["check"]["identical"] for a in answers] == [True, True] and answers[0]["check"]["tokens"] == 8
    assert result.stdout == piped(answers)


def test_cli_help_says_check_costs_a_recompute():
    import re

    text = " ".join(re.sub(r"[│╭╮╰╯─]", " ", run("ask", "--help").stdout).split())  # unwrap rich's box
    assert "--check" in text and "costs a full recompute of the document per question" in text and "exit 4" in text


def test_cli_check_exits_4_when_an_answer_differs_and_still_prints_it(cli_cache, tiny_model_dir, tmp_path):
    """A cache whose keys/values were replaced (shards rewritten, manifest resealed) answers differently from
    recompute; --check says so on stderr, prints the answers, and exits 4. Without --check: exit 0."""
    from kvcli.engine import prefilling
    from kvcli.engine.cache import restore
    from kvcli.format import store

    forged = tmp_path / "forged.kv"
    shutil.copytree(cli_cache, forged)
    with store.open_cache(forged) as opened:
        states = restore.load_states(opened, room=0)
    states = [dataclasses.replace(s, keys=s.keys.contiguous(), values=s.values.contiguous()) for s in _perturbed(states)]
    out = tmp_path / "shards"
    out.mkdir()
    entries = prefilling.write_layers(out, states, len(states[0].keys[0, 0]), transform="byteplane", level=1)
    body = _body(forged)
    for entry in entries:
        shutil.copy(out / entry.file, forged / entry.file)
    body["layers"] = [e.to_json(kvcli.read_manifest(forged).shard_hash) for e in entries]
    _reseal(forged, body)
    assert kvcli.verify(forged).num_tokens == kvcli.read_manifest(cli_cache).num_tokens

    result = run("ask", "-c", forged, "--check", "--max-new-tokens", "8", *QUESTIONS)
    assert result.exit_code == CHECK_DIFFERS_EXIT == 4, result.stderr
    assert result.stdout.count("==> ") == 2  # the answers are still printed
    lines = [line for line in result.stderr.splitlines() if line.startswith("kvcli: check:")]
    assert len(lines) == 2 and any("DIFFERS from a full recompute at answer token" in line for line in lines)
    assert "Traceback" not in result.stderr
    answers = json_lines(run("ask", "-c", forged, "--check", "--json", "--max-new-tokens", "8", *QUESTIONS).stdout)
    assert any(not a["check"]["identical"] and a["check"]["divergences"] for a in answers)
    assert run("ask", "-c", forged, "--max-new-tokens", "8", QUESTIONS[0]).exit_code == 0


def test_cli_check_on_a_quantized_cache_reports_agreement_and_exits_4_only_if_an_answer_differs(cli_cache, tiny_model_dir):
    """An 8-bit cache is lossy: --check says so, reports the share of answer tokens whose top token is the
    recompute's and the mean KL, and exits 4 exactly when some answer differs (0 when all are identical)."""
    q8 = cli_cache.with_name("licence-q8.kv")
    made = run("prefill", cli_cache.with_suffix(".txt"), "-o", q8, "--model", tiny_model_dir, "--kv-bits", "8", "--chunk-size", "100")
    assert made.exit_code == 0, made.stderr
    result = run("ask", "-c", q8, "--check", "--max-new-tokens", "8", *QUESTIONS)
    lines = [line for line in result.stderr.splitlines() if line.startswith("kvcli: check:")]
    assert len(lines) == 2 and result.stdout.count("==> ") == 2, result.stderr
    assert all("8-bit cache (lossy, differences expected)" in line and "answer tokens" in line and "mean KL" in line
               for line in lines), lines
    answers = json_lines(run("ask", "-c", q8, "--check", "--json", "--max-new-tokens", "8", *QUESTIONS).stdout)
    checks = [a["check"] for a in answers]
    assert [c["storage"] for c in checks] == ["8-bit", "8-bit"]
    for c in checks:
        assert c["tokens"] == 8 and c["agreement"] == (8 - len(c["divergences"])) / 8 and c["kl_mean"] >= 0
        assert c["identical"] == (c["agreement"] == 1.0)
    assert result.exit_code == (CHECK_DIFFERS_EXIT if not all(c["identical"] for c in checks) else 0), result.stderr
    lossless = json_lines(run("ask", "-c", cli_cache, "--check", "--json", "--max-new-tokens", "8", QUESTIONS[0]).stdout)[0]
    assert lossless["check"]["storage"] == "lossless" and lossless["check"]["agreement"] == 1.0
    assert lossless["check"]["kl_mean"] < 1e-6


# ---------------------------------------------------------------------------------------------------- token ids


def test_forged_token_id_outside_the_vocabulary_is_refused(cli_cache, tiny_lm, tmp_path):
    forged = tmp_path / "vocab.kv"
    shutil.copytree(cli_cache, forged)
    body = _body(forged)
    vocab = len(tiny_lm.tokenizer)
    body["token_ids"][7] = vocab + 5
    _reseal(forged, body)
    assert kvcli.verify(forged)  # intact as far as checksums go: only the model can tell
    result = run("ask", "-c", forged, "--max-new-tokens", "4", "--check", QUESTIONS[0])
    assert_clean_error(result, 3, str(forged), f"token id {vocab + 5} at position 7", f"vocabulary of {vocab} ids")


def test_token_id_in_padded_embedding_rows_is_refused(tiny_lm, api_cache, tmp_path):
    """An embedding larger than the tokenizer (padded rows): ids there are refused too; ids below are fine."""
    from tests.conftest import tiny_llama

    vocab = len(tiny_lm.tokenizer)
    padded = kvcli.from_objects(tiny_llama(vocab + 64), tiny_lm.tokenizer, name="padded")
    forged = tmp_path / "padded.kv"
    shutil.copytree(api_cache, forged)
    body = _body(forged)
    body["model"] = {**body["model"], **{k: padded.fingerprint[k] for k in ("config_sha256", "weights_sha256")}}
    _reseal(forged, body)
    kvcli.Session(padded, forged)  # the document's own ids fit
    body["token_ids"][-1] = vocab + 3  # a row of the embedding no tokenizer output selects
    _reseal(forged, body)
    with pytest.raises(CacheMismatchError, match=f"token id {vocab + 3} at position {len(body['token_ids']) - 1}"):
        kvcli.Session(padded, forged)


# ---------------------------------------------------------------------------------------------------- provenance


def test_provenance_is_recorded_and_shown(cli_cache):
    import torch

    m = kvcli.read_manifest(cli_cache)
    assert m.provenance == {"torch_version": torch.__version__, "device_type": "cpu", "attn_implementation": "sdpa"}
    info = run("info", cli_cache)
    assert info.exit_code == 0 and f"torch {torch.__version__}, cpu, attention sdpa" in info.stdout
    assert json.loads(run("info", cli_cache, "--json").stdout)["provenance"] == m.provenance
    ask = run("ask", "-c", cli_cache, "--max-new-tokens", "2", QUESTIONS[0])
    assert ask.exit_code == 0 and "warning" not in ask.stderr


def test_other_provenance_is_warned_naming_the_difference(cli_cache, tmp_path):
    other = tmp_path / "cuda.kv"
    shutil.copytree(cli_cache, other)
    body = _body(other)
    body["provenance"] = {**body["provenance"], "device_type": "cuda", "torch_version": "2.99.0+cu130"}
    _reseal(other, body)
    result = run("ask", "-c", other, "--max-new-tokens", "2", QUESTIONS[0])
    assert result.exit_code == 0, result.stderr
    (line,) = [line for line in result.stderr.splitlines() if "kvcli: warning:" in line]
    assert "torch 2.99.0+cu130 (running" in line and "device cuda (running cpu)" in line and "--check" in line
    assert "attention" not in line  # only what differs is named


def test_manifest_without_provenance_still_loads(cli_cache, tmp_path):
    old = tmp_path / "old.kv"
    shutil.copytree(cli_cache, old)
    body = _body(old)
    del body["provenance"]
    _reseal(old, body)
    m = kvcli.read_manifest(old)
    assert m.provenance is None and json.loads(m.dumps())["manifest_sha256"] == body["manifest_sha256"]
    result = run("ask", "-c", old, "--max-new-tokens", "2", QUESTIONS[0])
    assert result.exit_code == 0 and "warning" not in result.stderr
    assert "not recorded" in run("info", old).stdout


@pytest.mark.parametrize("bad", [["cpu"], {"device_type": 3}, {"kernel": "x"}, {"device_type": "cpu\x1b[2J"}])
def test_malformed_provenance_is_refused(cli_cache, tmp_path, bad):
    forged = tmp_path / "bad.kv"
    shutil.copytree(cli_cache, forged)
    body = _body(forged)
    body["provenance"] = bad
    _reseal(forged, body)
    assert_clean_error(run("info", forged), 3, "provenance")
