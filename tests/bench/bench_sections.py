"""Sectioned caches (engine/sections): documents 3-8x the window, questions with known answers.

Three licence texts as Debian installs them (/usr/share/common-licenses: GPL-3, LGPL-2.1, MPL-2.0; public texts),
each prefilled with the default model at `--window` (1,024 by default) as a sectioned cache and, for comparison, as
one plain cache of the same tokens (the model's own 8,192 positions hold each). Per question (68, spread through
the documents, each with the phrase that holds its answer and a pattern a right answer matches):

- recall: whether the section holding the phrase is among those the question's selection used;
- answers right (greedy, --new tokens) from the sectioned cache, from recomputing the same selected text without any
  cache (the reference a sectioned answer approximates), and from the document truncated to the window;
- time to first token from the sectioned cache (select, compose with the recompute share, the question's forward)
  against recomputing the selected text (one forward over the composed prompt and the question), at shares 0 and
  --recompute, measured in turn --ttft-repeats times (the median of each);
- prefill time (the model's forward passes) and disk per token against the plain cache of the same document.

Not part of the test run. Usage: python tests/bench/bench_sections.py [--window 1024] [--recompute 0.15] [--new 32]
[--repeats N] [--prefill-only] [--json OUT] [--model PATH_OR_ID] [--threads N] [--ttft-repeats N]
[--compression small|fast] (both caches stored with that setting of `prefill --compression`; default: prefill's own)
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch

import kvcli
from kvcli.documents import decode
from kvcli.engine import prefilling as pf
from kvcli.engine.prompt import framing as fr
from kvcli.engine.sections import build, compose as cp, select
from kvcli.format import store

LICENSES = Path("/usr/share/common-licenses")
# (document, question, phrase holding the answer, pattern of a right answer)
QUESTIONS = [
    ("GPL-3", "Which version of the GNU General Public License does \"This License\" refer to?",
     "refers to version 3 of the GNU General Public License", r"\b3\b|three"),
    ("GPL-3", "What is the work that results from modifying a program called?", "The resulting work is called a \"modified version\"",
     r"modified version"),
    ("GPL-3", "For how long must a written offer to provide the Corresponding Source remain valid?",
     "valid for at least three years", r"three years|3 years"),
    ("GPL-3", "By what kind of transmission may you convey the object code, if you tell other peers where the source is?",
     "Convey the object code using peer-to-peer transmission", r"peer[- ]to[- ]peer"),
    ("GPL-3", "What is a \"User Product\"?", "A \"User Product\" is either", r"consumer product"),
    ("GPL-3", "What are \"Additional permissions\"?", "\"Additional permissions\" are terms that supplement", r"supplement"),
    ("GPL-3", "If you stop violating the License, how many days does the copyright holder have to notify you before "
     "your license is reinstated permanently?", "prior to 60 days after the cessation", r"\b60\b|sixty"),
    ("GPL-3", "After the copyright holder notifies you of a violation, within how many days must you cure it?",
     "cure the violation prior to 30 days after", r"\b30\b|thirty"),
    ("GPL-3", "Which version of the GNU Affero General Public License may a covered work be combined with?",
     "under version 3 of the GNU Affero General Public License", r"\b3\b|three"),
    ("GPL-3", "Who may publish revised and new versions of the GNU General Public License?",
     "The Free Software Foundation may publish revised", r"Free Software Foundation|FSF"),
    ("LGPL-2.1", "This is the first released version of the Lesser GPL; which library license does it also count as "
     "the successor of?", "This is the first released version of the Lesser GPL", r"Library General Public License|version 2"),
    ("LGPL-2.1", "Why is this license called the \"Lesser\" General Public License?", "We call this license the \"Lesser\"",
     r"\bless\b"),
    ("LGPL-2.1", "What is a program that is designed to work with the Library by being linked with it called?",
     "is called a \"work that uses the Library\"", r"work that uses the Library"),
    ("LGPL-2.1", "Which Section states the terms for distributing executables linked with the Library?",
     "Section 6 states terms for distribution", r"\b6\b|six"),
    ("LGPL-2.1", "How long may inline functions be, in lines, for the use of the object file to be unrestricted?",
     "ten lines or less in length", r"\b10\b|ten"),
    ("LGPL-2.1", "For how long must a written offer to give the user the materials remain valid?",
     "least three years, to give the same user the materials", r"three years|3 years"),
    ("MPL-2.0", "What does \"Executable Form\" mean?", "means any form of the work other than Source Code Form",
     r"other than Source Code"),
    ("MPL-2.0", "What is a \"Larger Work\"?", "means a work that combines Covered Software with other material",
     r"combines Covered Software"),
    ("MPL-2.0", "Once you become compliant, how many days after a Contributor's notice are your rights reinstated?",
     "You become compliant prior to 30 days after", r"\b30\b|thirty"),
    ("MPL-2.0", "In which courts may litigation relating to this License be brought?",
     "courts of a jurisdiction where the defendant maintains its principal", r"defendant|principal place of business"),
    ("MPL-2.0", "Who is the license steward of the Mozilla Public License?", "Mozilla Foundation is the license steward",
     r"Mozilla Foundation"),
    ("MPL-2.0", "What is Exhibit A of the License?", "Exhibit A - Source Code Form License Notice", r"License Notice|notice"),
    # more questions, spread through each document by position (each tenth of each document holds two or three)
    ("GPL-3", "On what date was version 3 of the GNU General Public License published?",
     "GNU GENERAL PUBLIC LICENSE Version 3, 29 June 2007", r"29 June,? 2007|June 29,? 2007|2007-06-29"),
    ("GPL-3", "With how many steps do developers that use the GNU GPL protect your rights?",
     "Developers that use the GNU GPL protect your rights with two steps", r"\btwo\b|\b2\b"),
    ("GPL-3", "What examples does the License give of a \"Major Component\" of an operating system?",
     "a major essential component (kernel, window system, and so on)", r"kernel|window system"),
    ("GPL-3", "Which section makes sublicensing unnecessary?",
     "Sublicensing is not allowed; section 10 makes it unnecessary", r"\b10\b|\bten\b"),
    ("GPL-3", "On what date was the WIPO copyright treaty mentioned in the License adopted?",
     "article 11 of the WIPO copyright treaty adopted on 20 December 1996",
     r"20 December,? 1996|December 20,? 1996|1996-12-20"),
    ("GPL-3", "Besides stating that you modified it, what must the prominent notices on a modified work give?",
     "stating that you modified it, and giving a relevant date", r"\bdate\b"),
    ("GPL-3", "What is a compilation of a covered work with separate and independent works on a storage or "
     "distribution medium called?", "is called an \"aggregate\" if the compilation and its resulting copyright",
     r"aggregate"),
    ("GPL-3", "In the License's example of a User Product on which nobody can install modified object code, where has "
     "the work been installed?", "(for example, the work has been installed in ROM)", r"\bROM\b|read[- ]only memory"),
    ("GPL-3", "What are all other non-permissive additional terms considered to be?",
     "All other non-permissive additional terms are considered \"further restrictions\"", r"further restrictions?"),
    ("GPL-3", "What kind of patent license does each contributor grant you under its essential patent claims?",
     "Each contributor grants you a non-exclusive, worldwide, royalty-free patent license",
     r"non-?exclusive|world-?wide|royalty-?free"),
    ("GPL-3", "The ban on conveying under a discriminatory patent license arrangement does not apply if the "
     "arrangement was entered into before what date?", "or that patent license was granted, prior to 28 March 2007",
     r"28 March,? 2007|March 28,? 2007|2007-03-28"),
    ("GPL-3", "In the sample interactive-mode notice, what should the user type for details of the warranty?",
     "This program comes with ABSOLUTELY NO WARRANTY; for details type `show w'", r"show w\b"),
    ("GPL-3", "If your program is a subroutine library and you want to permit linking proprietary applications with "
     "it, which license should you use?", "use the GNU Lesser General Public License instead of this License",
     r"Lesser|LGPL"),
    ("LGPL-2.1", "In which month and year was version 2.1 of the GNU Lesser General Public License issued?",
     "GNU LESSER GENERAL PUBLIC LICENSE Version 2.1, February 1999", r"February,? 1999|Feb\.? 1999|1999-02"),
    ("LGPL-2.1", "According to the preamble, what poses a constant threat to the existence of any free program?",
     "software patents pose a constant threat to the existence of any free program", r"patent"),
    ("LGPL-2.1", "Permission to use which library in non-free programs lets many more people use the whole GNU "
     "operating system?", "permission to use the GNU C Library in non-free programs", r"\bC Library|glibc|\blibc\b"),
    ("LGPL-2.1", "What does \"library\" mean in this License?",
     "A \"library\" means a collection of software functions and/or data",
     r"collection of (software )?functions|functions and/or data|software functions"),
    ("LGPL-2.1", "For a library, what does complete source code include besides the source code for all its modules?",
     "plus any associated interface definition files, plus the scripts used to control compilation",
     r"interface definition|scripts?"),
    ("LGPL-2.1", "For what physical act may you charge a fee?",
     "You may charge a fee for the physical act of transferring a copy", r"transfer"),
    ("LGPL-2.1", "What does the library function in the example of Subsection 2d compute?",
     "a function in a library to compute square roots has a purpose", r"square roots?"),
    ("LGPL-2.1", "Once a copy's notices are changed to refer to the ordinary GNU General Public License, what is that "
     "change for that copy?", "Once this change is made in a given copy, it is irreversible for that copy",
     r"irreversible|cannot be (undone|reversed)|permanent"),
    ("LGPL-2.1", "What kind of mechanism for linking with the Library does option b) of Section 6 allow using?",
     "b) Use a suitable shared library mechanism for linking with the Library", r"shared librar"),
    ("LGPL-2.1", "What examples does Section 6 give of the major components of an operating system?",
     "with the major components (compiler, kernel, and so on) of the operating system", r"compiler|kernel"),
    ("LGPL-2.1", "Why are you not required to accept this License?",
     "You are not required to accept this License, since you have not signed it", r"\bsign(ed)?\b|\bsigning\b"),
    ("LGPL-2.1", "According to Section 11, what is the sole purpose of that section?",
     "sole purpose of protecting the integrity of the free software distribution system", r"integrity"),
    ("LGPL-2.1", "If distribution of the Library is restricted in certain countries by patents or copyrighted "
     "interfaces, what may the original copyright holder add?",
     "may add an explicit geographical distribution limitation excluding those countries", r"geographic"),
    ("LGPL-2.1", "According to Section 15, why is there no warranty for the Library?",
     "BECAUSE THE LIBRARY IS LICENSED FREE OF CHARGE, THERE IS NO WARRANTY",
     r"free of charge|(no|without) charge|gratis|costs? nothing|for free|at no cost"),
    ("LGPL-2.1", "In the sample notice to attach to a new library, which version of the License is named, with any "
     "later version as an option?", "either version 2.1 of the License, or (at your option) any later version",
     r"2\.1"),
    ("LGPL-2.1", "Which company disclaims all copyright interest in the library in the sample copyright disclaimer?",
     "Yoyodyne, Inc., hereby disclaims all copyright interest in the library", r"Yoyodyne"),
    ("MPL-2.0", "Which kinds of claims does the definition of \"Patent Claims\" list as included, without limitation?",
     "including without limitation, method, process, and apparatus claims", r"method|process|apparatus"),
    ("MPL-2.0", "More than what percentage of an entity's outstanding shares must be owned for the ownership to count "
     "as control?", "ownership of more than fifty percent (50%) of the outstanding shares", r"\b50\b|fifty"),
    ("MPL-2.0", "On what date do the licenses granted in Section 2.1 become effective for each Contribution?",
     "on the date the Contributor first distributes such Contribution", r"first distribut"),
    ("MPL-2.0", "Besides trademarks and service marks, in what else of any Contributor does this License grant no "
     "rights?", "This License does not grant any rights in the trademarks, service marks, or logos", r"\blogos?\b"),
    ("MPL-2.0", "Besides fair use, which copyright doctrine does the License say it is not intended to limit?",
     "applicable copyright doctrines of fair use, fair dealing, or other equivalents", r"fair dealing"),
    ("MPL-2.0", "If You distribute Covered Software in Executable Form, at most what may you charge recipients for "
     "obtaining the Source Code Form?", "at a charge no more than the cost of distribution to the recipient",
     r"cost of distribution|distribution costs?|cost of distributing"),
    ("MPL-2.0", "Under what terms may You create and distribute a Larger Work?",
     "You may create and distribute a Larger Work under terms of Your choice", r"(your|own|their) choice|choos"),
    ("MPL-2.0", "To what extent may You alter license notices contained within the Source Code Form?",
     "to the extent required to remedy known factual inaccuracies", r"inaccura"),
    ("MPL-2.0", "If You cannot comply with the License due to statute or regulation, where must the description of "
     "the limitations be placed?", "Such description must be placed in a text file included with all distributions",
     r"text file"),
    ("MPL-2.0", "If You have come back into compliance and the Contributor never notifies You of the non-compliance, "
     "after how many days are Your rights reinstated on an ongoing basis?",
     "prior to 60 days after You have come back into compliance", r"\b60\b|sixty"),
    ("MPL-2.0", "Which agreements granted by You or Your distributors before termination shall survive termination?",
     "all end user license agreements (excluding distributors and resellers)", r"end[- ]user"),
    ("MPL-2.0", "On what basis is Covered Software provided under this License?",
     "Covered Software is provided under this License on an \"as is\"", r"\bas[ -]is\b"),
    ("MPL-2.0", "Which kinds of damages does the Limitation of Liability list as examples?",
     "including, without limitation, damages for lost profits, loss of",
     r"lost profits|goodwill|work stoppage|computer failure"),
    ("MPL-2.0", "To liability for what does the limitation of liability not apply, where applicable law prohibits "
     "such limitation?", "limitation of liability shall not apply to liability for death or", r"death|personal injury"),
    ("MPL-2.0", "If a provision of this License is held unenforceable, to what extent shall it be reformed?",
     "such provision shall be reformed only to the extent necessary to make it enforceable",
     r"necessary to make it enforceable|extent necessary|make it enforceable"),
    ("MPL-2.0", "What must you do with the license's name if you create a modified version of this License for "
     "software not governed by it?",
     "you may create and use a modified version of this License if you rename the license",
     r"rename|new name|change (its|the) name"),
    ("MPL-2.0", "At which web address can a copy of the MPL be obtained, according to the Exhibit A notice?",
     "You can obtain one at http://mozilla.org/MPL/2.0/", r"mozilla\.org/MPL"),
]


def squeeze(text: str) -> str:
    return " ".join(text.split())


def greedy(lm, ids: list[int], new: int) -> str:
    """The model's greedy answer to a prompt recomputed whole (no cache)."""
    with torch.inference_mode():
        out = lm.model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=new, do_sample=False, pad_token_id=lm.tokenizer.eos_token_id)
    return lm.tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)


