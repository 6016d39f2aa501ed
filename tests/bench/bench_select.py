"""Choosing a sectioned cache's sections: BM25 over their text against the model's own keys (InfLLM-style).

The questions and documents of bench_sections.py (three licence texts, 68 questions, or the first --first of them,
each with the phrase that holds its answer), prefilled with the default model at `--window` (1,024) as sectioned
caches. Per question, the sections are ranked three ways, with no second model and nothing trained:

- bm25: select.scores over the sections' text, as `ask` ranks them;
- keys: each section represented by a few of its own keys per layer and key/value head, read from its stored shards
  (restore.load_states) and turned back to position 0 (the inverse of the rotary rotation at the positions they were
  computed at). Representatives: InfLLM's (the `--reps` keys of the section's tokens that receive the most attention
  from the section's own tokens, the model's full attention over head, primer and section recomputed once with
  hooks on q_proj/k_proj), the section's mean key, or all its keys (the upper bound). The question (framed, after
  the head) runs through the model with a hook on each layer's q_proj: its un-rotated query vectors, rotated to
  `--distance` positions after the keys' position 0. A section's score: per layer, query head and question token,
  the best q.k/sqrt(d) over its representatives, standardized across the sections (z) so that no head or token
  dominates, then averaged over the layers of a layer set, the heads and the tokens ("dot"); the same with the
  cosine instead ("cos"); or "dot" less the same score of a question that asks nothing in particular ("cal": each
  section's prior taken out);
- rrf: reciprocal-rank fusion of bm25 and keys (1/(60 + rank) summed).

Recall: whether the section holding the phrase is among those chosen. bm25 chooses as select.choose does; the other
methods choose as many sections as bm25 did for the question (their best that fit the same budget), so that recall
compares the ranking and not the count; recall@1 and @3 are of the ranking alone. Answers right (greedy, --new
tokens, the sections composed at --recompute as `ask` does) for bm25, the declared keys method and rrf. Selection
time: bm25's select.scores against the question's forward pass and the key scores (representatives in memory).

Not part of the test run. Usage: python tests/bench/bench_select.py [--window 1024] [--reps 4] [--distance 0]
[--new 32] [--no-answers] [--keep DIR] [--json OUT] [--first N]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import kvcli  # noqa: E402
from bench_sections import LICENSES, QUESTIONS, squeeze  # noqa: E402
from kvcli.documents import decode  # noqa: E402
from kvcli.engine import prefilling as pf  # noqa: E402
from kvcli.engine.cache.restore import load_states  # noqa: E402
from kvcli.engine.prompt import framing as fr  # noqa: E402
from kvcli.engine.sections import build, compose as cp, select  # noqa: E402
from kvcli.format import parts as fparts, store  # noqa: E402

# The declared keys method (chosen before measuring; the sweep around it is reported too): InfLLM representatives,
# the middle third of the layers.
DECLARED = ("infllm", "middle")
# A question that asks for nothing in particular: its key scores are each section's prior (the "cal" scores subtract
# them), whatever a question asks.
NEUTRAL = "What does the text say?"
SCORINGS = ("dot", "cos", "cal")  # q.k/sqrt(d); cosine; q.k/sqrt(d) less the neutral question's
RRF_K = 60


def layer_sets(n: int) -> dict[str, list[int]]:
    third = n // 3
    return {"early": list(range(0, third)), "middle": list(range(third, 2 * third)), "late": list(range(2 * third, n)),
            "all": list(range(n))}


def rotary(lm, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n, d] of the model's rotary embedding at `positions` (attention scaling left out, as blend does)."""
    emb = lm.model.get_decoder().rotary_emb
    cos, sin = emb(torch.zeros(1, dtype=torch.float32), positions[None])
    scale = float(getattr(emb, "attention_scaling", 1.0) or 1.0)
    return cos[0].float() / scale, sin[0].float() / scale


def turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., n, d] rotated by the angles whose cos/sin [n, d] are given (rotate_half layout)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class Capture:
    """Forward hooks on q_proj and k_proj of every layer: their outputs (un-rotated) of the last forward pass."""

    def __init__(self, lm, keys: bool):
        cfg = lm.model.config
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.q: dict[int, torch.Tensor] = {}
        self.k: dict[int, torch.Tensor] = {}
        self.handles = []
        for i, layer in enumerate(lm.model.get_decoder().layers):
            attn = layer.self_attn
            self.handles.append(attn.q_proj.register_forward_hook(self._hook(self.q, i, self.heads)))
            if keys:
                self.handles.append(attn.k_proj.register_forward_hook(self._hook(self.k, i, self.kv_heads)))

    def _hook(self, into, i, heads):
        def hook(_module, _args, out):
            into[i] = out[0].detach().float().view(out.shape[1], heads, self.dim).transpose(0, 1)  # [heads, T, d]
        return hook

    def close(self):
        for h in self.handles:
            h.remove()


