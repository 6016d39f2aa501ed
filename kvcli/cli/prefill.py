"""kvcli prefill: documents -> caches, in-process or through a running server (library: engine.prefilling, engine.corpus)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from . import served
from ..documents import TEXT_EXTENSIONS
from ..errors import UsageError
from .output import Output
from .rendering import PrefillRenderer
from .app import command
from .options import DeviceOpt, DtypeOpt, EncodingOpt, FramingOpt, JsonOpt, ModelOpt, QuietOpt, RevisionOpt, ServerOpt, SystemOpt, TrustOpt, WeightsOpt


@command
def prefill(
    docs: Annotated[Optional[list[str]], typer.Argument(metavar="DOC", help="Document files or URLs ('-' reads stdin and needs -o).", show_default=False)] = None,
    output: Annotated[Optional[str], typer.Option("--output", "-o", metavar="PATH", help="Cache path (one document) or folder (several; created if missing), or an object-store URL (s3://bucket/prefix/). "
                                                                                       f"Default: beside DOC, named DOC with a text extension ({', '.join(TEXT_EXTENSIONS)}) replaced by .kv, "
                                                                                       "any other name kept whole (MPL-2.0 -> MPL-2.0.kv).")] = None,
    from_list: Annotated[Optional[str], typer.Option("--from-list", metavar="FILE", help="File listing documents (paths or URLs), one per line ('-' for stdin); caches already up to date are skipped.")] = None,
    shard: Annotated[Optional[str], typer.Option("--shard", metavar="I/N", help="Take share I of N of the list (I/N, from 0; default: the Slurm array task, or JOB_COMPLETION_INDEX of KVCLI_SHARD_COUNT).")] = None,
    model: ModelOpt = None,
    revision: RevisionOpt = None,
    system: SystemOpt = None,
    framing: FramingOpt = "auto",
    chunk_size: Annotated[Optional[int], typer.Option(min=1, metavar="N", help="Tokens per forward pass (default: 1024, chosen by measurement).", show_default=False)] = None,
    dtype: DtypeOpt = "auto",
    weights: WeightsOpt = "float",
    device: DeviceOpt = "auto",
    encoding: EncodingOpt = "utf-8",
    force: Annotated[bool, typer.Option("--force", help="Replace an existing cache.")] = False,
    kv_bits: Annotated[Optional[int], typer.Option("--kv-bits", metavar="BITS", help="Store keys/values quantized to 8 or 4 bits (lossy, smaller; default: lossless).", show_default=False)] = None,
    trust_remote_code: TrustOpt = False,
    server: ServerOpt = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> int:
    """Run documents through the model once and write their key/value caches."""
    from .. import documents
    from ..format import manifest as mf, writing
    from ..remote import is_url

    out = Output(quiet=quiet)
    docs = docs or []
    documents.check_encoding(encoding)
    mf.check_kv_bits(kv_bits)
    if shard is not None and from_list is None:
        raise UsageError("--shard needs --from-list")
    if from_list is not None or is_url(output) or any(is_url(d) for d in docs):
        return _prefill_corpus(out, docs, from_list, shard, output, model=model, revision=revision, system=system, framing=framing,
                               chunk_size=chunk_size, dtype=dtype, weights=weights, device=device, encoding=encoding, force=force,
                               trust_remote_code=trust_remote_code, json_out=json_out, kv_bits=kv_bits)
    if not docs:
        raise UsageError("no document given (DOC ..., or --from-list FILE)")
    targets, folder = writing.cache_targets(docs, Path(output) if output is not None else None)
    # a document on stdin is prefilled in-process
    if server is not False and "-" not in docs:
        fields = {"docs": [[os.path.abspath(d), os.path.abspath(t)] for d, t in targets], "model": served.client_model(model or os.environ.get("KVCLI_MODEL")),
                  "revision": revision, "system": system, "framing": framing, "chunk_size": chunk_size, "dtype": dtype, "weights": weights,
                  "device": device, "encoding": encoding, "force": force, "trust_remote_code": trust_remote_code, "kv_bits": kv_bits}
        if folder is not None:
            writing.make_folder(folder)  # the server writes into it
        render = PrefillRenderer(out, targets, json_out=json_out, served=True)
        try:
            code = served.run(out, server, "prefill", fields, [*(d for d, _ in targets), *(str(t) for _, t in targets), model],
                              render=render)
        finally:
            render.close()
        if code is not None:
            return code
    from contextlib import contextmanager

    from ..events import prefill_events

    @contextmanager
    def open_model():
        from ..engine.model import models  # imported only now: a refused request costs no torch import

        if folder is not None:
            writing.make_folder(folder)
        with out.status("loading model"):
            lm = models.load(model, revision=revision, device=device, dtype=dtype, trust_remote_code=trust_remote_code, progress=out.note,
                             weights=weights)
        yield _Held(lm)

    render = PrefillRenderer(out, targets, json_out=json_out)
    try:
        return prefill_events([(str(d), str(t)) for d, t in targets], open_model=open_model, emit=render,
                              read=lambda doc: documents.read(doc, encoding),
                              check=lambda t: writing.check_target(t, force=force, folder_made=folder is not None),
                              fits=lambda: _fit_check(out, model, revision, framing, system, trust_remote_code),
                              system=system, framing=framing, chunk_size=chunk_size, force=force, kv_bits=kv_bits)
    finally:
        render.close()


def _fit_check(out: Output, model, revision, framing, system, trust_remote_code):
    from ..engine import counting

    with out.status("reading tokenizer"):
        return counting.fit_check(model, revision=revision, framing=framing, system=system, trust_remote_code=trust_remote_code)


class _Held:
    """A model loaded for this process alone, lent as the server lends its warm ones."""

    def __init__(self, lm):
        self.lm = lm

    def served(self) -> None:
        pass


def _prefill_corpus(out: Output, docs: list[str], from_list: Optional[str], shard: Optional[str], output: Optional[str], *,
                    model, revision, system, framing, chunk_size, dtype, device, encoding, force, trust_remote_code, json_out,
                    kv_bits: Optional[int] = None, weights: str = "float") -> int:
    """Documents from a list and/or URLs, this process's share, one result line each (library: engine.corpus)."""
    from ..engine import corpus, prefilling as pf
    from ..engine.model import models
    from ..remote import placement

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
    with out.status("loading model"):
        lm = models.load(model, revision=revision, device=device, dtype=dtype, trust_remote_code=trust_remote_code, progress=out.note,
                         weights=weights)
    counts = {"built": 0, "skipped": 0, "failed": 0}
    results = corpus.run(lm, jobs, read=placement.reader(encoding), system=system, framing=framing, chunk_size=chunk_size or pf.DEFAULT_CHUNK,
                         force=force, incremental=from_list is not None, kv_bits=kv_bits,
                         progress_for=lambda job: out.progress(f"prefill {job.document}"))
    for r in results:
        counts[r.status] += 1
        if json_out:
            out.json_line(r.to_json())
        if r.status == "failed":
            out.error(r.error)
        elif not json_out:
            out.note(f"{r.cache}: {r.status} ({r.tokens:,} tokens, {r.seconds:.1f} s)")
    out.note(f"{counts['built']} built, {counts['skipped']} skipped, {counts['failed']} failed of {len(jobs)} documents{label}")
    return 1 if counts["failed"] else 0
