"""kvcli bench's result as a rich Table: one row per quantity, one column per document length."""

from __future__ import annotations

from typing import Any

from .decode import BATCH_QUESTIONS


def render(result: dict[str, Any]):
    """The measurements and ratios as a rich Table: one row per quantity, one column per document length."""
    from rich.table import Table

    sizes = result["sizes"]
    weights = "" if result.get("weights", "float") == "float" else f", {result['weights']} weights"
    title = (f"kvcli bench: {result['model']} ({result['dtype']}{weights}, {result['device']}, "
             f"{result['torch_threads']} torch threads, chunks of {result['chunk_size']})")
    table = Table(title=title, caption="Cached TTFT includes the restore. Answers: whole greedy answers of "
                  f"{result['answer_tokens']} tokens compared with one forward without cache. Naive: torch.save / torch.load "
                  "of the same tensors (x: naive over kvcli). Prefill rows: time over one plain forward. Peak RSS: "
                  "the process's high-water mark during that length (process: since it started).")
    table.add_column("tokens", no_wrap=True)
    for r in sizes:
        table.add_column(f"{r['tokens']:,}", justify="right", no_wrap=True)
    rows = [
        ("TTFT recompute", lambda r, q: f"{r['ttft_recompute_s']:.2f} s"),
        ("TTFT with cache", lambda r, q: f"{r['ttft_cached_s']:.3f} s"),
        ("  speedup", lambda r, q: f"{q['ttft_recompute_over_cached']:.1f}x"),
        ("  same 1st token", lambda r, q: "yes" if r["first_tokens_match"] else "NO"),
        ("answers = recompute", lambda r, q: f"{r['check']['identical']}/{r['check']['answers']}"),
        ("  max logit diff", lambda r, q: f"{r['check']['max_logit_diff']:.2g}"),
        ("decode, 1 question", lambda r, q: f"{r['decode_ms_per_token']:.0f} ms/token ({r['decode_tok_s']:.1f} tok/s)"),
        (f"decode, {BATCH_QUESTIONS} batched", lambda r, q: f"{r['batch_ms_per_step']:.0f} ms/step"),
        ("  per row-token", lambda r, q: f"{r['batch_ms_per_row_token']:.0f} ms"),
        ("restore", lambda r, q: f"{r['restore_s']:.3f} s"),
        ("  GB/s of raw", lambda r, q: f"{q['restore_gb_per_s']:.2f}"),
        ("  stages, GB/s", lambda r, q: _stages(r.get("restore_stages"))),
        ("raw / on disk", lambda r, q: f"{r['bytes_raw'] / 1e6:,.1f} / {r['bytes_on_disk'] / 1e6:,.1f} MB"),
        ("  on disk", lambda r, q: f"{q['disk_over_raw']:.1%} of raw"),
        ("naive size", lambda r, q: f"{q['naive_over_kvcli_bytes']:.2f}x"),
        ("naive restore", lambda r, q: f"{q['naive_over_kvcli_restore_s']:.2f}x"),
        ("one forward", lambda r, q: f"{r['plain_prefill_s']:.2f} s"),
        ("  plain chunked", lambda r, q: f"{q['plain_chunked_over_plain']:.2f}x"),
        ("  kvcli prefill", lambda r, q: f"{q['kvcli_prefill_over_plain']:.2f}x ({r['kvcli_prefill_s']:.2f} s)"),
        ("peak RSS", lambda r, q: f"{r['peak_rss_bytes'] / 1e6:,.0f} MB" + ("" if r["peak_rss_scope"] == "length" else " (process)")),
    ]
    for label, cell in rows:
        table.add_row(label, *(cell(r, r["ratios"]) for r in sizes))
    if any(r.get("formats") for r in sizes):
        for label, cells in _format_rows(sizes):
            table.add_row(label, *cells)
    return table


def _stages(rates: dict[str, Any] | None) -> str:
    """A restore's stage rates on all threads: read and hash of stored bytes, decompress (and copy) of raw."""
    if not rates:
        return "-"
    names = (("read_gb_s_stored", "read"), ("hash_gb_s_stored", "hash"), ("decompress_gb_s_raw", "decompress"),
             ("copy_gb_s_raw", "copy"))
    return ", ".join(f"{label} {rates[k]:.1f}" for k, label in names if rates.get(k))


def _format_rows(sizes: list[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """(label, one cell per length) rows for render: one block per quantized format (formats.py)."""
    names = [n for n in (sizes[0].get("formats") or {})] if sizes else []
    out: list[tuple[str, list[str]]] = []
    for name in names:
        cells = [r["formats"][name] for r in sizes]
        out += [
            (f"{name}: on disk", [f"{c['disk_over_raw']:.1%} of raw ({c['bytes_on_disk'] / 1e6:,.1f} MB)" for c in cells]),
            ("  restore", [f"{c['restore_s']:.3f} s, {c['restore_gb_per_s']:.2f} GB/s" for c in cells]),
            ("  TTFT with cache", [f"{c['ttft_cached_s']:.3f} s" for c in cells]),
            ("  top-1 (teacher-forced)", [f"{c['agreement']['top1']:.2%}" for c in cells]),
            ("  mean KL", [f"{c['agreement']['kl_mean']:.2e}" for c in cells]),
            ("  same whole answers", ["-" if (same := c["agreement"]["answers_identical"]) is None else f"{same:.0%}" for c in cells]),
        ]
    return out

