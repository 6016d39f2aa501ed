"""kvcli ls, rm and prune: the caches in a folder, listed and removed (library: format.catalog, format.housekeeping)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import UsageError
from .output import Output, human_bytes
from .app import command
from .common import human_age
from .options import JsonOpt, QuietOpt


@command
def ls(
    folder: Annotated[str, typer.Argument(metavar="DIR", help="Folder or URL prefix to list (default: the current one).", show_default=False)] = ".",
    json_out: JsonOpt = False,
) -> int:
    """List the caches in a folder: document, tokens, model, size, ratio and age."""
    from rich.table import Table
    from rich.text import Text

    from ..format import catalog

    from ..remote import is_url

    out = Output()
    if is_url(folder):
        from ..remote import objects

        rows = objects.list_caches(folder)
        folder = objects.redact(folder)
    elif not Path(folder).is_dir():
        raise UsageError(f"{folder}: not a folder")
    else:
        rows = catalog.find(Path(folder))
    if not rows:
        out.note(f"{folder}: no kvcli cache here")
    if json_out:
        out.json_doc(rows)
        return 0
    if not rows:
        return 0
    table = Table("cache", "document", "tokens", "model", "storage", "on disk", "ratio", "age", title=Text(str(folder)))
    for r in rows:
        if "error" in r:
            table.add_row(Text(Path(r["path"]).name), "-", "-", Text(r["error"], style="red"), "-", "-", "-", "-")
            continue
        doc = str(r["document"].get("name")) + (f" (after {Path(r['base']['path']).name})" if r.get("base") else "")
        table.add_row(Text(Path(r["path"]).name), Text(doc), f"{r['num_tokens']:,}", Text(str(r["model"])),
                      r.get("storage", "-"),
                      human_bytes(r["bytes_on_disk"]), f"{r['ratio']:.1%}", human_age(r["age_s"]))
    out.table(table)
    return 0


@command
def rm(
    caches: Annotated[list[Path], typer.Argument(metavar="CACHE", help="Cache directories to remove.")],
    force: Annotated[bool, typer.Option("--force", help="Also remove a cache that another one beside it extends (that one then fails to open), and a cache whose manifest is damaged.")] = False,
    quiet: QuietOpt = False,
) -> int:
    """Remove kvcli caches. Anything that is not a kvcli cache, or a cache that another one extends, is refused,
    and then nothing is removed; a cache whose manifest is damaged is kept and reported (--force removes it)."""
    from ..format import housekeeping as hk

    out = Output(quiet=quiet)
    caches = hk.distinct(caches)  # one path given twice is removed once
    damaged = hk.check_removable(caches, force=force)
    for path in caches:
        if path in damaged:
            out.error(f"{path}: a damaged cache ({damaged[path]}); not removed",
                      f"'kvcli rm --force {path}' removes it too")
            continue
        r = hk.remove_cache(path, damaged=force)
        out.note(f"removed {r.path} ({human_bytes(r.bytes)})")
    return 1 if damaged else 0


@command
def prune(
    folder: Annotated[Path, typer.Argument(metavar="DIR", help="Folder to clean (default: the current one).", show_default=False)] = Path("."),
    older_than: Annotated[Optional[str], typer.Option(metavar="AGE", help="Also remove caches older than AGE (30d, 12h, 90m, 2w).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", "-n", help="List what would be removed; remove nothing.")] = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> int:
    """Remove leftovers of interrupted prefills (.kvtmp folders) and, with --older-than, old caches.

    Prints each removed path on stdout (what would be removed, with --dry-run).
    """
    from .. import units
    from ..format import housekeeping as hk

    out = Output(quiet=quiet)
    age = units.parse_duration(older_than, "--older-than", bare=False) if older_than is not None else None
    removed = hk.prune(folder, older_than_s=age, dry_run=dry_run)
    for r in removed:
        out.json_line({"path": str(r.path), "kind": r.kind, "bytes": r.bytes, "dry_run": dry_run}) if json_out else out.write(f"{r.path}\n")
    caches = sum(r.kind == "cache" for r in removed)
    verb = "would remove" if dry_run else "removed"
    out.note(f"{folder}: {verb} {caches} cache{'s' * (caches != 1)} and {len(removed) - caches} leftover{'s' * (len(removed) - caches != 1)} "
             f"({human_bytes(sum(r.bytes for r in removed))})")
    return 0
