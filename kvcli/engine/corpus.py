"""Corpus prefill: a list of documents, this process's share of it, one result per document.

Built for batch schedulers (Slurm job arrays, Kubernetes Indexed Jobs): every process reads the
same list and takes a deterministic share, a cache that is already up to date is skipped after
reading its manifest only, and a failed document is reported and never stops the others. Where a
cache goes (a local folder, an object store) is a `Target` handed in by the caller, so this module
knows nothing of fsspec.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Protocol, TypeVar

from ..documents import Document
from ..errors import CacheError, CacheExistsError, KvcliError, UsageError
from ..format import chain, manifest as mf, store, writing
from .prompt import framing as fr
from . import prefilling as pf
from .model.models import LoadedModel

T = TypeVar("T")
COUNT_VARIABLE = "KVCLI_SHARD_COUNT"  # Kubernetes sets JOB_COMPLETION_INDEX but not the count: set this to `completions`


class Target(Protocol):
    """Where one document's cache lives: read its current manifest, write a new cache there."""

    name: str

    def current(self) -> mf.Manifest | None:
        """The manifest of the cache there now (shards present, not read), or None if none or broken; a cache
        another process is writing is waited for."""

    def write(self, lm: LoadedModel, document: Document, *, force: bool, **options: Any) -> pf.PrefillResult:
        """Prefill the document and install the cache (replacing one only with force)."""


@dataclass(frozen=True)
class LocalTarget:
    """A cache directory on this machine, written atomically by prefilling.prefill."""

    path: Path

    @property
    def name(self) -> str:
        return str(self.path)

    def current(self) -> mf.Manifest | None:
        writing.wait_for_writer(self.path)  # another process writing it now: what it wrote, once done
        try:
            return store.read_manifest(self.path, shards=True)  # a cache missing a shard is rebuilt
        except CacheError:
            return None

    def write(self, lm: LoadedModel, document: Document, *, force: bool, **options: Any) -> pf.PrefillResult:
        from .sections import build  # a document longer than the window: a sectioned cache

        return build.prefill(lm, document, self.path, force=force, **options)


@dataclass(frozen=True)
class Job:
    document: str  # path or URL as listed
    target: Target
    error: str | None = None  # set when the job cannot run (e.g. two documents name the same cache)
    after: str | None = None  # the cache this document's extends (a list line `DOC --after CACHE`)


@dataclass
class DocResult:
    """One document's outcome: the one record every prefill reports (`--json`, in-process or served, one document,
    several or a list). bytes_* and storage are the cache's (built or skipped); compute_s and write_s are 0
    unless built; seconds is the document's whole time (reading, checks, waits included)."""

    document: str
    cache: str
    status: str  # "built", "extended", "skipped" or "failed"
    num_tokens: int | None = None
    compute_s: float = 0.0
    write_s: float = 0.0
    bytes_raw: int | None = None
    bytes_on_disk: int | None = None
    storage: str | None = None
    seconds: float = 0.0
    error: str | None = None
    computed_tokens: int | None = None  # tokens run through the model (fewer when it extends a cache)
    extended_from: int | None = None  # "extended": the tokens of the cache of the shorter document it replaced
    base: str | None = None  # the cache it extends (prefill --after), as given
    format: str | None = None  # the document's format ("text", "pdf", "html", "docx", "epub"); None if it was not read
    sections: int | None = None  # a document longer than the window: the sections its cache holds
    index: int = field(default=0, compare=False)  # the job's place in the run (not in the record)
    exc: BaseException | None = field(default=None, compare=False, repr=False)  # a failure, for a caller that raises it

    def to_json(self, served: bool = False) -> dict[str, Any]:
        return {"document": self.document, "cache": self.cache, "status": self.status, "num_tokens": self.num_tokens,
                "compute_s": round(self.compute_s, 4), "write_s": round(self.write_s, 4), "bytes_raw": self.bytes_raw,
                "bytes_on_disk": self.bytes_on_disk, "storage": self.storage, "seconds": round(self.seconds, 3),
                "computed_tokens": self.computed_tokens, "extended_from": self.extended_from, "base": self.base,
                "error": self.error, "format": self.format, "sections": self.sections, "served": served}


AFTER = " --after "  # a list line `DOC --after CACHE`: the document's cache extends CACHE


