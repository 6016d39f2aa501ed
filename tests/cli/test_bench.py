"""kvcli bench on a tiny model: the result has every measurement and ratio, and renders."""

from __future__ import annotations

import json
import math

import pytest

from kvcli import bench
from kvcli.bench import dtypes  # noqa: F401  (bench.dtypes.COMPARED)
from kvcli.documents import decode
from kvcli.engine.prefilling import ANSWER_ROOM
from kvcli.errors import UsageError
from tests.conftest import SAMPLES, sample_text, tiny_llama
from tests.helpers import assert_clean_error, run


def test_bench_run_smoke(tiny_lm, tmp_path):
    doc = decode(sample_text()[:800].encode(), "doc.txt")
    seen: list[str] = []
    result = bench.run(tiny_lm, doc, tokens=[96, 48], questions=2, progress=seen.append, chunk_size=32, workdir=tmp_path,
                       answer_tokens=6, decode_tokens=4)
    json.dumps(result)  # JSON-able as it is
    assert [r["tokens"] for r in result["sizes"]] == [48, 96]  # sorted; framed ids cut to the length asked
    assert result["weights"] == "float"
    assert result["questions"] and len(result["questions"]) == 2 and seen
    for r in result["sizes"]:
        for key in ("plain_prefill_s", "plain_chunked_prefill_s", "kvcli_prefill_s", "restore_s", "naive_restore_s",
                    "ttft_cached_s", "ttft_recompute_s"):
            assert r[key] > 0, key
        assert len(r["ttft_cached_all_s"]) == 2 and r["first_tokens_match"] is True
        check = r["check"]  # whole answers against a full recompute: float32 on CPU is exact here
        assert check["answers"] == check["identical"] == 2 and check["first_divergence"] == [None, None]
        assert 0 < check["tokens"] <= 12 and 0 <= check["max_logit_diff"] < 1e-3 and check["divergent_margins"] == []
        assert r["decode_tokens"] > 0 and r["decode_tok_s"] > 0 and r["decode_s"] > 0
        assert r["decode_ms_per_token"] == pytest.approx(1000 / r["decode_tok_s"])
        assert r["batch_questions"] == bench.BATCH_QUESTIONS and r["batch_decode_steps"] > 0
        assert r["batch_decode_steps"] <= r["batch_decode_row_tokens"] <= bench.BATCH_QUESTIONS * r["batch_decode_steps"]
        assert r["batch_ms_per_step"] >= r["batch_ms_per_row_token"] > 0 and r["batch_decoding"]
        assert r["peak_rss_bytes"] > 0 and r["peak_rss_scope"] == "length"  # Linux: the mark is reset per length
        assert 0 < r["bytes_shards"] < r["bytes_on_disk"] and r["bytes_raw"] > 0 and r["naive_bytes"] > 0
        stages = r["restore_stages"]  # the restore's own stage rates; no copy stage on the CPU
        assert all(stages[k] > 0 for k in ("read_gb_s_stored", "hash_gb_s_stored", "decompress_gb_s_raw", "restore_gb_s_raw"))
        assert stages["copy_gb_s_raw"] is None
        for value in r["ratios"].values():
            assert isinstance(value, float) and not math.isnan(value)
    assert list(tmp_path.iterdir()) == []  # caches and naive files cleaned up
    from kvcli.engine.model import attention

    assert tiny_lm.model.config._attn_implementation == attention.NAME  # baselines ran sdpa, then switched back
    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(bench.render(result))
    text = console.export_text()
    assert "speedup" in text and "naive restore" in text and "48" in text and "answers = recompute" in text and "tok/s" in text
    assert "stages, GB/s" in text and "decompress" in text
    assert "ms/token" in text and "8 batched" in text and "ms/step" in text and "per row-token" in text and "peak RSS" in text


def test_default_sizes_stop_at_the_model_limit(tiny_lm):
    class Capped:
        max_positions = 8192

    assert bench.default_sizes(Capped()) == [1024, 2048, 4096, 8192 - ANSWER_ROOM]
    Capped.max_positions = 2048
    assert bench.default_sizes(Capped()) == [1024, 2048 - ANSWER_ROOM]
    Capped.max_positions = None
    assert bench.default_sizes(Capped()) == [1024, 2048, 4096, 8192]


def test_limit_sizes_double_from_1k_up_to_the_model_limit():
    class Capped:
        max_positions = 32768

    room = ANSWER_ROOM
    assert bench.limit_sizes(Capped()) == [1024, 2048, 4096, 8192, 16384, 32768 - room]
    Capped.max_positions = 8192
    assert bench.limit_sizes(Capped()) == [1024, 2048, 4096, 8192 - room]
    Capped.max_positions = 1024 + room
    assert bench.limit_sizes(Capped()) == [1024]
    Capped.max_positions = None
    with pytest.raises(UsageError, match="no position limit"):
        bench.limit_sizes(Capped())


