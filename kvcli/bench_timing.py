"""How kvcli bench times restores and TTFT, in one place: bench.py and bench_formats.py both import it, and
bench.py imports bench_formats.py, never the other way (no import circle)."""

RESTORE_REPEATS = 3  # restores timed per cache (the median is reported)
TTFT_QUESTIONS = 5  # TTFT (with and without the cache) is timed on the first questions; agreement uses all
