"""Restore speed and TTFT of each storage format (not collected by pytest): the timing columns of
docs/quantization.md ("Smaller caches"), without the agreement run (which is deterministic and slow: tests/bench/bench_quant.py).

    python tests/bench/bench_restore_formats.py

Default model, the sample document cut to 4,096 tokens, float32: lossless, 8-bit and 4-bit caches are
prefilled, then each is restored RESTORE_REPEATS times (median) and asked TTFT_QUESTIONS questions with a
fresh Session each (median TTFT, restore included). Prints one JSON line per format.
"""

import json
import tempfile
from pathlib import Path

from kvcli import bench, documents
from kvcli.bench import formats as bf
from kvcli.engine.prompt import framing as fr
from kvcli.engine.model import models
from kvcli.engine import prefilling as pf

S = Path(__file__).resolve().parents[2] / "samples"
qs = [line.strip() for line in (S/'questions.txt').read_text().splitlines() if line.strip() and not line.startswith('#')]
lm = models.load()
frame = fr.choose(lm.tokenizer, "auto", None)
doc = bench.document_of(lm, frame, documents.read(S/'document.txt'), 4096)
out = {}
with tempfile.TemporaryDirectory() as tmp:
    for bits in (None, 8, 4):
        p = Path(tmp)/f"d{bits}.kv"
        r = pf.prefill(lm, doc, p, kv_bits=bits)
        m = r.manifest
        rs = bf._restore_s(lm, p)
        tt = bf._ttft_s(lm, p, qs)
        out[str(bits or 'lossless')] = {"tokens": m.num_tokens, "bytes_raw": m.bytes_raw, "on_disk": m.bytes_stored,
            "ratio": round(m.bytes_stored/m.bytes_raw, 3), "restore_s": round(rs, 3), "gb_per_s": round(m.bytes_raw/rs/1e9, 2),
            "ttft_s": round(tt, 3)}
        print(json.dumps({str(bits): out[str(bits or 'lossless')]}), flush=True)
