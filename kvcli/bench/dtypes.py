"""Several compute dtypes benched in one run: which is faster here, length by length. Advice only: kvcli never
picks a dtype for the user, since a cache's dtype is part of its identity."""

from __future__ import annotations

from typing import Any

# (result field, what it times): lower is faster
COMPARED = (("kvcli_prefill_s", "prefill"), ("ttft_cached_s", "TTFT with cache"),
            ("decode_ms_per_token", "decode, 1 question"), ("batch_ms_per_row_token", "decode, batched"))


def compare(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each later run's times over the first run's, per length both measured: {tokens, dtype, against, ratios}."""
    base, rows = results[0], []
    for other in results[1:]:
        theirs = {r["tokens"]: r for r in other["sizes"]}
        for a in base["sizes"]:
            if (b := theirs.get(a["tokens"])) is not None:
                ratios = {key: b[key] / a[key] if a.get(key) else float("nan") for key, _ in COMPARED}
                rows.append({"tokens": a["tokens"], "dtype": other["dtype"], "against": base["dtype"], "ratios": ratios})
    return rows


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """One line per compared length: each time as a ratio, and which dtype each part favours."""
    lines = []
    for r in rows:
        parts = ", ".join(f"{label} {r['ratios'][key]:.2f}x" for key, label in COMPARED)
        faster = [label for key, label in COMPARED if r["ratios"][key] < 1]
        slower = [label for key, label in COMPARED if r["ratios"][key] >= 1]
        verdict = "; ".join(s for s in (f"faster for {', '.join(faster)}" if faster else "",
                                        f"slower for {', '.join(slower)}" if slower else "") if s)
        lines.append(f"{r['dtype']} against {r['against']} at {r['tokens']:,} tokens: {parts} ({verdict})")
    return lines
