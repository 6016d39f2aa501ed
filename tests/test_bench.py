"""kvcli bench on a tiny model: the result has every measurement and ratio, and renders."""

from __future__ import annotations

import json
import math

from kvcli import bench
from kvcli.documents import decode
from tests.conftest import sample_text


def test_bench_run_smoke(tiny_lm, tmp_path):
    doc = decode(sample_text()[:800].encode(), "doc.txt")
    seen: list[str] = []
    result = bench.run(tiny_lm, doc, tokens=[96, 48], questions=2, progress=seen.append, chunk_size=32, workdir=tmp_path,
                       answer_tokens=6)
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
        assert 0 < r["bytes_shards"] < r["bytes_on_disk"] and r["bytes_raw"] > 0 and r["naive_bytes"] > 0
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


def test_default_sizes_stop_at_the_model_limit(tiny_lm):
    class Capped:
        max_positions = 8192

    assert bench.default_sizes(Capped()) == [1024, 2048, 4096, 8192 - bench.pf.ANSWER_ROOM]
    Capped.max_positions = 2048
    assert bench.default_sizes(Capped()) == [1024, 2048 - bench.pf.ANSWER_ROOM]
    Capped.max_positions = None
    assert bench.default_sizes(Capped()) == [1024, 2048, 4096, 8192]


def test_bench_kv_bits_reports_size_restore_ttft_and_agreement_per_format(tiny_lm, tmp_path):
    doc = decode(sample_text()[:800].encode(), "doc.txt")
    qs = ["Who is the licensor?", "What is granted?", "Is there a warranty?"]
    result = bench.run(tiny_lm, doc, tokens=[96], questions=3, chunk_size=32, workdir=tmp_path, kv_bits=[8, 4],
                       question_list=qs, agreement_tokens=6, answer_tokens=4)
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
