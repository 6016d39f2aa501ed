"""kvcli count: tokens, cache size and room left from the tokenizer and config only (library: engine.counting)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.text import Text  # loaded with rich.console (output.py) anyway

from ..errors import DocumentError, UsageError
from .output import Output, human_bytes
from .app import command
from .options import DtypeOpt, EncodingOpt, FramingOpt, JsonOpt, ModelOpt, QuietOpt, RevisionOpt, SystemOpt, TrustOpt


@command
def count(
    docs: Annotated[list[str], typer.Argument(metavar="DOC", help="Document files: text, PDF, HTML, DOCX or EPUB ('-' reads stdin).", show_default=False)],
    model: ModelOpt = None,
    revision: RevisionOpt = None,
    system: SystemOpt = None,
    framing: FramingOpt = "auto",
    dtype: DtypeOpt = "auto",
    encoding: EncodingOpt = "utf-8",
    window: Annotated[Optional[int], typer.Option("--window", min=64, metavar="N", help="Positions a question's prompt may use (default: the model's), as prefill --window: a longer document is counted as the sectioned cache prefill makes of it.", show_default=False)] = None,
    trust_remote_code: TrustOpt = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> int:
    """Tokens, cache size and room left for each document, from the tokenizer and config only (no model run)."""
    from .. import documents

    out = Output(quiet=quiet)
    documents.check_encoding(encoding)
    if docs.count("-") > 1:
        raise UsageError("stdin ('-') can be read only once")
    read, failed = [], []  # every document first: a bad one is reported, the good ones still counted
    for d in docs:
        try:
            read.append(documents.read(d, encoding))
        except DocumentError as exc:
            failed.append((d, exc))
    counts, counter = [], None
    if read:
        from ..engine import counting

        with out.status("loading tokenizer"):
            counter = counting.Counter(model, revision=revision, dtype=dtype, framing=framing, system=system, trust_remote_code=trust_remote_code,
                                       window=window)
        counts = [counter.count(t) for t in read]
    errors = {d: str(exc) for d, exc in failed}
    if json_out:
        for c in counts:
            out.json_line(c.to_json())
        for d, message in errors.items():
            out.json_line({"document": d, "error": message})
    elif counts:
        out.table(_table(counts, errors))
    return _notes(out, counter, counts, errors, failed=len(failed), given=len(docs))


def _table(counts: list, unreadable: dict[str, str]):
    from rich.table import Table

    from .. import documents

    table = Table("document", "tokens", "cache raw", "on disk (est.)", "room left", "prefill (est.)")
    for c in counts:
        room = "-" if c.room is None else (f"{c.room:,}" if c.fits else Text(f"{c.sectioned:,} sections", style="yellow")
                                          if c.sectioned else Text(f"{c.room:,} (too long)", style="red"))
        shape = documents.describe({"format": c.format, "pages": c.pages, "sections": c.sections})
        table.add_row(Text(c.document + (f" ({shape})" if shape else "")), f"{c.tokens:,}", human_bytes(c.bytes_raw), human_bytes(c.bytes_on_disk_estimate),
                      room, _seconds(c))
    for d in unreadable:
        table.add_row(Text(d), Text("unreadable", style="red"), "-", "-", "-", "-")
    return table


def _notes(out: Output, counter, counts: list, errors: dict[str, str], *, failed: int, given: int) -> int:
    """Notes and errors after the counts (stderr); the exit code: 1 if a document is unreadable or too long."""
    if counter is not None:
        limit = f"{counter.max_positions:,} positions" if counter.max_positions else "no position limit"
        if counter.window and counter.window != counter.max_positions:
            limit += f", a window of {counter.window:,}"
        withheld = next((c.prefill_s_reason for c in counts if c.prefill_s_reason and (c.fits or c.sectioned)), None)
        times = (f"prefill time: no estimate yet ({withheld})" if withheld else
                 f"prefill time from {counts[0].prefill_s_basis}, its range from how far that estimate missed each of them")
        out.note(f"{counter.dtype}, {limit}; read {counter.loaded}; estimates: on-disk size from measured ratios, {times}")
        if counter.dtype_advice:
            out.note(counter.dtype_advice)
    for message in errors.values():
        out.error(message)
    for c in counts:
        if c.sectioned:
            out.note(f"{c.document}: longer than the window of {c.window:,} positions: prefill makes a sectioned cache of "
                     f"{c.sectioned:,} sections, and each question uses the sections that fit the window (docs/documents.md)")
    too_long = [c.document for c in counts if not c.fits and not c.sectioned]
    if too_long:
        out.error(f"{', '.join(too_long)}: too long for the model (prefill would refuse it)",
                  "count a shorter part, or pick a --model with more positions")
    if failed and given > 1:
        out.error(f"{failed} of {given} documents could not be read; the others are counted above")
    return 1 if failed or too_long else 0


def _seconds(c) -> str:
    """The estimate and, from 3 records on, the range its records' own misses give: `~12 s (11-14 s)`."""
    if c.prefill_s_estimate is None:
        return "-" if not (c.fits or c.sectioned) else "no estimate yet"
    digits = 1 if c.prefill_s_estimate < 10 else 0
    shown = f"~{c.prefill_s_estimate:,.{digits}f} s"
    if c.prefill_s_range is None:
        return shown
    low, high = (f"{v:,.{1 if c.prefill_s_range[1] < 10 else 0}f}" for v in c.prefill_s_range)
    return shown if low == high else f"{shown} ({low}-{high} s)"
