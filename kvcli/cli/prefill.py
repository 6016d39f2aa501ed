"""kvcli prefill: documents -> caches, in-process or through a running server (library: engine.prefilling, engine.corpus)."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Literal, Optional

import typer

from . import served
from ..documents import DOCUMENT_EXTENSIONS
from ..errors import UsageError
from .output import Output
from .rendering import PrefillRenderer
from .app import command
from .options import DeviceOpt, DtypeOpt, EncodingOpt, FramingOpt, JsonOpt, ModelOpt, QuietOpt, RevisionOpt, ServerOpt, SystemOpt, TrustOpt, WeightsOpt


@command
def prefill(
    docs: Annotated[Optional[list[str]], typer.Argument(metavar="DOC", help="Document files or URLs: text, PDF, HTML, DOCX or EPUB ('-' reads stdin and needs -o).", show_default=False)] = None,
    output: Annotated[Optional[str], typer.Option("--output", "-o", metavar="PATH", help="Cache path (one document) or folder (several; created if missing), or an object-store URL (s3://bucket/prefix/). "
                                                                                       f"Default: beside DOC, named DOC with a document extension ({', '.join(DOCUMENT_EXTENSIONS)}) replaced by .kv, "
                                                                                       "any other name kept whole (MPL-2.0 -> MPL-2.0.kv).")] = None,
    from_list: Annotated[Optional[str], typer.Option("--from-list", metavar="FILE", help="File listing documents (paths or URLs), one per line ('-' for stdin); caches already up to date are skipped.")] = None,
    shard: Annotated[Optional[str], typer.Option("--shard", metavar="I/N", help="Take share I of N of the list (I/N, from 0; default: the Slurm array task, or JOB_COMPLETION_INDEX of KVCLI_SHARD_COUNT).")] = None,
    model: ModelOpt = None,
    revision: RevisionOpt = None,
    system: SystemOpt = None,
    framing: FramingOpt = "auto",
    chunk_size: Annotated[Optional[int], typer.Option(min=1, metavar="N", help="Tokens per forward pass (default: 1024, chosen by measurement).", show_default=False)] = None,
    dtype: DtypeOpt = "auto",
    weights: WeightsOpt = None,
    device: DeviceOpt = "auto",
    encoding: EncodingOpt = "utf-8",
    after: Annotated[Optional[str], typer.Option("--after", metavar="CACHE", help="Extend this cache: the document follows its document in one prompt, only the new tokens are computed and stored, with a link to CACHE.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing cache (recomputed whole, even where its document only grew).")] = False,
    compression: Annotated[Literal["small", "fast"], typer.Option("--compression", help="Lossless storage: small (byte planes, zstd level 1) or fast (plain bytes, zstd level -1: larger on disk, restored faster where cores, not disks, are the limit).")] = "small",
    window: Annotated[Optional[int], typer.Option("--window", min=64, metavar="N", help="Positions a question's prompt may use (default: the model's); a longer document becomes a sectioned cache whose questions each use the sections that fit.", show_default=False)] = None,
    kv_bits: Annotated[Optional[int], typer.Option("--kv-bits", metavar="BITS", help="Store keys/values quantized to 8 or 4 bits (lossy, smaller; default: lossless).", show_default=False)] = None,
    trust_remote_code: TrustOpt = False,
    server: ServerOpt = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> int:
    """Run documents through the model once and write their key/value caches."""
    from .. import documents
    from ..remote import is_url
    from ..requests import ModelSpec, PrefillRequest

    out = Output(quiet=quiet)
    docs = docs or []
    documents.check_encoding(encoding)
    request = PrefillRequest(docs=(), model=ModelSpec(model or os.environ.get("KVCLI_MODEL"), revision, device, dtype,
                                                      trust_remote_code, weights),
                             system=system, framing=framing, chunk_size=chunk_size, encoding=encoding, force=force,
                             kv_bits=kv_bits, after=after, compression=compression, window=window)
    if shard is not None and from_list is None:
        raise UsageError("--shard needs --from-list")
    if after is not None and (from_list is not None or is_url(after)):
        raise UsageError("--after takes a local cache folder and documents given by name (not --from-list)")
    if window is not None:  # the warm server's prefill takes no window: this one runs in-process
        server = False
    if from_list is not None or is_url(output) or any(is_url(d) for d in docs):
        return _prefill_corpus(out, request, docs, from_list, shard, output, json_out=json_out)
    if not docs:
        raise UsageError("no document given (DOC ..., or --from-list FILE)")
    return _prefill_docs(out, request, docs, output, server, json_out=json_out, spelled=model)


def _prefill_docs(out: Output, request, docs: list[str], output: Optional[str], server: Optional[bool], *, json_out: bool,
                  spelled: Optional[str]) -> int:
    """Documents given by name, each to its cache: through a running server when one answers, else in-process."""
    from .. import documents
    from ..format import writing

    targets, folder = _cache_targets(docs, Path(output) if output is not None else None)
    if folder is not None:
        writing.make_folder(folder)  # the writer, here or the server, writes into it
    request = replace(request, docs=tuple((str(d), str(t)) for d, t in targets))
    if server is not False and "-" not in docs:  # a document on stdin is prefilled in-process
        code = _served(out, request, server, json_out=json_out, spelled=spelled)
        if code is not None:
            return code
    from ..engine import corpus

    jobs = [corpus.Job(d, corpus.LocalTarget(Path(t))) for d, t in request.docs]
    return _run(out, request, jobs, list(request.docs), json_out=json_out, read=lambda doc: documents.read(doc, request.encoding),
                incremental=False, upfront=True, fit=lambda: _fit_check(out, request))


def _served(out: Output, request, server: Optional[bool], *, json_out: bool, spelled: Optional[str]) -> Optional[int]:
    """The prefill through a running server (None when none answers and none is required)."""
    render = PrefillRenderer(out, request.docs, json_out=json_out, served=True)
    try:
        return served.run(out, server, request, [*(d for d, _ in request.docs), *(t for _, t in request.docs), spelled],
                          render=render)
    finally:
        render.close()


def _run(out: Output, request, jobs: list, targets: list[tuple[str, str]], *, json_out: bool, listed: bool = False,
         label: str = "", **run_options) -> int:
    """Run the jobs in-process through the one driver (events.prefill_events), the model loaded once one needs it."""
    from contextlib import contextmanager

    from ..events import prefill_events

    @contextmanager
    def open_model():
        from ..engine import corpus
        from ..engine.model import models  # imported only now: a refused request costs no torch import

        m = request.model
        with out.status("loading model"):
            lm = models.load(m.source, revision=m.revision, device=m.device, dtype=m.dtype, trust_remote_code=m.trust_remote_code,
                             weights=m.weights, progress=out.note)
        yield corpus.lent(lm)

    render = PrefillRenderer(out, targets, json_out=json_out, listed=listed, label=label)
    try:
        return prefill_events(jobs, emit=render, model=open_model, raise_single=not listed, **request.options(), **run_options)
    finally:
        render.close()


def _fit_check(out: Output, request):
    from ..engine import counting

    m = request.model
    with out.status("reading tokenizer"):
        return counting.fit_check(m.source, revision=m.revision, framing=request.framing, system=request.system,
                                  trust_remote_code=m.trust_remote_code)


def _prefill_corpus(out: Output, request, docs: list[str], from_list: Optional[str], shard: Optional[str], output: Optional[str], *,
                    json_out: bool) -> int:
    """Documents from a list and/or URLs, this process's share (library: engine.corpus)."""
    from ..engine import corpus
    from ..engine import placement

    entries = list(dict.fromkeys(docs + (corpus.read_list(from_list) if from_list is not None else [])))
    if "-" in entries:
        raise UsageError("with --from-list or URLs, documents are files or URLs, not stdin ('-')")
    share = corpus.parse_shard(shard) if shard else (corpus.shard_from_env() if from_list is not None else None)
    jobs = corpus.plan(entries, placement.target_for(output, single=from_list is None and len(entries) == 1))
    if share:
        jobs = corpus.share(jobs, *share)
    label = f" (shard {share[0]}/{share[1]})" if share else ""
    if not jobs:
        out.note(f"no documents to prefill{label}")
        return 0
    return _run(out, request, jobs, [(j.document, j.target.name) for j in jobs], read=placement.reader(request.encoding),
                json_out=json_out, listed=True, label=label, incremental=from_list is not None)


def _cache_targets(docs: list[str], output: Optional[Path]) -> tuple[list[tuple[str, Path]], Optional[Path]]:
    """Where a prefill of these documents writes: (document, cache path) pairs, and the -o folder to create.
    Refused before any work (UsageError): stdin without one -o cache, -o a file or cache for several
    documents, two documents aimed at one cache."""
    from .. import documents
    from ..format import store

    if "-" in docs and (output is None or len(docs) > 1):
        raise UsageError("reading the document from stdin ('-') needs -o CACHE and no other document")
    if len(docs) == 1 and not (output is not None and output.is_dir() and not store.is_cache(output)):
        return [(docs[0], output or Path(docs[0]).parent / documents.cache_name(docs[0]))], None
    if output is not None and (store.is_cache(output) or (output.exists() and not output.is_dir())):
        raise UsageError(f"{output}: with several documents, -o must be a folder")
    targets = [(d, (output or Path(d).parent) / documents.cache_name(d)) for d in docs]
    seen: dict[str, str] = {}
    for doc, target in targets:
        key = os.path.normcase(os.path.abspath(target))
        if key in seen:
            raise UsageError(f"{seen[key]} and {doc} would both be written to {target}; rename one or use separate -o folders")
        seen[key] = doc
    return targets, output