def first_token_recomputed(lm, ids: list[int]) -> float:
    """Seconds for one forward over the whole prompt (document text and question) to the first token's logits."""
    t0 = time.perf_counter()
    with torch.inference_mode():
        lm.model(input_ids=torch.tensor([ids]), logits_to_keep=1).logits.argmax(-1)
    return time.perf_counter() - t0


def first_token_sectioned(lm, opened, chosen: list[int], share: float, question: str, head) -> tuple[float, list[int]]:
    """Seconds to compose the chosen sections (restore, move, recompute the share) after the head restored once per
    cache (`head`, as a session keeps it), and run the question to its first token's logits, as a session does (the
    last recomputed tokens in the question's pass); the composed prompt's ids with the question."""
    t0 = time.perf_counter()
    made = cp.compose(lm, opened, chosen, share, head_copy=head, defer=True)
    q = fr.question_ids(lm.tokenizer, made.framing, question, made.token_ids)
    n = len(made.token_ids)
    inputs = made.cache.forward_inputs(q, lm.device) or {"input_ids": torch.tensor([q]),
                                                          "position_ids": torch.arange(n, n + len(q))[None]}
    with torch.inference_mode():
        lm.model(**inputs, cache=made.cache, use_cache=True, logits_to_keep=1).logits.argmax(-1)
    return time.perf_counter() - t0, made.token_ids + q


