"""The only place that writes to the terminal: answers and JSON to stdout, everything else to stderr.

Progress bars, answer headings and timing summaries show only on a terminal; --quiet silences all but
errors. A closed stdout (a reader such as `head` quit) raises BrokenPipeError out of every write, so the
command stops and cli/app.py ends it quietly with EXIT_PIPE.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console

from ..errors import KvcliError

WAIT_S = 2.0  # a question still without its first text after this long gets a spinner on a terminal's stderr
EXIT_PIPE = 141  # stdout closed early: what a shell reports for a process ended by SIGPIPE (128 + 13)


def is_terminal(stream: Any) -> bool:
    """Whether a stream is an interactive terminal (one place, so tests can pretend)."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def is_broken_pipe(exc: BaseException) -> bool:
    return isinstance(exc, BrokenPipeError) or (isinstance(exc, OSError) and exc.errno == errno.EPIPE)


def stdout_gone() -> None:
    """Point stdout at /dev/null after its reader left, so the interpreter's exit-time flush stays quiet."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # not a real file (a test runner's buffer)
        pass


class _StdoutConsole(Console):
    """rich exits the process on a broken pipe; raise instead, so the command wrapper ends it in one place."""

    def on_broken_pipe(self) -> None:
        raise BrokenPipeError(errno.EPIPE, "stdout closed")


class Output:
    def __init__(self, *, quiet: bool = False):
        self.quiet = quiet
        self.err = Console(stderr=True, highlight=False, soft_wrap=True)
        self.interactive = is_terminal(sys.stderr) and not quiet
        self.stdout_terminal = is_terminal(sys.stdout)

    # ---- stdout: data only
    def write(self, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    def check_stdout(self) -> None:
        """Raise BrokenPipeError when stdout is a pipe whose reader has gone (POLLERR), so no work is done for nobody."""
        import select

        try:
            fd = sys.stdout.fileno()
        except (AttributeError, ValueError, OSError):  # not a real file (a test runner's buffer)
            return
        if not hasattr(select, "poll"):
            return
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        if any(events & select.POLLERR for _, events in poller.poll(0)):
            raise BrokenPipeError(errno.EPIPE, "stdout closed")

    def heading(self, text: str) -> None:
        """A line naming what the next answer belongs to: only when stdout is a terminal (a pipe gets answers only)."""
        if self.stdout_terminal:
            _StdoutConsole(soft_wrap=True, highlight=False).print(text, style="bold cyan", markup=False)

    def json_line(self, obj: Any) -> None:
        self.write(json.dumps(obj, ensure_ascii=False) + "\n")

    def json_doc(self, obj: Any) -> None:
        self.write(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")

    def table(self, table: Any) -> None:
        """A rich table on a terminal; on a pipe or file every value in full, never cut: a `# TITLE` line,
        then a header line and one line per row, fields separated by tabs (--json stays the machine format)."""
        if self.stdout_terminal:
            _StdoutConsole(soft_wrap=True).print(table)
        else:
            self.write("".join(line + "\n" for line in tab_separated(table)))

    def read_line(self, prompt: str) -> str | None:
        """One line from stdin, None at its end; the prompt goes to stderr, and only on a terminal."""
        if sys.stdin.isatty() and not self.quiet:
            self.err.print(prompt, end="", markup=False)
        line = sys.stdin.readline()
        return None if line == "" else line.rstrip("\n")

    # ---- stderr: everything for people
    def note(self, message: str) -> None:
        if not self.quiet:
            self.err.print(message, markup=False)

    def waiting(self, message: str, after: float | None = None) -> "Waiting":
        """A spinner on stderr that shows only if the work takes longer than `after` seconds and only on a
        terminal (never in logs or pipes); stop() it when the first result arrives."""
        return Waiting(self, message, WAIT_S if after is None else after)

    def summary(self, message: str) -> None:
        """A short line for people watching a terminal (timings): never in logs or pipes."""
        if self.interactive:
            self.err.print(message, style="dim", markup=False)

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
            task = bar.add_task(label, total=None, rate="", visible=False)  # hidden until its total is known: never "0/?"

            def update(done: int, total: int) -> None:
                rate = done / max(time.perf_counter() - start, 1e-9)
                bar.update(task, completed=done, total=total, rate=f"{rate:,.0f} {unit}/s" if done else "", visible=True)

            yield update

    @contextmanager
    def status(self, message: str) -> Iterator[None]:
        if not self.interactive:
            yield
            return
        with self.err.status(message):
            yield


def _plain(cell: Any) -> str:
    text = cell.plain if hasattr(cell, "plain") else str(cell)
    return " ".join(text.replace("\t", " ").splitlines())


def tab_separated(table: Any) -> list[str]:
    """The lines of a rich Table (or Text) as plain tab-separated text, every value whole."""
    if not hasattr(table, "columns"):
        return [_plain(table)]
    lines = [f"# {_plain(table.title)}"] if table.title else []
    if table.show_header:
        lines.append("\t".join(_plain(c.header) for c in table.columns))
    cells = [list(c.cells) for c in table.columns]
    for row in zip(*cells):
        lines.append("\t".join(_plain(v) for v in row))
    return lines


class Waiting:
    """A delayed spinner (Output.waiting): a timer starts rich's status after `after` seconds; stop() ends either."""

    def __init__(self, out: Output, message: str, after: float):
        import threading

        self._lock = threading.Lock()
        self._status = None
        self._stopped = False
        self._message = message
        self._out = out
        self._timer = None
        if out.interactive:
            import rich.progress  # noqa: F401  (now, not in the timer: only on a terminal)

            self._timer = threading.Timer(after, self._show)
            self._timer.daemon = True
            self._timer.start()

    @property
    def shown(self) -> bool:
        return self._status is not None

    def _show(self) -> None:
        with self._lock:
            if self._stopped:
                return
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn  # only on a terminal

            self._status = Progress(SpinnerColumn(), TextColumn(self._message), TimeElapsedColumn(), console=self._out.err, transient=True)
            self._status.add_task(self._message, total=None)
            self._status.start()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            if self._timer is not None:
                self._timer.cancel()
            if self._status is not None:
                self._status.stop()


def debug_enabled() -> bool:
    return os.environ.get("KVCLI_DEBUG", "").lower() not in ("", "0", "false", "no")


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"