def section_keys(lm, path: Path, m, part) -> list[torch.Tensor]:
    """Section `part`'s stored keys per layer [kv_heads, n, d], float32, turned back to position 0."""
    with fparts.open_part(path, m, part.index) as opened:
        states = load_states(opened, device="cpu", dtype=torch.float32, room=0)
    cos, sin = rotary(lm, torch.arange(part.position, part.position + part.num_tokens))
    return [turn(s.keys[0].float(), cos, -sin).clone() for s in states]  # the inverse rotation: the angle negated


def infllm_reps(lm, head: list[int], planned, part, keys0: list[torch.Tensor], reps: int) -> list[torch.Tensor]:
    """Per layer [kv_heads, reps, d]: the keys of the section's tokens that receive the most attention from the
    section's own tokens (summed over its queries and the query heads of the key's group), the model's attention
    over head, primer and section recomputed with hooks."""
    ids = head + planned.primer + planned.body
    assert planned.body == part.token_ids and len(head) + len(planned.primer) == part.position
    cap = Capture(lm, keys=True)
    try:
        with torch.inference_mode():
            lm.model(input_ids=torch.tensor([ids]), logits_to_keep=1)
    finally:
        cap.close()
    n, total = part.num_tokens, len(ids)
    cos, sin = rotary(lm, torch.arange(total))
    group = cap.heads // cap.kv_heads
    causal = torch.ones(n, total, dtype=torch.bool).tril(total - n)  # section query i sees tokens <= position + i
    out = []
    for i, k0 in enumerate(keys0):
        # the stored keys turned back to position 0 are the keys k_proj gives for the same tokens: the inverse is right
        assert torch.allclose(k0, cap.k[i][:, -n:], atol=1e-3, rtol=1e-3), (part.index, i)
        q = turn(cap.q[i][:, -n:], cos[-n:], sin[-n:])  # [heads, n, d]
        k = turn(cap.k[i], cos, sin).repeat_interleave(group, 0)  # [heads, T, d]
        logits = (q @ k.transpose(1, 2)) / cap.dim ** 0.5
        att = logits.masked_fill(~causal, float("-inf")).softmax(-1)[:, :, -n:]  # [heads, n, n]: on the section's keys
        received = att.sum(1).view(cap.kv_heads, group, n).sum(1)  # [kv_heads, n]
        top = received.topk(min(reps, n), dim=-1).indices  # [kv_heads, r]
        out.append(torch.gather(k0, 1, top[..., None].expand(-1, -1, k0.shape[-1])))
    return out


def question_queries(lm, head: list[int], framing: fr.Framing, question: str, distance: int) -> list[torch.Tensor]:
    """Per layer [heads, t, d]: the question's query vectors (its own words' tokens, framed after the head), rotated to
    `distance` positions after position 0."""
    tok = lm.tokenizer
    q_ids = fr.question_ids(tok, framing, question)
    middle, tail = fr._pieces(tok, framing)[1:] if framing.kind != "plain" else ("", "")
    lo = len(tok(middle, add_special_tokens=False)["input_ids"]) if middle else 0
    hi = len(q_ids) - (len(tok(tail, add_special_tokens=False)["input_ids"]) if tail else 0)
    cap = Capture(lm, keys=False)
    try:
        with torch.inference_mode():
            lm.model(input_ids=torch.tensor([head + q_ids]), logits_to_keep=1)
    finally:
        cap.close()
    at = len(head)
    q = [cap.q[i][:, at + lo: at + hi] for i in sorted(cap.q)]
    if distance:
        cos, sin = rotary(lm, torch.tensor([distance]))
        q = [turn(x, cos, sin) for x in q]
    return q


