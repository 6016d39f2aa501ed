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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from ..documents import Document
from ..errors import CacheError, CacheExistsError, KvcliError, UsageError
from ..format import manifest as mf, store, writing
from .prompt import framing as fr
from . import prefilling as pf
from .model.models import LoadedModel

# Fingerprint fields that decide whether a cache still fits the model (those fit.check_fits reads).
FINGERPRINT_KEYS = ("model_type", "config_sha256", "weights_sha256", "tokenizer_sha256", "chat_template_sha256",
                    "dtype", "num_layers", "num_kv_heads", "head_dim", "max_positions", "weights")
FRAMING_KEYS = ("kind", "system", "template_sha256")  # the framing asked for; where the cut fell (version, anchor,
# pending) follows from it, the document and the tokenizer, all compared already
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
        return pf.prefill(lm, document, self.path, force=force, **options)


@dataclass(frozen=True)
class Job:
    document: str  # path or URL as listed
    target: Target
    error: str | None = None  # set when the job cannot run (e.g. two documents name the same cache)


@dataclass
class DocResult:
    document: str
    cache: str
    status: str  # "built", "skipped" or "failed"
    tokens: int | None
    seconds: float
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        row = {"document": self.document, "cache": self.cache, "status": self.status, "tokens": self.tokens,
               "seconds": round(self.seconds, 3)}
        if self.error is not None:
            row["error"] = self.error
        return row


def read_list(source: str) -> list[str]:
    """Document entries from a list file ('-' for stdin): one per line, blank and '#' lines skipped, repeats dropped."""
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
    jobs = [Job(e, target_for(e)) for e in entries]
    by_cache: dict[str, list[str]] = {}
    for job in jobs:
        by_cache.setdefault(job.target.name, []).append(job.document)
    return [
        Job(j.document, j.target, f"{j.target.name}: named by {len(by_cache[j.target.name])} documents "
                                  f"({', '.join(by_cache[j.target.name][:3])}); give them distinct file names")
        if len(by_cache[j.target.name]) > 1 else j
        for j in jobs
    ]


def up_to_date(m: mf.Manifest, lm: LoadedModel, document: Document, framing: dict[str, Any],
               kv_bits: int | None = None) -> bool:
    """Whether a cache's manifest says it holds this document for this model and framing, stored as asked
    (lossless, or quantized to kv_bits bits), without reading a shard: what decides the cache is compared
    (document, model and tokenizer fingerprints, framing kind, system prompt, template hash, storage), not the
    framing record's own fields: a tokenizer that moves the cut (SentencePiece) records version 2 and an anchor,
    which `framing` (the record of the framing asked for, before any cut) never holds."""
    if m.document.get("sha256") != document.sha256:  # any format version kvcli reads will do
        return False
    if (m.quant or {}).get("bits") != kv_bits:
        return False
    if any(m.model.get(k) != lm.fingerprint.get(k) for k in FINGERPRINT_KEYS):
        return False
    if m.framing.get("version") not in fr.SUPPORTED_VERSIONS:
        return False
    return all(m.framing.get(k) == framing.get(k) for k in FRAMING_KEYS)


def run(
    lm: LoadedModel,
    jobs: Iterable[Job],
    *,
    read: Callable[[str], Document],
    system: str | None = None,
    framing: str = "auto",
    chunk_size: int = pf.DEFAULT_CHUNK,
    force: bool = False,
    incremental: bool = True,
    progress_for: Callable[[Job], Any] | None = None,
    kv_bits: int | None = None,
) -> Iterator[DocResult]:
    """Prefill each job's document, yielding one result per document as it finishes.

    incremental (corpus runs): an up-to-date cache is skipped, a stale or broken one replaced.
    Without it (plain prefill) an existing cache is an error unless force. With force every
    document is rebuilt. A cache that appears while building (another process with an overlapping
    share) counts as skipped when it is up to date. Failures become results, never exceptions.
    kv_bits 8 or 4 stores the caches quantized; a cache stored otherwise is not up to date.
    """
    record = fr.choose(lm.tokenizer, framing, system).record(lm.tokenizer)
    for job in jobs:
        t0 = time.perf_counter()

        def result(status: str, tokens: int | None = None, error: str | None = None) -> DocResult:
            return DocResult(job.document, job.target.name, status, tokens, time.perf_counter() - t0, error)

        if job.error:
            yield result("failed", error=job.error)
            continue
        try:
            document = read(job.document)
            current = job.target.current()
            if current is not None and not force:
                if incremental and up_to_date(current, lm, document, record, kv_bits):
                    yield result("skipped", current.num_tokens)
                    continue
                if not incremental:
                    raise CacheExistsError(f"{job.target.name}: already exists (use --force to replace it)")
            cm = progress_for(job) if progress_for else None
            options = dict(system=system, framing=framing, chunk_size=chunk_size, kv_bits=kv_bits)
            replace = force or incremental  # a corpus run replaces a stale or broken cache (never a folder that is no cache)
            try:
                if cm is None:
                    r = job.target.write(lm, document, force=replace, **options)
                else:
                    with cm as update:
                        r = job.target.write(lm, document, force=replace, progress=update, **options)
            except CacheExistsError:
                now = job.target.current()  # written meanwhile by another process
                if incremental and now is not None and up_to_date(now, lm, document, record, kv_bits):
                    yield result("skipped", now.num_tokens)
                    continue
                raise
            yield result("built", r.manifest.num_tokens)
        except KvcliError as exc:
            yield result("failed", error=str(exc))
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as exc:  # one document's unforeseen failure (e.g. out of memory) must not stop the rest
            yield result("failed", error=f"{job.document}: unexpected {exc.__class__.__name__}: {exc}")
