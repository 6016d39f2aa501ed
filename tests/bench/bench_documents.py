"""Converting documents (kvcli/documents/): a 100-page PDF's conversion time, twice, with the same ids; and how many
tokens an HTML page's main content keeps of the raw page's (not collected by pytest).

    python tests/bench/bench_documents.py [--pdf FILE] [--pages 100] [--html FILE_OR_DIR ...] [--model M]

Without --pdf it writes a PDF of --pages pages of the sample licence, 45 lines a page (tests/docfiles.py); with
--pdf FILE it converts that file (--pages ignored). Each conversion runs twice in one process; ids are the default
model's framed document ids (engine/counting.py: config and tokenizer only), compared between the two runs.
Without --html it measures a page written like a news site's (tests/docfiles.web_page); with it, every .html file
given or in the folders given. One JSON line per measurement, then a summary line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kvcli import documents  # noqa: E402
from kvcli.engine import counting  # noqa: E402
from tests import docfiles  # noqa: E402


def sample_pdf(pages: int) -> bytes:
    text = " ".join((ROOT / "samples" / "document.txt").read_text(encoding="utf-8").split())
    lines = textwrap.wrap(text, 90)
    ascii_lines = [line.encode("latin-1", "replace").decode("latin-1") for line in lines]
    return docfiles.pdf([[ascii_lines[(p * 45 + i) % len(ascii_lines)] for i in range(45)] for p in range(pages)])


def html_files(given: list[str]) -> list[Path]:
    out: list[Path] = []
    for g in map(Path, given):
        out += sorted(g.glob("*.html")) if g.is_dir() else [g]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pdf")
    parser.add_argument("--pages", type=int, default=100)
    parser.add_argument("--html", nargs="*", default=[])
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    counter = counting.Counter(args.model)
    tokenizer = counter.tokenizer

    data = Path(args.pdf).read_bytes() if args.pdf else sample_pdf(args.pages)
    name = args.pdf or f"generated-{args.pages}-pages.pdf"
    runs = []
    for attempt in (1, 2):
        t0 = time.perf_counter()
        doc = documents.from_bytes(data, name)
        seconds = time.perf_counter() - t0
        ids = _ids(counter, doc)
        runs.append((seconds, ids, doc))
        print(json.dumps({"pdf": Path(name).name, "run": attempt, "pages": doc.pages, "bytes": len(data), "chars": len(doc.text),
                          "seconds": round(seconds, 3), "tokens": len(ids), "converter": doc.converter}), flush=True)
    same = runs[0][1] == runs[1][1] and runs[0][2] == runs[1][2]

    ratios = []
    sample = (ROOT / "samples" / "document.txt").read_text(encoding="utf-8")
    pages = html_files(args.html) or [None]
    for page in pages:
        raw = page.read_text(encoding="utf-8", errors="replace") if page else docfiles.web_page(
            "Harbour dues rise for the first time in ten years", [" ".join(sample[i * 700:(i + 1) * 700].split()) for i in range(6)])
        doc = documents.from_bytes(raw.encode("utf-8"), page.name if page else "generated.html")
        raw_tokens, kept = len(tokenizer(raw)["input_ids"]), len(tokenizer(doc.text)["input_ids"])
        ratios.append(kept / raw_tokens)
        print(json.dumps({"html": page.name if page else "generated.html", "raw_tokens": raw_tokens, "text_tokens": kept,
                          "ratio": round(kept / raw_tokens, 4), "sections": doc.sections}), flush=True)
    print(json.dumps({"pdf_seconds": [round(r[0], 3) for r in runs], "same_ids": same, "html_pages": len(ratios),
                      "html_ratio_median": round(statistics.median(ratios), 4), "html_ratio_max": round(max(ratios), 4)}))


def _ids(counter: counting.Counter, doc: documents.Document) -> list[int]:
    """The framed ids, even for a document longer than the model's positions (only the ids are compared)."""
    from kvcli.engine.prompt import framing as fr

    return fr.document_ids(counter.tokenizer, counter.framing, doc.text)


if __name__ == "__main__":
    main()