def truncated_prompt(lm, text: str, window: int, question: str) -> list[int]:
    """The document cut to the window (its first tokens, the question and answer's room kept), then the question."""
    framing = fr.choose(lm.tokenizer)
    ids, _cut = fr.split_document(lm.tokenizer, framing, text)
    q = fr.question_ids(lm.tokenizer, framing, question)
    return ids[: window - pf.ANSWER_ROOM - len(q)] + q


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--recompute", type=float, default=0.15)
    ap.add_argument("--new", type=int, default=32, help="answer tokens")
    ap.add_argument("--json", type=Path, default=None, help="write every measurement here")
    ap.add_argument("--repeats", type=int, default=1, help="prefills of each kind per document (the least time is kept)")
    ap.add_argument("--prefill-only", action="store_true", help="measure prefill time and disk only")
    ap.add_argument("--model", default=None, help="a model as `--model` takes it (default: kvcli's default model)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    ap.add_argument("--ttft-repeats", type=int, default=3, help="first-token timings of each kind per question (the median)")
    ap.add_argument("--compression", choices=["small", "fast"], default=None, help="both caches' storage setting")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = kvcli.load(args.model)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="bench-sections-warm-") as tmp:  # the first forward passes pay one-time costs
        pf.prefill(lm, decode((LICENSES / "MPL-2.0").read_text(encoding="utf-8")[:4000].encode(), "warm.txt"), Path(tmp) / "w.kv")
    rows, docs = [], {}
    stored = {} if args.compression is None else {"compression": args.compression}
    with tempfile.TemporaryDirectory(prefix="bench-sections-") as tmp:
        for name in dict.fromkeys(d for d, *_ in QUESTIONS):
            text = (LICENSES / name).read_text(encoding="utf-8")
            doc = decode(text.encode(), name)
            runs = {"sectioned": [], "plain": []}
            for _ in range(args.repeats):  # the two in turn, each replacing its cache: the least time of each
                runs["plain"].append(pf.prefill(lm, doc, Path(tmp) / f"{name}-plain.kv", force=True, **stored))
                runs["sectioned"].append(build.prefill(lm, doc, Path(tmp) / f"{name}.kv", window=args.window, force=True,
                                                       **stored))
            sec, plain = (min(runs[k], key=lambda r: r.compute_s) for k in ("sectioned", "plain"))
            m = store.read_manifest(sec.path)
            docs[name] = {"tokens": m.document_tokens, "window": args.window, "sections": len(m.sections.parts),
                          "times_window": round(m.document_tokens / args.window, 1),
                          "prefill_s": round(sec.compute_s, 2), "plain_prefill_s": round(plain.compute_s, 2),
                          "prefill_ratio": round(sec.compute_s / plain.compute_s, 3),
                          "disk_per_token": round(m.bytes_stored / m.document_tokens), "plain_disk_per_token":
                          round(plain.manifest.bytes_stored / plain.manifest.num_tokens),
                          "disk_ratio": round((m.bytes_stored / m.document_tokens) / (plain.manifest.bytes_stored / plain.manifest.num_tokens), 3),
                          "path": sec.path, "text": text}
            print(json.dumps({k: v for k, v in docs[name].items() if k not in ("path", "text")} | {"document": name}), flush=True)
        for name, question, phrase, pattern in [] if args.prefill_only else QUESTIONS:
            d = docs[name]
            with store.open_cache(d["path"]) as opened:
                m = opened.manifest
                parts = m.sections.parts
                head = cp.restore_head(lm, opened)
                holder = next(p.index for p in parts if squeeze(phrase) in squeeze(p.text))
                budget = min(m.sections.window, lm.max_positions) - len(m.token_ids) - pf.ANSWER_ROOM
                choice = select.choose([p.num_tokens for p in parts], select.scores([p.text for p in parts], question), budget)
                runs = {0.0: [], args.recompute: [], "recompute": []}
                for _ in range(args.ttft_repeats):  # the three in turn, same warm model: the median of each
                    for share in (0.0, args.recompute):
                        t, prompt = first_token_sectioned(lm, opened, choice.chosen, share, question, head)
                        runs[share].append(t)
                    runs["recompute"].append(first_token_recomputed(lm, prompt))
                ttft = {share: statistics.median(runs[share]) for share in (0.0, args.recompute)}
                ttft_recompute = statistics.median(runs["recompute"])
                session = kvcli.Session.composed(lm, opened.path, m, cp.compose(lm, opened, choice.chosen, args.recompute),
                                                 blended={"documents": len(choice.chosen), "recompute": args.recompute,
                                                          "sections": choice.chosen, "of": len(parts)})
                answer = session.ask(question, kvcli.GenerationOptions(max_new_tokens=args.new)).answer
            recomputed = greedy(lm, prompt, args.new)
            truncated = greedy(lm, truncated_prompt(lm, d["text"], args.window, question), args.new)
            right = {k: bool(re.search(pattern, v, re.I)) for k, v in (("sectioned", answer), ("recompute", recomputed),
                                                                     ("truncated", truncated))}
            row = {"document": name, "question": question, "holder": holder, "chosen": choice.chosen,
                   "recall": holder in choice.chosen, "right": right, "ttft_s": {str(k): round(v, 3) for k, v in ttft.items()},
                   "ttft_recompute_s": round(ttft_recompute, 3), "prompt_tokens": len(prompt),
                   "answers": {"sectioned": answer, "recompute": recomputed, "truncated": truncated}}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.prefill_only:
        print(json.dumps({k: {x: y for x, y in v.items() if x not in ("path", "text")} for k, v in docs.items()}, indent=1))
        return
    n = len(rows)
    summary = {
        "model": lm.fingerprint["name"], "questions": n, "window": args.window, "recompute": args.recompute,
        "recall": sum(r["recall"] for r in rows),
        "right": {k: sum(r["right"][k] for r in rows) for k in ("sectioned", "recompute", "truncated")},
        "ttft_ratio_median": {str(s): round(statistics.median(r["ttft_s"][str(s)] / r["ttft_recompute_s"] for r in rows), 3)
                              for s in (0.0, args.recompute)},
        "ttft_s_median": {str(s): round(statistics.median(r["ttft_s"][str(s)] for r in rows), 3) for s in (0.0, args.recompute)},
        "ttft_recompute_s_median": round(statistics.median(r["ttft_recompute_s"] for r in rows), 3),
        "documents": {k: {x: y for x, y in v.items() if x not in ("path", "text")} for k, v in docs.items()},
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