def read_list(source: str) -> list[str]:
    """Document entries from a list file ('-' for stdin): one per line (`DOC` or `DOC --after CACHE`), blank and
    '#' lines skipped, repeats dropped."""
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{source}: cannot read the document list ({exc.__class__.__name__}: {exc})") from None
    entries = [line.strip() for line in text.splitlines()]
    return list(dict.fromkeys(e for e in entries if e and not e.startswith("#")))


def parse_shard(spec: str) -> tuple[int, int]:
    """'I/N' -> (I, N) with 0 <= I < N."""
    index, sep, count = spec.partition("/")
    try:
        i, n = int(index), int(count)
    except ValueError:
        i, n = -1, 0
    if not sep or n < 1 or not 0 <= i < n:
        raise UsageError(f"--shard {spec}: expected I/N with 0 <= I < N (e.g. 0/4)")
    return i, n


def shard_from_env(env: Mapping[str, str] = os.environ) -> tuple[int, int] | None:
    """The share a scheduler gives this process: a Slurm array task, or a Kubernetes Indexed Job pod.

    Slurm: index (SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN) / SLURM_ARRAY_TASK_STEP of
    SLURM_ARRAY_TASK_COUNT. Kubernetes: JOB_COMPLETION_INDEX of KVCLI_SHARD_COUNT (set it to the
    Job's `completions`). None outside a scheduler.
    """

    def number(name: str, default: int | None = None) -> int:
        raw = env.get(name)
        if raw is None and default is not None:
            return default
        try:
            return int(raw)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise UsageError(f"${name}={raw!r}: not a whole number") from None

    if "SLURM_ARRAY_TASK_ID" in env and "SLURM_ARRAY_TASK_COUNT" in env:
        step = max(1, number("SLURM_ARRAY_TASK_STEP", 1))
        i, n, where = (number("SLURM_ARRAY_TASK_ID") - number("SLURM_ARRAY_TASK_MIN", 0)) // step, number("SLURM_ARRAY_TASK_COUNT"), "Slurm array"
    elif "JOB_COMPLETION_INDEX" in env:
        if COUNT_VARIABLE not in env:
            raise UsageError(f"JOB_COMPLETION_INDEX is set but {COUNT_VARIABLE} is not: set it to the Job's completions (or pass --shard I/N)")
        i, n, where = number("JOB_COMPLETION_INDEX"), number(COUNT_VARIABLE), "Kubernetes indexed job"
    else:
        return None
    if n < 1 or not 0 <= i < n:
        raise UsageError(f"{where}: task index {i} is outside 0..{n - 1}; pass --shard I/N")
    return i, n


def share(entries: Sequence[T], index: int, count: int) -> list[T]:
    """This process's share: entries index, index + count, index + 2*count, ... of the whole list."""
    return list(entries[index::count])


def plan(entries: list[str], target_for: Callable[[str], Target]) -> list[Job]:
    """One job per entry; entries whose caches would collide get an error (decided on the whole list,
    so every process of an array agrees)."""
    jobs = []
    for entry in entries:
        document, _sep, base = (part.strip() for part in entry.partition(AFTER))
        jobs.append(Job(document, target_for(document), after=base or None))
    by_cache: dict[str, list[str]] = {}
    for job in jobs:
        by_cache.setdefault(job.target.name, []).append(job.document)
    return [
        Job(j.document, j.target, f"{j.target.name}: named by {len(by_cache[j.target.name])} documents "
                                  f"({', '.join(by_cache[j.target.name][:3])}); give them distinct file names", j.after)
        if len(by_cache[j.target.name]) > 1 else j
        for j in jobs
    ]


def up_to_date(m: mf.Manifest, lm: LoadedModel, document: Document, framing: dict[str, Any],
               kv_bits: int | None = None, after: str | None = None, where: Path | None = None) -> bool:
    """Whether a cache's manifest says it holds this document for this model and framing, stored as asked
    (lossless, or quantized to kv_bits bits), without reading a shard: what decides the cache is compared
    (document, model and tokenizer fingerprints, framing kind, system prompt, template hash, storage), not the
    framing record's own fields: a tokenizer that moves the cut (SentencePiece) records version 2 and an anchor,
    which `framing` (the record of the framing asked for, before any cut) never holds. A cache that extends another
    is up to date only if it extends `after` (its cache at `where`; the chain itself was checked as it opened)."""
    if (m.base is None) != (after is None) or (after is not None and (where is None or not _same_path(
            chain.base_path(where, m.base["path"]), Path(after)))):
        return False
    return document.same_source(m.document) and pf.same_setup(m, lm, framing, kv_bits)


