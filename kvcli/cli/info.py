"""kvcli info and verify: a cache's manifest, and its shards checked against it (no model, no torch)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.text import Text  # loaded with rich.console (output.py) anyway

from ..errors import KvcliError
from .output import Output, human_bytes
from .app import command
from .common import shown
from .options import JsonOpt, QuietOpt


@command
def info(
    cache: Annotated[str, typer.Argument(metavar="CACHE", help="Cache directory or URL.")],
    layers: Annotated[bool, typer.Option("--layers", help="Also a table of every layer: kind, window, tokens, sizes.")] = False,
    json_out: JsonOpt = False,
) -> int:
    """Show a cache's manifest: model, document, tokens, layers and sizes.

    Reads the manifest alone: no shard is opened, so a missing or damaged shard goes unseen (kvcli verify checks them).
    """
    from ..format import catalog, store
    from ..remote import is_url

    out = Output()
    if is_url(cache):
        from ..remote import objects

        m = objects.read_manifest(cache)  # the manifest only: nothing else is downloaded
        s, links = catalog.summary(objects.redact(cache), m), []
    else:
        with store.open_cache(cache, shards=False) as opened:  # the chain's manifests, checked link by link
            m, links = opened.manifest, catalog.chain_rows(opened)
        s = catalog.summary(Path(cache), m)
    if json_out:
        out.json_doc({**s, "chain": links, "layers": catalog.layer_rows(m)})
        return 0
    from rich.table import Table

    out.table(_head(m, s, links, layers))
    if s["sections"] is not None:  # the head's layers hold only the prompt's head: the sections say more
        table = Table("section", "lines", "pages", "tokens", "stored", "headings")
        for row in s["sections"]:
            table.add_row(str(row["section"]), f"{row['start_line']}-{row['end_line']}", ", ".join(map(str, row.get("pages", []))) or "-",
                          f"{row['tokens']:,}", human_bytes(row["bytes_on_disk"]), Text(" / ".join(row["headings"]) or "-"))
        out.table(table)
    if layers:
        table = Table("layer", "kind", "window", "cached", "raw", "stored", "ratio")
        for row in catalog.layer_rows(m):
            table.add_row(str(row["index"]), row["kind"], str(row["sliding_window"] or "-"), f"{row['cached_length']:,}",
                          human_bytes(row["raw_bytes"]), human_bytes(row["stored_bytes"]), f"{row['ratio']:.1%}")
        out.table(table)
    return 0


def _head(m, s: dict, links: list, layers: bool):
    """The cache at a glance: one row per fact, the layers' kinds last."""
    from rich.table import Table

    from ..documents import describe
    from ..format import catalog

    head = Table.grid(padding=(0, 2))
    for key in ("path", "model", "model_type", "num_tokens", "dtype", "num_layers", "created"):
        head.add_row(key, Text(f"{s[key]:,}" if isinstance(s[key], int) else str(s[key])))
    shape = describe(m.document)
    head.add_row("document", Text(f"{m.document.get('name')} ({m.document.get('chars'):,} chars" + (f"; {shape})" if shape else ")")))
    if m.document.get("converter"):
        head.add_row("converted by", Text(str(m.document["converter"])))
    head.add_row("framing", Text(f"{m.framing.get('kind')}" + (f", system: {m.framing['system']!r}" if m.framing.get("system") else "")))
    head.add_row("size", f"{human_bytes(s['bytes_on_disk'])} on disk, {human_bytes(s['bytes_raw'])} raw ({s['ratio']:.1%})")
    prov = s["provenance"]
    head.add_row("built with", Text(f"torch {prov.get('torch_version')}, {prov.get('device_type')}, attention "
                                    f"{prov.get('attn_implementation')}, transformers {s['transformers_version']}" if prov
                                    else f"transformers {s['transformers_version']} (torch, device, attention not recorded)"))
    head.add_row("weights", Text(catalog.describe_weights(m)))
    head.add_row("storage", Text(catalog.describe_storage(m)))
    head.add_row("format", Text(f"{s['format_version']}, shards checked with {s['shard_hash']}"))
    if m.sections is not None:
        head.add_row("sections", Text(f"{len(m.sections.parts)} (a document longer than the window of {m.sections.window:,} "
                                      "positions: each question uses the sections it needs)"))
    if len(links) > 1:
        head.add_row("chain", Text(" -> ".join(f"{row['path']} ({row['own_tokens']:,} tokens)" for row in links)))
    rows = catalog.layer_rows(m)
    kinds = {}
    for row in rows:
        kind = row["kind"] + (f" (window {row['sliding_window']:,})" if row["sliding_window"] else "")
        kinds[kind] = kinds.get(kind, 0) + 1
    ratios = [row["ratio"] for row in rows]
    head.add_row("layers", Text(", ".join(f"{n} {kind}" for kind, n in kinds.items())
                                + (f"; stored {min(ratios):.1%}-{max(ratios):.1%} of raw" if ratios else "")
                                + ("" if layers else " (--layers: each layer)")))
    return head


@command
def verify(
    caches: Annotated[list[str], typer.Argument(metavar="CACHE", help="Cache directories or URLs.")],
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> int:
    """Check every shard of each cache against its manifest (no model needed). Exit 3 if any is bad.

    Each cache that checks out is printed on stdout; each bad one is an error on stderr.
    """
    out = Output(quiet=quiet)
    worst = 0
    for path in caches:
        try:
            m = _verify(path)
        except KvcliError as exc:
            worst = max(worst, exc.exit_code)
            out.json_line({"cache": shown(path), "ok": False, "error": str(exc)}) if json_out else out.error(exc)
            continue
        if json_out:
            out.json_line({"cache": shown(path), "ok": True, "num_tokens": m.document_tokens, "num_layers": len(m.layers),
                           "storage": m.storage, **({"sections": len(m.sections.parts)} if m.sections else {})})
        else:
            parts = f", {len(m.sections.parts)} sections" if m.sections else ""
            out.write(f"{shown(path)}: ok ({len(m.layers)} layers, {m.document_tokens:,} tokens{parts}, {m.storage})\n")
    return worst


def _verify(path: str):
    """A local cache, or a remote one as it is in its store (never the local copy ask uses)."""
    from ..format import parts
    from ..remote import is_url

    if not is_url(path):
        return parts.verify(path)  # a sectioned cache's sections too
    from ..remote import objects

    return objects.verify(path)
