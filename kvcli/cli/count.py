"""kvcli count: tokens, cache size and room left from the tokenizer and config only (library: engine.counting)."""

from __future__ import annotations

from typing import Annotated

import typer

from ..errors import UsageError
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
    trust_remote_code: TrustOpt = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> int:
    """Tokens, cache size and room left for each document, from the tokenizer and config only (no model run)."""
    from rich.table import Table
    from rich.text import Text

    from .. import documents

    out = Output(quiet=quiet)
    documents.check_encoding(encoding)
    if docs.count("-") > 1:
        raise UsageError("stdin ('-') can be read only once")
    texts = [documents.read(d, encoding) for d in docs]  # every document first: a bad one fails before the tokenizer loads
    from ..engine import counting

    with out.status("loading tokenizer"):
        counter = counting.Counter(model, revision=revision, dtype=dtype, framing=framing, system=system, trust_remote_code=trust_remote_code)
    counts = [counter.count(t) for t in texts]
    if json_out:
        for c in counts:
            out.json_line(c.to_json())
    else:
        table = Table("document", "tokens", "cache raw", "on disk (est.)", "room left", "prefill (est.)")
        for c in counts:
            room = "-" if c.room is None else (f"{c.room:,}" if c.fits else Text(f"{c.room:,} (too long)", style="red"))
            shape = documents.describe({"format": c.format, "pages": c.pages, "sections": c.sections})
            table.add_row(Text(c.document + (f" ({shape})" if shape else "")), f"{c.tokens:,}", human_bytes(c.bytes_raw), human_bytes(c.bytes_on_disk_estimate),
                          room, _seconds(c.prefill_s_estimate, c.prefill_s_error))
        out.table(table)
    limit = f"{counter.max_positions:,} positions" if counter.max_positions else "no position limit"
    withheld = next((c.prefill_s_reason for c in counts if c.prefill_s_reason), None)
    times = (f"prefill time: no estimate yet ({withheld})" if withheld else
             f"prefill time from {counts[0].prefill_s_basis}" if counts else "")
    out.note(f"{counter.dtype}, {limit}; read {counter.loaded}; estimates: on-disk size from measured ratios, {times}")
    if counter.dtype_advice:
        out.note(counter.dtype_advice)
    too_long = [c.document for c in counts if not c.fits]
    if too_long:
        out.error(f"{', '.join(too_long)}: too long for the model (prefill would refuse it)")
        return 1
    return 0


def _seconds(seconds, error) -> str:
    if seconds is None:
        return "no estimate yet"
    shown = f"~{seconds:,.1f} s" if seconds < 10 else f"~{seconds:,.0f} s"
    return shown + (f" ±{error:.0%}" if error is not None else "")
