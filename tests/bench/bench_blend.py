"""Blending caches prefilled apart (engine/cache/blend.py): time to first token and agreement, per recompute fraction.

Three different documents of about 2,000 tokens each (the sample licence's first part, a generated staff
directory, generated meeting notes naming the directory's people) are prefilled apart with the default model.
Per fraction: time to first token of a blended prompt (open and restore the caches, compose, recompute, the
question's forward and its first token) against recomputing the whole composed prompt (prefill + question +
first token), measured alternately in one run; the recompute's greedy answers (32 tokens) teacher-forced
through the blended cache (top-1 agreement, mean KL: engine/fidelity.py) and the blended cache's own greedy
answers compared whole. Not part of the test run. Usage: python tests/bench/bench_blend.py [--fractions 0,0.05,...]
[--tokens 2000] [--new 32] [--repeats 1] [--rule first|last]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvcli import bench, documents
from kvcli.documents import decode
from kvcli.engine import fidelity, prefilling as pf
from kvcli.engine.cache import blend, layers
from kvcli.engine.cache.kvcache import KVCache
from kvcli.engine.model import models
from kvcli.engine.prompt import framing as fr
from kvcli.format import store

SAMPLES = Path(__file__).resolve().parents[2] / "samples"
FIRST = ["Ada", "Bruno", "Chiara", "Dmitri", "Elena", "Farid", "Greta", "Hiro", "Ines", "Jonas", "Kemal", "Lena",
         "Marek", "Nadia", "Oskar", "Priya", "Quentin", "Rosa", "Stefan", "Tamar", "Umar", "Vera", "Wen", "Yusuf"]
LAST = ["Okafor", "Lindqvist", "Moreau", "Petrov", "Haddad", "Silva", "Tanaka", "Novak", "Keller", "Rossi", "Kowalski", "Berg"]
ROLES = ["geologist", "pilot", "cook", "radio operator", "doctor", "engineer", "botanist", "mechanic", "archivist", "diver"]
CITIES = ["Lisbon", "Tromso", "Nairobi", "Osaka", "Quito", "Tallinn", "Perth", "Montreal", "Izmir", "Valparaiso"]
TOPICS = ["the broken water pump", "the winter supply flight", "the new greenhouse", "the radio mast repair",
          "the glacier survey", "the kitchen budget", "the diving schedule", "the archive move", "the solar panels"]
QUESTIONS = [
    "What is the role of the person who chaired the first meeting?",
    "Which city does the person who opened the second meeting come from?",
    "Who is the station's doctor, and which meeting did they attend?",
    "What did the meeting about the greenhouse decide, and who proposed it?",
    "Under the licence, what is a Contribution, and who made the first contribution at the station?",
    "Which room does the chair of the last meeting work in?",
    "What does the licence say about warranties, and did any meeting discuss a warranty?",
    "Name two people from the directory who attended the same meeting.",
]


def people(rng: random.Random, n: int) -> list[dict]:
    names = rng.sample([f"{f} {s}" for f in FIRST for s in LAST], n)
    return [{"name": x, "role": rng.choice(ROLES), "city": rng.choice(CITIES), "room": rng.randint(100, 399),
             "year": rng.randint(1998, 2024)} for x in names]


def directory(staff: list[dict]) -> str:
    lines = ["Staff directory of the Harbor Lane research station", ""]
    for p in staff:
        lines.append(f"{p['name']} works as the station's {p['role']}. {p['name'].split()[0]} comes from {p['city']}, "
                     f"has an office in room {p['room']} and joined the station in {p['year']}.")
    return "\n".join(lines)


def meetings(rng: random.Random, staff: list[dict], n: int) -> str:
    lines = ["Minutes of the Harbor Lane station meetings", ""]
    for i in range(n):
        chair, opener, *rest = rng.sample(staff, 5)
        topic = rng.choice(TOPICS)
        lines.append(f"Meeting {i + 1}, held on day {3 * i + 2} of the season in the common room, was chaired by "
                     f"{chair['name']}. {opener['name']} opened the meeting with a report on {topic}. Also present: "
                     f"{', '.join(p['name'] for p in rest)}. After a discussion the meeting decided to "
                     f"{rng.choice(['postpone', 'approve', 'reject', 'review again'])} the plan for {topic}, as proposed by "
                     f"{rng.choice(rest)['name']}.")
    return "\n".join(lines)


def fit(lm, frame, text: str, n: int) -> str:
    """The longest prefix of text whose framed ids are at most n tokens (the text repeated if short)."""
    return bench.document_of(lm, frame, decode(text.encode(), "doc.txt"), n).text


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fractions", default="0,0.05,0.15,0.3,0.5,1.0")
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=1, help="timings per fraction (blend and recompute alternating)")
    ap.add_argument("--rule", default="first", choices=["first", "last"], help="which tokens of a later document are recomputed")
    args = ap.parse_args()
    lm = models.load()
    frame = fr.choose(lm.tokenizer, "auto", None)
    rng = random.Random(7)
    staff = people(rng, 60)
    texts = [documents.read(SAMPLES / "document.txt").text, directory(staff), meetings(rng, staff, 40)]
    folder = Path(tempfile.mkdtemp(prefix="bench-blend-"))
    paths = []
    for i, text in enumerate(texts):
        path = folder / f"doc{i}.kv"
        pf.prefill(lm, decode(fit(lm, frame, text, args.tokens).encode(), f"doc{i}.txt"), path)
        paths.append(path)

    def composed(fraction: float):
        opened = [store.open_cache(p) for p in paths]
        try:
            return blend.compose(lm, opened, fraction, rule=args.rule)
        finally:
            for o in opened:
                o.close()

    exact = composed(1.0)
    ids = exact.token_ids
    tails = [fr.question_ids(lm.tokenizer, exact.framing, q, ids) for q in QUESTIONS]
    ref_states = [layers.LayerState(s.kind, s.keys.clone(), s.values.clone(), s.seq_length, s.sliding_window)
                  for s in layers.read(pf.run_chunks(lm, ids, pf.DEFAULT_CHUNK))]

    def greedy(states) -> list[list[int]]:
        got = []
        for tail in tails:
            x = torch.tensor([ids + tail])
            with torch.inference_mode():
                out = lm.model.generate(input_ids=x, attention_mask=torch.ones_like(x), cache=KVCache.from_states(states),
                                        max_new_tokens=args.new, do_sample=False)
            got.append(out[0, x.shape[1]:].tolist())
        return got

    reference = greedy(ref_states)

    def first_token(cache, tail) -> int:
        with torch.inference_mode():
            logits = lm.model(input_ids=torch.tensor([tail]), cache=cache, use_cache=True, logits_to_keep=1).logits
        return int(logits[0, -1].argmax())

    def ttft_recompute() -> float:
        t0 = time.perf_counter()
        cache = pf.run_chunks(lm, ids, pf.DEFAULT_CHUNK)
        first_token(cache, tails[0])
        return time.perf_counter() - t0

    def ttft_blend(fraction: float) -> float:
        t0 = time.perf_counter()
        made = composed(fraction)
        first_token(made.cache, tails[0])
        return time.perf_counter() - t0

    rows = []
    print(f"rule {args.rule}; documents: {[len(store.read_manifest(p).token_ids) for p in paths]} cached tokens, composed prompt {len(ids)} "
          f"tokens, {len(QUESTIONS)} questions x {args.new} answer tokens (float32, {lm.device})")
    for fraction in [float(f) for f in args.fractions.split(",")]:
        blend_s, full_s = [], []
        for _ in range(args.repeats):
            blend_s.append(ttft_blend(fraction))
            full_s.append(ttft_recompute())
        made = composed(fraction)
        states = made.cache.states()
        agreement = fidelity.compare(lm, ref_states, states, tails, reference, candidate_answers=greedy(states))
        row = {"recompute": fraction, "recomputed_tokens": made.recomputed_tokens, "ttft_blend_s": round(statistics.median(blend_s), 3),
               "ttft_recompute_s": round(statistics.median(full_s), 3),
               "ratio": round(statistics.median(blend_s) / statistics.median(full_s), 3),
               "top1": round(agreement.top1, 4), "kl_mean": round(agreement.kl_mean, 4),
               "answers_identical": agreement.answers_identical}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("| recompute | recomputed tokens | TTFT blend (s) | TTFT recompute (s) | ratio | top-1 | mean KL | whole answers identical |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['recompute']:g} | {r['recomputed_tokens']} | {r['ttft_blend_s']} | {r['ttft_recompute_s']} | {r['ratio']} | "
              f"{r['top1']:.1%} | {r['kl_mean']:.3g} | {r['answers_identical']:.0%} |")


if __name__ == "__main__":
    main()
