"""kvcli bench: what the cache buys, measured in one process and one run (the command: cli/bench.py).

measure.py times every length (prefill, restore, TTFT, exactness, memory), decode.py the decode speeds,
formats.py the quantized formats against the lossless cache, dtypes.py compares runs in several dtypes,
table.py renders the result."""

from .decode import BATCH_QUESTIONS
from .dtypes import compare, verdicts
from .measure import QUESTIONS, TO_THE_LIMIT, default_sizes, document_of, limit_sizes, run
from .table import render

__all__ = ["BATCH_QUESTIONS", "QUESTIONS", "TO_THE_LIMIT", "compare", "default_sizes", "document_of", "limit_sizes", "render", "run", "verdicts"]
