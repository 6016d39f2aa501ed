"""The only place that writes to the terminal: answers and JSON to stdout, everything else to stderr.

Progress bars show only when stderr is a terminal; --quiet silences all but errors.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console

from .errors import KvcliError


class Output:
    def __init__(self, *, quiet: bool = False, json_mode: bool = False):
        self.quiet = quiet
        self.json_mode = json_mode
        self.err = Console(stderr=True, highlight=False, soft_wrap=True)
        self.interactive = self.err.is_terminal and not quiet

    # ---- stdout: data only
    def write(self, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    def json_line(self, obj: Any) -> None:
        self.write(json.dumps(obj, ensure_ascii=False) + "\n")

    def json_doc(self, obj: Any) -> None:
        self.write(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")

    def table(self, table: Any) -> None:
        Console(soft_wrap=True).print(table)

    # ---- stderr: everything for people
    def note(self, message: str) -> None:
        if not self.quiet:
            self.err.print(message, markup=False)

    def warn(self, message: str) -> None:
        if not self.quiet:
            self.err.print(f"kvcli: warning: {message}", style="yellow", markup=False)

    def error(self, err: KvcliError | str, hint: str | None = None) -> None:
        self.err.print(f"kvcli: error: {err}", style="bold red", markup=False)
        if hint:
            self.err.print(f"hint: {hint}", style="dim", markup=False)

    @contextmanager
    def progress(self, label: str, unit: str = "tokens", overall: tuple[int, int] | None = None) -> Iterator:
        """Yield update(done, total): a bar with rate on a terminal, silent otherwise.

        overall=(n, N) adds a second bar for the n-th of N items (e.g. documents in one run).
        """
        if not self.interactive:
            yield lambda done, total: None
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn  # only on a terminal: spares every client start

        start = time.perf_counter()
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
            console=self.err,
            transient=True,
        ) as bar:
            if overall:
                bar.add_task("documents", total=overall[1], completed=overall[0] - 1, rate="")
            task = bar.add_task(label, total=None, rate="")

            def update(done: int, total: int) -> None:
                rate = done / max(time.perf_counter() - start, 1e-9)
                bar.update(task, completed=done, total=total, rate=f"{rate:,.0f} {unit}/s")

            yield update

    @contextmanager
    def status(self, message: str) -> Iterator[None]:
        if not self.interactive:
            yield
            return
        with self.err.status(message):
            yield


def debug_enabled() -> bool:
    return os.environ.get("KVCLI_DEBUG", "").lower() not in ("", "0", "false", "no")


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"
