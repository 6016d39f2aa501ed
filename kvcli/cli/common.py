"""Helpers more than one command uses: cache paths as shown and opened, questions and earlier answers read, ages."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from ..errors import UsageError
from ..remote import shown  # noqa: F401  (the commands' name for it)
from .output import Output


def local_cache(path: str, out: Output, check=None) -> Path:
    """A cache folder to open: the path itself, or the checked local copy of a remote cache.
    check(manifest): the fit test a remote cache passes on its manifest alone, before any shard is fetched."""
    from ..remote import is_url

    if not is_url(path):
        return Path(path)
    from ..remote import local_store

    with out.status(f"fetching {shown(path)}"):
        return local_store.fetch(path, progress=out.note, check=check)


def cache_formats(out: Output, caches: list[str]) -> list[str | None]:
    """Each local cache's document format (None for a URL or a cache that will fail to open, which opening reports);
    the opened session warns when the document beside a cache has changed since."""
    from ..format import store
    from ..remote import is_url
    from ..errors import KvcliError

    formats: list[str | None] = []
    for cache in caches:
        try:
            m = None if is_url(cache) else store.read_manifest(cache, chain=False)
        except KvcliError:
            m = None
        formats.append(None if m is None else m.document.get("format", "text"))
    return formats


def local_opener(out: Output, pool):
    """The in-process opener of events.ask_events: each cache fetched if remote (checked against the model it
    would be answered with before any shard is fetched), then opened through the pool (engine.answer.ModelPool)."""
    from contextlib import contextmanager
    from dataclasses import replace

    @contextmanager
    def open_session(spec):
        fetched = tuple(str(local_cache(p, out, check=lambda m, p=p: pool.fits(m, shown(p), convert_dtype=spec.convert_dtype)))
                        for p in spec.caches)
        with out.status(f"blending {len(fetched)} caches" if spec.blend else f"loading {spec.caches[0]}"):
            session = pool.session(replace(spec, caches=fetched), where=None if spec.blend else shown(spec.caches[0]))
        try:
            yield session
        finally:
            if hasattr(session, "close"):  # a sectioned cache, held open for its sections
                session.close()

    return open_session


def read_answer_json(path: Path):
    """The last JSON line of an `ask --json` output file (or stdin for '-')."""
    import json

    try:
        text = sys.stdin.read() if str(path) == "-" else path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path}: cannot read ({exc})") from None
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise UsageError(f"{path}: empty (expected `kvcli ask --json` output)")
    try:
        return json.loads(lines[-1])
    except ValueError:
        raise UsageError(f"{path}: the last line is not JSON (expected `kvcli ask --json` output)") from None


def gather_questions(args: list[str], questions_file: Optional[str]) -> list[str]:
    for n, q in enumerate(args, 1):
        if not q.strip():
            raise UsageError(f"question {n} is empty" if len(args) > 1 else "the question is empty")
    qs = list(args)
    if questions_file is not None:
        try:
            text = sys.stdin.read() if questions_file == "-" else Path(questions_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"{questions_file}: cannot read questions ({exc})") from None
        qs += [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    elif not qs and not sys.stdin.isatty():
        text = sys.stdin.read().strip()
        if text:
            qs.append(text)
    if not qs:
        raise UsageError("no question given (arguments, -f FILE, or text on stdin)")
    return qs


def human_age(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"