def key_scores(queries: list[torch.Tensor], reps: list[list[torch.Tensor]], layers: list[int], *,
               cosine: bool = False) -> list[float]:
    """Per section: its best q.k/sqrt(d) (or cosine) per (layer, query head, question token), standardized across
    sections, then averaged. reps[s][layer]: [kv_heads, r, d]."""
    per = []
    for layer in layers:
        q = queries[layer]  # [heads, t, d]
        heads, d = q.shape[0], q.shape[-1]
        if cosine:
            q = torch.nn.functional.normalize(q, dim=-1)
        rows = []
        for s in reps:
            k = s[layer].repeat_interleave(heads // s[layer].shape[0], 0)  # [heads, r, d]
            if cosine:
                k = torch.nn.functional.normalize(k, dim=-1)
            rows.append((q @ k.transpose(1, 2)).amax(-1) / (1 if cosine else d ** 0.5))  # [heads, t]
        per.append(torch.stack(rows))  # [sections, heads, t]
    x = torch.stack(per)  # [layers, sections, heads, t]
    z = (x - x.mean(1, keepdim=True)) / (x.std(1, keepdim=True) + 1e-6)
    return z.mean((0, 2, 3)).tolist()


def ranking(scores: list[float]) -> list[int]:
    return sorted(range(len(scores)), key=lambda i: (-scores[i], i))


def rrf(*rankings: list[int]) -> list[float]:
    out = [0.0] * len(rankings[0])
    for order in rankings:
        for rank, i in enumerate(order):
            out[i] += 1 / (RRF_K + rank + 1)
    return out


def pick(order: list[int], sizes: list[int], budget: int, count: int, glue: int = 2) -> list[int]:
    """The first `count` sections of `order` that fit `budget` (as select.choose fills it), in document order."""
    chosen, used = [], 0
    for i in order:
        if len(chosen) >= count:
            break
        cost = sizes[i] + (glue if chosen else 0)
        if used + cost <= budget:
            chosen.append(i)
            used += cost
    return sorted(chosen or order[:1])


def answer(lm, opened, chosen: list[int], share: float, question: str, new: int) -> str:
    m = opened.manifest
    session = kvcli.Session.composed(lm, opened.path, m, cp.compose(lm, opened, chosen, share),
                                     blended={"documents": len(chosen), "recompute": share, "sections": chosen,
                                              "of": len(m.sections.parts)})
    return session.ask(question, kvcli.GenerationOptions(max_new_tokens=new)).answer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=4, help="InfLLM representative keys per section, layer and key head")
    ap.add_argument("--distance", type=int, default=0, help="positions between the keys and the question's queries")
    ap.add_argument("--recompute", type=float, default=0.15)
    ap.add_argument("--new", type=int, default=32, help="answer tokens")
    ap.add_argument("--no-answers", action="store_true", help="measure selection only")
    ap.add_argument("--keep", type=Path, default=None, help="keep the sectioned caches here (reused when present)")
    ap.add_argument("--json", type=Path, default=None, help="write every measurement here")
    ap.add_argument("--first", type=int, default=None, help="only the first N questions (22: the set docs/performance.md measured)")
    args = ap.parse_args()
    lm = kvcli.load()
    torch.manual_seed(0)
    n_layers = lm.model.config.num_hidden_layers
    sets = layer_sets(n_layers)
    framing = fr.choose(lm.tokenizer)
    tmp = tempfile.TemporaryDirectory(prefix="bench-select-")
    where = args.keep or Path(tmp.name)
    where.mkdir(parents=True, exist_ok=True)
    docs = {}
    for name in dict.fromkeys(d for d, *_ in QUESTIONS):
        text = (LICENSES / name).read_text(encoding="utf-8")
        path = where / f"{name}-w{args.window}.kv"
        if not store.is_cache(path):
            build.prefill(lm, decode(text.encode(), name), path, window=args.window, force=True)
        m = store.read_manifest(path)
        head, planned, _total = build.plan(lm.tokenizer, framing, text)
        assert head == m.token_ids and len(planned) == len(m.sections.parts)
        t0 = time.perf_counter()
        keys0 = [section_keys(lm, path, m, p) for p in m.sections.parts]
        t1 = time.perf_counter()
        saved = path.with_suffix(f".infllm{args.reps}.pt")  # the recomputed attention is slow: kept with --keep
        if args.keep and saved.exists():
            infllm = torch.load(saved)
        else:
            infllm = [infllm_reps(lm, head, pl, p, k, args.reps) for pl, p, k in zip(planned, m.sections.parts, keys0)]
            if args.keep:
                torch.save(infllm, saved)
        reps = {"infllm": infllm, "mean": [[k.mean(1, keepdim=True) for k in ks] for ks in keys0], "all": keys0}
        t2 = time.perf_counter()
        neutral = question_queries(lm, m.token_ids, framing, NEUTRAL, args.distance)
        docs[name] = {"path": path, "manifest": m, "reps": reps, "neutral": neutral}
        print(json.dumps({"document": name, "sections": len(m.sections.parts), "tokens": m.document_tokens,
                          "read_keys_s": round(t1 - t0, 2), "infllm_reps_s": round(t2 - t1, 2)}), flush=True)

    methods = [f"keys:{r}:{s}:{c}" for c in SCORINGS for r in ("infllm", "mean", "all") for s in sets]
    methods += [f"keys:infllm:L{i}:dot" for i in range(n_layers)]
    declared = f"keys:{DECLARED[0]}:{DECLARED[1]}:dot"
    rows = []
    for name, question, phrase, pattern in QUESTIONS[: args.first]:
        d = docs[name]
        m = d["manifest"]
        parts = m.sections.parts
        sizes = [p.num_tokens for p in parts]
        holder = next(p.index for p in parts if squeeze(phrase) in squeeze(p.text))
        budget = min(m.sections.window, lm.max_positions) - len(m.token_ids) - pf.ANSWER_ROOM
        t0 = time.perf_counter()
        bm = select.scores([p.text for p in parts], question)
        t_bm25 = time.perf_counter() - t0
        bm_choice = select.choose(sizes, bm, budget)
        count = len(bm_choice.chosen)
        t_forward = float("inf")
        for _ in range(3):  # the least of 3: the question's forward pass is short and the cores are shared
            t0 = time.perf_counter()
            queries = question_queries(lm, m.token_ids, framing, question, args.distance)
            t_forward = min(t_forward, time.perf_counter() - t0)
        orders = {"bm25": ranking(bm)}
        chosen = {"bm25": bm_choice.chosen}
        t_keys = None
        for method in methods:
            _, kind, ls, how = method.split(":")
            layers = [int(ls[1:])] if ls.startswith("L") else sets[ls]
            t0 = time.perf_counter()
            ks = key_scores(queries, d["reps"][kind], layers, cosine=how == "cos")
            if how == "cal":
                ks = [a - b for a, b in zip(ks, key_scores(d["neutral"], d["reps"][kind], layers))]
            if method == declared:
                t_keys = time.perf_counter() - t0
            orders[method] = ranking(ks)
            chosen[method] = pick(orders[method], sizes, budget, count)
            if not ls.startswith("L"):
                fused = "rrf:" + method[5:]
                orders[fused] = ranking(rrf(orders["bm25"], orders[method]))
                chosen[fused] = pick(orders[fused], sizes, budget, count)
        row = {"document": name, "question": question, "holder": holder, "count": count,
               "recall": {k: holder in v for k, v in chosen.items()},
               "rank": {k: v.index(holder) + 1 for k, v in orders.items()},
               "chosen": {k: chosen[k] for k in ("bm25", declared, "rrf:" + declared[5:])},
               "select_s": {"bm25": round(t_bm25, 4), "keys_forward": round(t_forward, 4), "keys_score": round(t_keys, 4)}}
        if not args.no_answers:
            row["right"], row["answers"] = {}, {}
            with store.open_cache(d["path"]) as opened:
                done: dict[tuple, str] = {}
                for k in row["chosen"]:
                    key = tuple(chosen[k])
                    if key not in done:
                        done[key] = answer(lm, opened, chosen[k], args.recompute, question, args.new)
                    row["answers"][k] = done[key]
                    row["right"][k] = bool(re.search(pattern, done[key], re.I))
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("recall", "rank")} |
                         {"rank": {k: row["rank"][k] for k in row["chosen"]}}), flush=True)

    def med(k):
        return round(statistics.median(r["select_s"][k] for r in rows), 4)

    every = list(rows[0]["recall"])
    summary = {
        "questions": len(rows), "window": args.window, "reps": args.reps, "distance": args.distance, "declared": declared,
        "recall": {k: sum(r["recall"][k] for r in rows) for k in every},
        "recall_at_1": {k: sum(r["rank"][k] <= 1 for r in rows) for k in every},
        "recall_at_3": {k: sum(r["rank"][k] <= 3 for r in rows) for k in every},
        "select_s_median": {"bm25": med("bm25"), "keys_forward": med("keys_forward"), "keys_score": med("keys_score")},
    }
    if not args.no_answers:
        summary["right"] = {k: sum(r["right"][k] for r in rows) for k in rows[0]["right"]}
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1, default=str) + "\n")
    tmp.cleanup()


if __name__ == "__main__":
    main()