def _same_path(a: Path, b: Path) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def lent(lm: LoadedModel) -> Any:
    """A model the caller loaded, lent to run() as a warm server lends its own (serve/warm.HeldModel)."""
    return SimpleNamespace(lm=lm, served=lambda: None)


class _Abort(Exception):
    """What the caller's progress callback raised (an asker gone): it ends the run, never one document."""

    def __init__(self, exc: BaseException):
        self.exc = exc


def run(
    model: LoadedModel | Callable[[], AbstractContextManager],
    jobs: Iterable[Job],
    *,
    read: Callable[[str], Document],
    system: str | None = None,
    framing: str = "auto",
    chunk_size: int | None = None,
    force: bool = False,
    incremental: bool = True,
    kv_bits: int | None = None,
    after: str | None = None,
    compression: str | None = None,
    window: int | None = None,
    fit: Callable[[], Callable[[Document], Any]] | None = None,
    upfront: bool = False,
    progress: Callable[[int, int, int], None] | None = None,
    cancelled: Callable[[], bool] | None = None,
) -> Iterator[DocResult]:
    """The one prefill driver: prefill each job's document, yielding one DocResult per document as it finishes.

    model: a LoadedModel, or open_model() -> a context lending one (`.lm`, `.served()` after each cache), entered
    only once a document needs it. incremental (lists): an up-to-date cache is skipped (manifest only), a stale or
    broken one replaced. Otherwise an existing cache is an error unless force, and local caches are locked from
    their check to the end. With force every document is rebuilt. A cache that appears while building (another
    process with an overlapping share) counts as skipped when it is up to date. Failures become results, never
    exceptions. fit: fit() -> a check from the tokenizer alone (engine.counting.fit_check) returning the ids and
    framing prefill caches, so a too-long document is refused before any load and tokenized once. upfront: every
    document is read, its target checked and its fit measured before the model loads (a refusal costs no load).
    progress(index, done, total) per chunk; cancelled(): the asker left (the engine's Cancelled is raised)."""
    jobs = list(jobs)
    options = dict(system=system, framing=framing, chunk_size=chunk_size or pf.DEFAULT_CHUNK, kv_bits=kv_bits, after=after,
                   compression=compression,
                   extend=not force, window=window)
    opener = model if callable(model) and not isinstance(model, LoadedModel) else (lambda: nullcontext(lent(model)))
    with ExitStack() as stack:
        held: list[Any] = []
        fits: list[Any] = []

        def once(made: list, make: Callable[[], Any]) -> Any:
            """made[0], made by make() the first time; its failure (no such model) ends the run, not one document."""
            if not made:
                try:
                    made.append(make())
                except BaseException as exc:
                    raise _Abort(exc) from None
            return made[0]

        def lm() -> LoadedModel:
            return once(held, lambda: stack.enter_context(opener())).lm

        def guarded(job: Job, i: int, t0: float, step: Callable[[], Any]) -> Any:
            """step(), or the document's failed result: one document's failure, foreseen or not, never stops the rest."""
            try:
                return step()
            except _Abort as stop:
                raise stop.exc from None
            except KvcliError as exc:
                failure, error = exc, str(exc)
            except Exception as exc:
                from .scheduling.requests import Cancelled, EngineClosed

                if isinstance(exc, (Cancelled, EngineClosed)):  # the asker left, the engine closed: the run ends
                    raise
                failure, error = exc, f"{job.document}: unexpected {exc.__class__.__name__}: {exc}"
            return DocResult(job.document, job.target.name, "failed", seconds=time.perf_counter() - t0, error=error, index=i, exc=failure)

        def prepare(i: int, job: Job) -> tuple[Any, ...]:
            """The job read, checked and measured: (job, i, t0, document, split), or its DocResult (skipped, failed)."""
            if job.error:
                raise UsageError(job.error)
            t0 = time.perf_counter()
            document = read(job.document)
            if not incremental:  # an existing cache only with force, or when it holds this document before it grew
                _claim(job.target, force, stack, document)
            if incremental and not force:
                current = job.target.current()
                if current is not None and up_to_date(current, lm(), document, _asked(lm(), framing, system), kv_bits,
                                                      job.after or after, getattr(job.target, "path", None)):
                    return _done(job, i, "skipped", current, t0)
            return job, i, t0, document, once(fits, fit)(document) if fit is not None else None  # fit before any weights load

        def build(job: Job, i: int, t0: float, document: Document, split: Any) -> DocResult:
            if cancelled and cancelled():
                from .scheduling.requests import Cancelled

                raise Cancelled("the asker left")

            def update(done: int, total: int) -> None:
                try:
                    progress(i, done, total)
                except BaseException as exc:
                    raise _Abort(exc) from None

            replace = force or incremental  # a list run replaces a stale or broken cache (never a folder that is no cache)
            try:
                r = job.target.write(lm(), document, force=replace, split=split, progress=update if progress else None,
                                     **{**options, "after": job.after or options["after"]})
            except CacheExistsError:
                now = job.target.current()  # written meanwhile by another process
                if incremental and now is not None and up_to_date(now, lm(), document, _asked(lm(), framing, system), kv_bits,
                                                                  job.after or after, getattr(job.target, "path", None)):
                    return _done(job, i, "skipped", now, t0)
                raise
            held[0].served()
            return _done(job, i, "built", r.manifest, t0, r, job.after or after)

        def begun(i: int, job: Job) -> Any:
            return guarded(job, i, time.perf_counter(), lambda: prepare(i, job))

        prepared = (begun(i, job) for i, job in enumerate(jobs))
        if upfront:  # every refusal before the model loads
            ready = []
            for p in prepared:
                if isinstance(p, DocResult):
                    yield p
                else:
                    ready.append(p)
            prepared = iter(ready)
        for p in prepared:
            yield p if isinstance(p, DocResult) else guarded(p[0], p[1], p[2], lambda p=p: build(*p))


