"""The kvcli command line: parse, call the library, render. Heavy modules load inside commands.

One module per command or group (prefill, ask, chat, info/verify, ls/rm/prune, count, bench, serve/ps);
app.py holds the root app and maps errors to exit codes in one place; options.py spells shared options once.

Exit codes: 0 success; 1 other failure; 2 usage error; 3 cache missing, corrupt, of an unknown
format version, or not matching the model (rebuild it); 4 `ask --check` found an answer that differs
from a full recompute (answers still printed); 130 interrupted; 141 stdout closed early.
"""

from __future__ import annotations

import gc

from .app import app

# importing a command module registers its commands, in this order in --help
from . import prefill, ask, chat, info, housekeeping, count, bench, serve  # noqa: E402, F401  isort: skip

__all__ = ["app", "main"]


def main() -> None:
    try:
        app(prog_name="kvcli")
    finally:
        # At exit the interpreter's collector walks every object torch and transformers made (over a second
        # after an answer on 2 cores, docs/performance.md); frozen, it skips them and the OS takes the memory back.
        gc.freeze()