@pytest.fixture(scope="module")
def long_limit_dir(tokenizer, tmp_path_factory):
    """A tiny llama folder with 1,800 positions: --tokens max measures 1,024 and 1,800 less the answer room."""
    folder = tmp_path_factory.mktemp("llama-1800")
    tiny_llama(len(tokenizer), max_position_embeddings=1800).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_bench_tokens_max_measures_doubling_lengths_up_to_the_limit(long_limit_dir, tmp_path):
    result = run("bench", SAMPLES / "document.txt", "--tokens", "max", "--model", long_limit_dir, "--questions", "1",
                 "--answer-tokens", "2", "--decode-tokens", "4", "--json")
    assert result.exit_code == 0, result.stderr
    body = json.loads(result.stdout)
    assert [r["tokens_asked"] for r in body["sizes"]] == [1024, 1800 - ANSWER_ROOM]
    for r in body["sizes"]:  # the document cut to at most each length (a cut can merge the last tokens)
        assert r["tokens_asked"] - 4 <= r["tokens"] <= r["tokens_asked"]
    for r in body["sizes"]:
        for key in ("kvcli_prefill_s", "restore_s", "ttft_cached_s", "ttft_recompute_s", "decode_ms_per_token",
                    "batch_ms_per_step", "batch_ms_per_row_token", "peak_rss_bytes"):
            assert r[key] > 0, key
        assert r["ratios"]["ttft_recompute_over_cached"] > 0 and r["batch_questions"] == 8
    assert "bench: 1,024 tokens" in result.stderr and "then 8 batched" in result.stderr


@pytest.mark.parametrize("tokens, needle", [(["max", "1024"], "give it alone"), (["1k"], "got '1k'")])
def test_bench_tokens_bad_values_are_usage_errors(tmp_path, tokens, needle):
    args = [a for n in tokens for a in ("--tokens", n)]
    result = run("bench", SAMPLES / "document.txt", *args, "--model", tmp_path / "no-such-model")
    assert_clean_error(result, 2, "--tokens", needle)  # refused before any model is looked up


def test_bench_kv_bits_reports_size_restore_ttft_and_agreement_per_format(tiny_lm, tmp_path):
    doc = decode(sample_text()[:800].encode(), "doc.txt")
    qs = ["Who is the licensor?", "What is granted?", "Is there a warranty?"]
    result = bench.run(tiny_lm, doc, tokens=[96], questions=3, chunk_size=32, workdir=tmp_path, kv_bits=[8, 4],
                       question_list=qs, agreement_tokens=6, answer_tokens=4, decode_tokens=2)
    json.dumps(result)
    assert result["kv_bits"] == [8, 4] and result["questions"] == qs
    formats = result["sizes"][0]["formats"]
    assert list(formats) == ["lossless", "8-bit", "4-bit"]
    lossless = formats["lossless"]["agreement"]
    assert lossless["top1_vs_lossless"] == 1.0 and lossless["kl_mean"] < 1e-9 and lossless["questions"] == 3
    for name in ("8-bit", "4-bit"):
        f = formats[name]
        assert f["quant"]["bits"] == int(name[0]) and f["bytes_on_disk"] < formats["lossless"]["bytes_on_disk"]
        assert f["restore_s"] > 0 and f["restore_gb_per_s"] > 0 and f["ttft_cached_s"] > 0
        a = f["agreement"]
        assert 0 < a["answer_tokens"] <= 18 and 0 <= a["top1"] <= 1 and a["kl_mean"] >= 0 and 0 <= a["answers_identical"] <= 1
    assert formats["8-bit"]["disk_over_raw"] < formats["lossless"]["disk_over_raw"]
    assert list(tmp_path.iterdir()) == []
    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(bench.render(result))
    text = console.export_text()
    assert "8-bit: on disk" in text and "top-1 (teacher-forced)" in text and "same whole answers" in text


def test_bench_compares_dtypes_length_by_length():
    def result(dtype, *times):
        keys = [k for k, _ in bench.dtypes.COMPARED]
        return {"dtype": dtype, "sizes": [{"tokens": n, **dict(zip(keys, t))} for n, t in times]}

    base = result("float32", (1024, (4.0, 0.2, 80.0, 30.0)), (2048, (9.0, 0.4, 90.0, 35.0)))
    other = result("bfloat16", (1024, (2.0, 0.1, 120.0, 30.0)))  # measured at one length only
    (row,) = bench.compare([base, other])
    assert row["tokens"] == 1024 and row["dtype"] == "bfloat16" and row["against"] == "float32"
    assert row["ratios"] == {"kvcli_prefill_s": 0.5, "ttft_cached_s": 0.5, "decode_ms_per_token": 1.5, "batch_ms_per_row_token": 1.0}
    (line,) = bench.verdicts([row])
    assert line == ("bfloat16 against float32 at 1,024 tokens: prefill 0.50x, TTFT with cache 0.50x, decode, 1 question 1.50x, "
                    "decode, batched 1.00x (faster for prefill, TTFT with cache; slower for decode, 1 question, decode, batched)")


def test_bench_dtype_twice_measures_both_and_says_which_is_faster(tiny_model_dir):
    result = run("bench", SAMPLES / "document.txt", "--tokens", "96", "--model", tiny_model_dir, "--questions", "1",
                 "--answer-tokens", "2", "--decode-tokens", "2", "--dtype", "float32", "--dtype", "bfloat16", "--json")
    assert result.exit_code == 0, result.stderr
    body = json.loads(result.stdout)
    assert [r["dtype"] for r in body["runs"]] == ["float32", "bfloat16"]
    (row,) = body["dtype_comparison"]
    assert row["dtype"] == "bfloat16" and row["against"] == "float32" and all(v > 0 for v in row["ratios"].values())
    assert "bfloat16 against float32 at " in result.stderr
    assert_clean_error(run("bench", SAMPLES / "document.txt", "--dtype", "float32", "--dtype", "float32"), 2, "each dtype once")