def _asked(lm: LoadedModel, framing: str, system: str | None) -> dict[str, Any]:
    """The record of the framing asked for (before any cut), which up_to_date compares."""
    return fr.choose(lm.tokenizer, framing, system).record(lm.tokenizer)


def _claim(target: Target, force: bool, stack: ExitStack, document: Document) -> None:
    """A new cache may be written there: an existing one only with force, or when it holds this document's earlier,
    shorter version (prefill extends it); a local one is locked to the run's end (a second prefill is refused at once)."""
    if not force:
        current = target.current() if isinstance(target, LocalTarget) and store.is_cache(target.path) else None
        if current is not None and not pf.grew(current, document) and _edited(current, document):
            raise CacheExistsError(f"{target.name}: holds the cache of {current.document.get('name')} as it was; the document "
                                   "has changed since (not only grown at its end)",
                                   hint="--force rebuilds it from the new text, or -o another path keeps both")
        force = current is not None and pf.grew(current, document)
    if isinstance(target, LocalTarget):
        writing.check_target(target.path, force=force)
        stack.enter_context(writing.writer_lock(target.path))
    elif not force and target.current() is not None:
        raise CacheExistsError(f"{target.name}: already exists (use --force to replace it)")


def _edited(m: mf.Manifest, document: Document) -> bool:
    """Whether a cache holds an earlier version of this document: the same file name, other bytes."""
    return m.document.get("name") == document.record()["name"] and not document.same_source(m.document)


def _done(job: Job, index: int, status: str, m: mf.Manifest, t0: float, r: pf.PrefillResult | None = None,
          after: str | None = None) -> DocResult:
    """The record of a cache built (r: how) or skipped; bytes are the link's own for a cache that extends another."""
    return DocResult(job.document, job.target.name, "extended" if r is not None and r.grown_from is not None else status,
                     m.document_tokens, r.compute_s if r else 0.0, r.write_s if r else 0.0, m.bytes_raw, m.bytes_stored, m.storage,
                     time.perf_counter() - t0, computed_tokens=r.computed if r else None,
                     extended_from=r.grown_from if r else None, base=after if m.base else None, index=index,
                     format=m.document.get("format", "text"), sections=len(m.sections.parts) if m.sections else None)
