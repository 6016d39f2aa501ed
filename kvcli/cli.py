"""The kvcli command line: parse, call the library, render. Heavy modules load inside commands.

Exit codes: 0 success; 1 other failure; 2 usage error; 3 cache missing, corrupt, of an unknown
format version, or not matching the model (rebuild it); 4 `ask --check` found an answer that differs
from a full recompute (answers still printed); 130 interrupted; 141 stdout closed early.
"""

from __future__ import annotations

import functools
import os
import sys
import traceback
from pathlib import Path
from typing import Annotated, Literal, Optional

import typer
from typer.core import TyperArgument, TyperCommand

from . import __version__, served
from .errors import CHECK_DIFFERS_EXIT, KvcliError, ServerError, UsageError
from .output import EXIT_PIPE, Output, debug_enabled, human_bytes, is_broken_pipe, stdout_gone

EXIT_CODES = ("Exit codes: 0 ok, 1 failure, 2 usage error, 3 cache missing/corrupt/stale (rebuild it), "
              "4 ask --check: an answer differs from a full recompute.")
app = typer.Typer(
    help=f"Prefill a long document once into a compressed KV cache, then ask it many questions. {EXIT_CODES}",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)

# Options spelled once, shared by every command. Choices are Literal types: typer checks them while
# parsing (exit 2 naming the allowed values, before anything loads) and lists them in --help.
Device = Literal["auto", "cpu", "cuda", "mps"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
ModelOpt = Annotated[Optional[str], typer.Option("--model", "-m", metavar="MODEL", help="Hub id, model folder or .gguf file (default: $KVCLI_MODEL, else the embedded SmolLM2-135M-Instruct; for ask: the cache's model).")]
RevisionOpt = Annotated[Optional[str], typer.Option(metavar="REV", help="Hub revision (branch, tag or commit).")]
DeviceOpt = Annotated[Device, typer.Option(help="auto: CUDA or MPS when present, else CPU.")]
DtypeOpt = Annotated[Dtype, typer.Option(help="Compute dtype (auto: float32 on CPU, the model's own on an accelerator).")]
TrustOpt = Annotated[bool, typer.Option("--trust-remote-code", help="Run the model repository's own Python code (only for models you trust).")]
FramingOpt = Annotated[Literal["auto", "chat", "plain"], typer.Option(help="auto: the chat template if the model has one, else plain.")]
SystemOpt = Annotated[Optional[str], typer.Option(metavar="TEXT", help="System text placed before the document.")]
EncodingOpt = Annotated[str, typer.Option(metavar="NAME", help="Text encoding of the documents (any Python codec: utf-8, latin-1, utf-16, ...).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable JSON on stdout.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="Nothing on stderr but errors.")]
ServerOpt = Annotated[Optional[bool], typer.Option("--server/--no-server", help="Require a running `kvcli serve` / never use one (default: use one if it answers).", show_default=False)]
SocketOpt = Annotated[Optional[Path], typer.Option("--socket", metavar="PATH", help="The server's socket (default: $KVCLI_SOCKET, else $KVCLI_HOME/kvcli.sock).", show_default=False)]
CacheDtypeOpt = Annotated[Optional[Literal["float32", "bfloat16", "float16"]], typer.Option(help="Compute dtype (default: the cache's).")]
FollowUpOpt = Annotated[Optional[Path], typer.Option("--follow-up", metavar="FILE", help="Continue the conversation of the last line of this `ask --json` output ('-' for stdin).", show_default=False)]


class _Help(TyperCommand):
    """Plain click-style help: metavars and choices, not typer's type labels (<bool>, <list[str]>)."""

    def format_options(self, ctx, formatter) -> None:
        rows: dict[str, list[tuple[str, str]]] = {"Arguments": [], "Options": []}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if isinstance(param, TyperArgument):
                name = param.metavar or param.name.upper()
                rows["Arguments"].append((name + ("..." if param.nargs != 1 else ""), record[1]))
            else:
                rows["Options"].append(record)
        for title, items in rows.items():
            if items:
                with formatter.section(title):
                    formatter.write_dl(items)


def command(fn):
    """Register a command and map kvcli errors to one stderr line and an exit code, in one place."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        out = Output(quiet=kwargs.get("quiet", False))
        try:
            code = fn(*args, **kwargs)
        except OSError as exc:
            if not is_broken_pipe(exc):
                return _unexpected(out, exc)
            stdout_gone()  # the reader left (e.g. `| head`): stop quietly, as Unix tools do
            raise typer.Exit(EXIT_PIPE) from None
        except KvcliError as exc:
            if debug_enabled():
                traceback.print_exc()
            out.error(exc, exc.hint)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            out.error("interrupted")
            raise typer.Exit(130) from None
        except (typer.Exit, typer.Abort):
            raise
        except Exception as exc:  # a bug or an unforeseen failure: one line, traceback on request
            return _unexpected(out, exc)
        if code:
            raise typer.Exit(code)

    return app.command(cls=_Help)(wrapper)


def _unexpected(out: Output, exc: Exception):
    if debug_enabled():
        traceback.print_exc()
    out.error(f"unexpected {exc.__class__.__name__}: {exc}", "set KVCLI_DEBUG=1 for a traceback")
    raise typer.Exit(1) from None


def _version(value: bool) -> None:
    if value:
        typer.echo(f"kvcli {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")] = False) -> None:
    pass


@command
def prefill(
    docs: Annotated[Optional[list[str]], typer.Argument(metavar="DOC", help="Document files or URLs ('-' reads stdin and needs -o).", show_default=False)] = None,
    output: Annotated[Optional[str], typer.Option("--output", "-o", metavar="PATH", help="Cache path (one document) or folder (several; created if missing), or an object-store URL (s3://bucket/prefix/). Default: DOC with suffix .kv")] = None,
    from_list: Annotated[Optional[str], typer.Option("--from-list", metavar="FILE", help="File listing documents (paths or URLs), one per line ('-' for stdin); caches already up to date are skipped.")] = None,
    shard: Annotated[Optional[str], typer.Option("--shard", metavar="I/N", help="Take share I of N of the list (I/N, from 0; default: the Slurm array task, or JOB_COMPLETION_INDEX of KVCLI_SHARD_COUNT).")] = None,
    model: ModelOpt = None,
    revision: RevisionOpt = None,
    system: SystemOpt = None,
    framing: FramingOpt = "auto",
    chunk_size: Annotated[Optional[int], typer.Option(min=1, metavar="N", help="Tokens per forward pass (default: 1024, chosen by measurement).", show_default=False)] = None,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "auto",
    encoding: EncodingOpt = "utf-8",
    force: Annotated[bool, typer.Option("--force", "-f", help="Replace an existing cache.")] = False,
    kv_bits: Annotated[Optional[int], typer.Option("--kv-bits", metavar="BITS", help="Store keys/values quantized to 8 or 4 bits (lossy, smaller; default: lossless).", show_default=False)] = None,
    trust_remote_code: TrustOpt = False,
    server: ServerOpt = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> int:
    """Run documents through the model once and write their key/value caches."""
    from . import documents
    from .format import writing
    from .remote import is_url

    out = Output(quiet=quiet)
    docs = docs or []
    documents.check_encoding(encoding)
    if kv_bits is not None and kv_bits not in (8, 4):
        raise UsageError(f"--kv-bits must be 8 or 4, got {kv_bits}")
    if shard is not None and from_list is None:
        raise UsageError("--shard needs --from-list")
    if from_list is not None or is_url(output) or any(is_url(d) for d in docs):
        return _prefill_corpus(out, docs, from_list, shard, output, model=model, revision=revision, system=system, framing=framing,
                               chunk_size=chunk_size, dtype=dtype, device=device, encoding=encoding, force=force,
                               trust_remote_code=trust_remote_code, json_out=json_out, kv_bits=kv_bits)
    if not docs:
        raise UsageError("no document given (DOC ..., or --from-list FILE)")
    targets, folder = writing.cache_targets(docs, Path(output) if output is not None else None)
    # a document on stdin is prefilled in-process
    if server is not False and "-" not in docs:
        fields = {"docs": [[os.path.abspath(d), os.path.abspath(t)] for d, t in targets], "model": served.client_model(model or os.environ.get("KVCLI_MODEL")),
                  "revision": revision, "system": system, "framing": framing, "chunk_size": chunk_size, "dtype": dtype, "device": device,
                  "encoding": encoding, "force": force, "trust_remote_code": trust_remote_code, "kv_bits": kv_bits}
        if folder is not None:
            writing.make_folder(folder)  # the server writes into it
        code = served.run(out, server, "prefill", fields, [*(d for d, _ in targets), *(str(t) for _, t in targets), model],
                          prefilled=lambda i, r: _prefilled(out, *targets[i], r, json_out, True))
        if code is not None:
            return code
    from .engine import models, prefilling as pf

    failed: list[KvcliError] = []

    def report(exc: KvcliError) -> None:
        if len(targets) == 1:
            raise exc
        out.error(exc, exc.hint)
        failed.append(exc)

    ready = []
    for doc, target in targets:  # read every document first: a bad one fails before the model loads
        try:
            ready.append((doc, documents.read(doc, encoding), target))
        except KvcliError as exc:
            report(exc)
    if ready:
        if folder is not None:
            writing.make_folder(folder)
        with out.status("loading model"):
            lm = models.load(model, revision=revision, device=device, dtype=dtype, trust_remote_code=trust_remote_code, progress=out.note)
    for n, (doc, document, target) in enumerate(ready, 1):
        overall = (n, len(ready)) if len(targets) > 1 else None
        try:
            with out.progress(f"prefill {doc}", overall=overall) as update:
                r = pf.prefill(lm, document, target, system=system, framing=framing, chunk_size=chunk_size or pf.DEFAULT_CHUNK,
                               force=force, progress=update, kv_bits=kv_bits)
        except KvcliError as exc:
            report(exc)
            continue
        m = r.manifest
        _prefilled(out, doc, target, {"num_tokens": m.num_tokens, "compute_s": r.compute_s, "write_s": r.write_s,
                                      "bytes_raw": m.bytes_raw, "bytes_on_disk": m.bytes_stored, "storage": m.storage},
                   json_out, False)
    if failed:
        out.error(f"{len(failed)} of {len(targets)} documents failed")
        return 1
    return 0


def _prefill_corpus(out: Output, docs: list[str], from_list: Optional[str], shard: Optional[str], output: Optional[str], *,
                    model, revision, system, framing, chunk_size, dtype, device, encoding, force, trust_remote_code, json_out,
                    kv_bits: Optional[int] = None) -> int:
    """Documents from a list and/or URLs, this process's share, one result line each (library: engine.corpus)."""
    from .engine import corpus, models, prefilling as pf
    from .remote import placement

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
        lm = models.load(model, revision=revision, device=device, dtype=dtype, trust_remote_code=trust_remote_code, progress=out.note)
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


def _prefilled(out: Output, doc: str, target: Path, r: dict, json_out: bool, served: bool) -> None:
    """Report one finished prefill (in-process or served: the same lines)."""
    if json_out:
        out.json_line({"document": str(doc), "cache": str(target), "num_tokens": r["num_tokens"], "compute_s": round(r["compute_s"], 4),
                       "write_s": round(r["write_s"], 4), "bytes_raw": r["bytes_raw"], "bytes_on_disk": r["bytes_on_disk"], "served": served,
                       "storage": r.get("storage", "lossless")})
    out.note(
        f"{target}: {r['num_tokens']:,} tokens in {r['compute_s'] + r['write_s']:.1f} s "
        f"({r['num_tokens'] / max(r['compute_s'], 1e-9):,.0f} tok/s), {human_bytes(r['bytes_on_disk'])} on disk "
        f"({r['bytes_on_disk'] / r['bytes_raw']:.0%} of {human_bytes(r['bytes_raw'])} raw, {r.get('storage', 'lossless')})"
    )


@command
def ask(
    questions: Annotated[Optional[list[str]], typer.Argument(metavar="QUESTION", help="Questions (or -f FILE, or stdin).", show_default=False)] = None,
    cache: Annotated[list[str], typer.Option("--cache", "-c", metavar="CACHE", help="Cache to answer from: a folder or a URL (required, repeatable).", show_default=False)] = [],  # noqa: B006
    questions_file: Annotated[Optional[str], typer.Option("--questions-file", "-f", metavar="FILE", help="One question per line ('-' for stdin); blank and # lines skipped.")] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, metavar="N", help="Most answer tokens.")] = 256,
    temperature: Annotated[float, typer.Option(min=0.0, metavar="T", help="0 for greedy (default).")] = 0.0,
    top_p: Annotated[float, typer.Option(min=0.0, max=1.0, metavar="P", help="Nucleus sampling threshold (with --temperature).")] = 1.0,
    repetition_penalty: Annotated[float, typer.Option(min=0.0, metavar="R", help="Above 1 makes tokens already in the prompt or answer less likely (generate()'s own; 1: off).")] = 1.0,
    no_repeat_ngram_size: Annotated[int, typer.Option(min=0, metavar="N", help="Never repeat an N-token sequence of the prompt or answer (0: off).")] = 0,
    seed: Annotated[Optional[int], typer.Option(metavar="S", help="Seed for reproducible sampling.")] = None,
    stop: Annotated[list[str], typer.Option(metavar="TEXT", help="End the answer at this string (repeatable).", show_default=False)] = [],  # noqa: B006
    model: ModelOpt = None,
    revision: RevisionOpt = None,
    device: DeviceOpt = "auto",
    dtype: CacheDtypeOpt = None,
    convert_dtype: Annotated[bool, typer.Option("--convert-dtype", help="Allow a model dtype different from the cache's (answers may differ).")] = False,
    null: Annotated[bool, typer.Option("--null", "-0", help="End each plain answer with a NUL byte instead of a newline.")] = False,
    check: Annotated[bool, typer.Option("--check", help="Also run each prompt and answer once without the cache and compare logits "
                                        "(costs a full recompute of the document per question); exit 4 if an answer differs.")] = False,
    follow_up: FollowUpOpt = None,
    batch_size: Annotated[int, typer.Option(min=1, metavar="N", help="Questions decoded together on one document (1: one by one; measured here: 8 questions in one batch 3.6x, 16 in one batch 5.35x faster than one by one).")] = 8,
    trust_remote_code: TrustOpt = False,
    server: ServerOpt = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> int:
    """Answer questions from cached documents, computing only the questions' tokens."""
    out = Output(quiet=quiet)
    if not cache:  # checked before anything heavy loads: a usage error is instant
        raise UsageError("--cache is required (the cache to answer from; make one with kvcli prefill DOC)")
    if top_p <= 0:
        raise UsageError("--top-p must be above 0")
    if repetition_penalty <= 0:
        raise UsageError("--repetition-penalty must be above 0 (1 is off)")
    if str(follow_up) == "-" and (questions_file == "-" or not questions):
        raise UsageError("--follow-up - reads stdin: give the questions as arguments or with -f FILE")
    earlier = _read_answer_json(follow_up) if follow_up else None
    if trust_remote_code and not model:
        raise UsageError("--trust-remote-code needs an explicit --model: a cache must not choose whose code runs")
    qs = _gather_questions(questions or [], questions_file)
    from .remote import is_url

    if check and server:
        raise UsageError("--check recomputes every prompt in this process: it cannot go through a server (drop --server)")
    if server is not False and not check and not any(is_url(c) for c in cache):  # a running `kvcli serve` answers without importing torch
        options = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "seed": seed, "stop": list(stop),
                   "repetition_penalty": repetition_penalty, "no_repeat_ngram_size": no_repeat_ngram_size}
        fields = {"caches": [os.path.abspath(c) for c in cache], "questions": qs, "options": options, "model": served.client_model(model),
                  "revision": revision, "device": device, "dtype": dtype, "convert_dtype": convert_dtype,
                  "trust_remote_code": trust_remote_code, "stream": not json_out, "batch_size": batch_size}
        if earlier is not None:
            fields.update(follow_up=earlier, follow_up_name=str(follow_up))

        def answered(i: int, a: dict) -> None:
            if json_out:
                out.json_line({**a, "cache": str(cache[i]), "served": True})
            else:
                out.write("\0" if null else "\n")

        code = served.run(out, server, "ask", fields, [*(str(Path(c)) for c in cache), model], answered=answered)
        if code is not None:
            return code
    from .engine import answer as an, conversation

    opts = an.GenerationOptions(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed, stop=tuple(stop),
                                repetition_penalty=repetition_penalty, no_repeat_ngram_size=no_repeat_ngram_size)
    several = len(cache) * len(qs) > 1 and not json_out and not null
    loader = an.ModelPool(model=model, revision=revision, device=device, dtype=dtype, trust_remote_code=trust_remote_code, progress=out.note)
    first_error: Optional[KvcliError] = None
    differs = False
    for path in cache:
        try:
            local = _local_cache(path, out)
            with out.status(f"loading {path}"):
                session = an.Session(loader.for_cache(local), local, convert_dtype=convert_dtype)
            for warning in session.warnings:
                out.warn(warning)
        except KvcliError as exc:
            if len(cache) == 1:
                raise
            out.error(exc, exc.hint)
            first_error = first_error or exc
            continue
        history = conversation.from_answer_json(earlier, session.token_ids, str(follow_up)) if earlier is not None else []
        for q in qs:
            room = session.answer_room(q, history)
            if room is not None and 0 < room < max_new_tokens:
                out.warn(f"{_shown(path)}: only {room} positions are left after this question; the answer stops at {room} tokens, "
                         f"not --max-new-tokens {max_new_tokens}")

        def begin(q: str) -> None:
            out.check_stdout()  # a reader that left (`| head -1`) cancels the questions still to come
            if several:  # on a terminal only: which cache and question the next answer belongs to
                out.heading(f"{_shown(path)}: {q}" if len(cache) > 1 else q)

        def finish(a) -> None:
            nonlocal differs
            a.cache = _shown(path)
            if json_out:
                out.json_line({**a.to_json(), "served": False})
            else:
                out.write("\0" if null else "\n")
            if a.check is not None:
                differs = differs or not a.check.identical
                if not json_out:
                    out.note(f"kvcli: check: {_shown(path)}: {a.check.describe()}")
            out.summary(_timing(a))

        if batch_size > 1 and len(qs) > 1 and not history:
            _ask_together(session, qs, opts, batch_size, begin, finish, None if json_out else out.write, check)
            continue
        for q in qs:
            begin(q)
            finish(session.ask(q, opts, on_text=None if json_out else out.write, check=check, history=history))
    if first_error:
        return first_error.exit_code
    return CHECK_DIFFERS_EXIT if differs else 0


def _ask_together(session, qs: list[str], opts, batch_size: int, begin, finish, write, check: bool) -> None:
    """Session.ask_many, rendered in question order: the first unfinished question's answer streams live,
    later ones are held until it completes (each JSON line, as before, when its answer is complete)."""
    from .engine.questions import in_order

    text, answered = in_order(len(qs), lambda i: begin(qs[i]), lambda _i, a: finish(a), write)
    session.ask_many(qs, opts, batch_size=batch_size, on_text=text, on_answer=answered, check=check)


def _local_cache(path: str, out: Output) -> Path:
    """A cache folder to open: the path itself, or the checked local copy of a remote cache."""
    from .remote import is_url

    if not is_url(path):
        return Path(path)
    from .remote import local_store

    with out.status(f"fetching {_shown(path)}"):
        return local_store.fetch(path, progress=out.note)


def _shown(path: str) -> str:
    """A cache path or URL as printed (a URL without user:password@)."""
    from .remote import is_url

    if not is_url(path):
        return path
    from .remote.objects import redact

    return redact(path)


def _timing(a) -> str:
    n = len(a.answer_token_ids)
    rate = (n - 1) / (a.total_s - a.ttft_s) if n > 1 and a.ttft_s is not None and a.total_s > a.ttft_s else None
    ttft = f", first token {a.ttft_s:.2f} s" if a.ttft_s is not None else ""
    line = f"{n} tokens in {a.total_s:.1f} s{ttft}" + (f", {rate:.1f} tokens/s" if rate else "")
    return line + (" (stopped at --max-new-tokens)" if a.finish_reason == "length" else "")


def _read_answer_json(path: Path):
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


def _gather_questions(args: list[str], questions_file: Optional[str]) -> list[str]:
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


@command
def chat(
    cache: Annotated[str, typer.Option("--cache", "-c", metavar="CACHE", help="Cache of the document to talk about: a folder or a URL.")],
    max_new_tokens: Annotated[int, typer.Option(min=1, metavar="N", help="Most tokens per answer.")] = 256,
    temperature: Annotated[float, typer.Option(min=0.0, metavar="T", help="0 for greedy (default).")] = 0.0,
    top_p: Annotated[float, typer.Option(min=0.0, max=1.0, metavar="P", help="Nucleus sampling threshold (with --temperature).")] = 1.0,
    seed: Annotated[Optional[int], typer.Option(metavar="S", help="Seed for reproducible sampling.")] = None,
    stop: Annotated[list[str], typer.Option(metavar="TEXT", help="End an answer at this string (repeatable).", show_default=False)] = [],  # noqa: B006
    follow_up: FollowUpOpt = None,
    model: ModelOpt = None,
    revision: RevisionOpt = None,
    device: DeviceOpt = "auto",
    dtype: CacheDtypeOpt = None,
    convert_dtype: Annotated[bool, typer.Option("--convert-dtype", help="Allow a model dtype different from the cache's (answers may differ).")] = False,
    trust_remote_code: TrustOpt = False,
    server: ServerOpt = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> int:
    """Talk about a cached document: one question per line (interactive or stdin); each follows the earlier ones."""
    out = Output(quiet=quiet)
    if top_p <= 0:
        raise UsageError("--top-p must be above 0")
    if str(follow_up) == "-":
        raise UsageError("chat reads its questions from stdin: give --follow-up a file")
    if trust_remote_code and not model:
        raise UsageError("--trust-remote-code needs an explicit --model: a cache must not choose whose code runs")
    earlier = _read_answer_json(follow_up) if follow_up else None
    options = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "seed": seed, "stop": list(stop)}
    from .remote import is_url

    if server is not False and not is_url(cache) and served.answers(server):  # the conversation goes through the running server
        fields = {"caches": [os.path.abspath(cache)], "options": options, "model": served.client_model(model), "revision": revision,
                  "device": device, "dtype": dtype, "convert_dtype": convert_dtype, "trust_remote_code": trust_remote_code,
                  "stream": not json_out}
        if earlier is not None:
            fields.update(follow_up=earlier, follow_up_name=str(follow_up))
        while (line := out.read_line("> ")) is not None:
            if line.strip():
                code, fields = served.chat_turn(out, fields, line, str(cache), model, json_out)
                if code:
                    raise typer.Exit(code)
        return 0
    from .engine import answer as an, conversation

    opts = an.GenerationOptions(**{**options, "stop": tuple(stop)})
    loader = an.ModelPool(model=model, revision=revision, device=device, dtype=dtype, trust_remote_code=trust_remote_code, progress=out.note)
    local = _local_cache(cache, out)
    with out.status(f"loading {_shown(cache)}"):
        session = an.Session(loader.for_cache(local), local, convert_dtype=convert_dtype)
    for warning in session.warnings:
        out.warn(warning)
    talk = conversation.Chat(session, conversation.from_answer_json(earlier, session.token_ids, str(follow_up)) if earlier else ())
    while (line := out.read_line("> ")) is not None:
        if line.strip():
            a = talk.ask(line, opts, on_text=None if json_out else out.write)
            out.json_line({**a.to_json(), "cache": _shown(cache), "served": False}) if json_out else out.write("\n")
    return 0


@command
def info(
    cache: Annotated[str, typer.Argument(metavar="CACHE", help="Cache directory or URL.")],
    json_out: JsonOpt = False,
) -> int:
    """Show a cache's manifest: model, document, tokens, layers and sizes."""
    from rich.table import Table
    from rich.text import Text

    from .format import catalog, store

    from .remote import is_url

    out = Output()
    if is_url(cache):
        from .remote import objects

        m = objects.read_manifest(cache)  # the manifest only: nothing else is downloaded
        s = catalog.summary(objects.redact(cache), m)
    else:
        m = store.read_manifest(cache)
        s = catalog.summary(Path(cache), m)
    if json_out:
        out.json_doc({**s, "layers": catalog.layer_rows(m)})
        return 0
    head = Table.grid(padding=(0, 2))
    for key in ("path", "model", "model_type", "num_tokens", "dtype", "num_layers", "created"):
        head.add_row(key, Text(str(s[key])))
    head.add_row("document", Text(f"{m.document.get('name')} ({m.document.get('chars'):,} chars)"))
    head.add_row("framing", Text(f"{m.framing.get('kind')}" + (f", system: {m.framing['system']!r}" if m.framing.get("system") else "")))
    head.add_row("size", f"{human_bytes(s['bytes_on_disk'])} on disk, {human_bytes(s['bytes_raw'])} raw ({s['ratio']:.1%})")
    prov = s["provenance"]
    head.add_row("built with", Text(f"torch {prov.get('torch_version')}, {prov.get('device_type')}, attention "
                                    f"{prov.get('attn_implementation')}, transformers {s['transformers_version']}" if prov
                                    else f"transformers {s['transformers_version']} (torch, device, attention not recorded)"))
    head.add_row("storage", Text(catalog.describe_storage(m)))
    out.table(head)
    table = Table("layer", "kind", "window", "cached", "raw", "stored", "ratio")
    for row in catalog.layer_rows(m):
        table.add_row(str(row["index"]), row["kind"], str(row["sliding_window"] or "-"), f"{row['cached_length']:,}",
                      human_bytes(row["raw_bytes"]), human_bytes(row["stored_bytes"]), f"{row['ratio']:.1%}")
    out.table(table)
    return 0


@command
def verify(
    caches: Annotated[list[str], typer.Argument(metavar="CACHE", help="Cache directories or URLs.")],
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> int:
    """Check every shard of each cache against its manifest (no model needed). Exit 3 if any is bad."""
    out = Output(quiet=quiet)
    worst = 0
    for path in caches:
        try:
            m = _verify(path)
        except KvcliError as exc:
            worst = max(worst, exc.exit_code)
            out.json_line({"cache": _shown(path), "ok": False, "error": str(exc)}) if json_out else out.error(exc)
            continue
        if json_out:
            out.json_line({"cache": _shown(path), "ok": True, "num_tokens": m.num_tokens, "num_layers": len(m.layers),
                           "storage": m.storage})
        else:
            out.note(f"{_shown(path)}: ok ({len(m.layers)} layers, {m.num_tokens:,} tokens, {m.storage})")
    return worst


def _verify(path: str):
    """A local cache, or a remote one as it is in its store (never the local copy ask uses)."""
    from .format import store
    from .remote import is_url

    if not is_url(path):
        return store.verify(path)
    from .remote import objects

    return objects.verify(path)


@command
def ls(
    folder: Annotated[str, typer.Argument(metavar="DIR", help="Folder or URL prefix to list (default: the current one).", show_default=False)] = ".",
    json_out: JsonOpt = False,
) -> int:
    """List the caches in a folder: document, tokens, model, size, ratio and age."""
    from rich.table import Table
    from rich.text import Text

    from .format import catalog

    from .remote import is_url

    out = Output()
    if is_url(folder):
        from .remote import objects

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
        table.add_row(Text(Path(r["path"]).name), Text(str(r["document"].get("name"))), f"{r['num_tokens']:,}", Text(str(r["model"])),
                      r.get("storage", "-"),
                      human_bytes(r["bytes_on_disk"]), f"{r['ratio']:.1%}", _age(r["age_s"]))
    out.table(table)
    return 0


@command
def rm(
    caches: Annotated[list[Path], typer.Argument(metavar="CACHE", help="Cache directories to remove.")],
    quiet: QuietOpt = False,
) -> int:
    """Remove kvcli caches. Anything that is not a kvcli cache is refused, and then nothing is removed."""
    from .format import housekeeping as hk

    out = Output(quiet=quiet)
    hk.check_removable(caches)
    for path in caches:
        r = hk.remove_cache(path)
        out.note(f"removed {r.path} ({human_bytes(r.bytes)})")
    return 0


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
    from .format import housekeeping as hk

    out = Output(quiet=quiet)
    age = hk.parse_age(older_than) if older_than is not None else None
    removed = hk.prune(folder, older_than_s=age, dry_run=dry_run)
    for r in removed:
        out.json_line({"path": str(r.path), "kind": r.kind, "bytes": r.bytes, "dry_run": dry_run}) if json_out else out.write(f"{r.path}\n")
    caches = sum(r.kind == "cache" for r in removed)
    verb = "would remove" if dry_run else "removed"
    out.note(f"{folder}: {verb} {caches} cache{'s' * (caches != 1)} and {len(removed) - caches} leftover{'s' * (len(removed) - caches != 1)} "
             f"({human_bytes(sum(r.bytes for r in removed))})")
    return 0


@command
def count(
    docs: Annotated[list[str], typer.Argument(metavar="DOC", help="Document files ('-' reads stdin).", show_default=False)],
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

    from . import documents

    out = Output(quiet=quiet)
    documents.check_encoding(encoding)
    if docs.count("-") > 1:
        raise UsageError("stdin ('-') can be read only once")
    texts = [documents.read(d, encoding) for d in docs]  # every document first: a bad one fails before the tokenizer loads
    from .engine import counting

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
            table.add_row(Text(c.document), f"{c.tokens:,}", human_bytes(c.bytes_raw), human_bytes(c.bytes_on_disk_estimate),
                          room, "-" if c.prefill_s_estimate is None else f"~{c.prefill_s_estimate:,.0f} s")
        out.table(table)
    limit = f"{counter.max_positions:,} positions" if counter.max_positions else "no position limit"
    out.note(f"{counter.dtype}, {limit}; on-disk size from measured ratios and prefill time for a 2-core CPU: estimates")
    too_long = [c.document for c in counts if not c.fits]
    if too_long:
        out.error(f"{', '.join(too_long)}: too long for the model (prefill would refuse it)")
        return 1
    return 0


@command
def bench(
    doc: Annotated[Path, typer.Argument(metavar="DOC", help="Document to measure with (repeated or cut to each length).")],
    tokens: Annotated[list[int], typer.Option("--tokens", "-n", metavar="N", show_default=False, help="Document lengths in tokens (repeatable; default: 1k, 2k, 4k, 8k within the model's limit).")] = [],  # noqa: B006
    questions: Annotated[int, typer.Option(min=1, metavar="N", help="Questions timed per length.")] = 3,
    answer_tokens: Annotated[int, typer.Option(min=1, metavar="N", help="Tokens per whole answer compared with a full recompute.")] = 32,
    questions_file: Annotated[list[Path], typer.Option("--questions-file", "-f", metavar="FILE", help="Questions to use, one per line (repeatable; default: generic ones).")] = [],  # noqa: B006
    kv_bits: Annotated[list[int], typer.Option("--kv-bits", metavar="BITS", help="Also measure this quantized format against the lossless cache (8 or 4; repeatable).")] = [],  # noqa: B006
    agreement_tokens: Annotated[int, typer.Option(min=1, metavar="N", help="New tokens per answer when measuring a quantized format's agreement.")] = 64,
    model: ModelOpt = None,
    revision: RevisionOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> int:
    """Measure prefill, restore and time to first token with and without the cache, and sizes."""
    from . import bench as bn, documents
    from .engine import models

    out = Output(quiet=quiet)
    document = documents.read(doc)
    pool = []
    for f in questions_file:
        pool += _gather_questions([], str(f))
    if any(b not in (8, 4) for b in kv_bits):
        raise UsageError(f"--kv-bits must be 8 or 4, got {kv_bits}")
    with out.status("loading model"):
        lm = models.load(model, revision=revision, device=device, dtype=dtype, progress=out.note)
    result = bn.run(lm, document, tokens=tokens or None, questions=questions, progress=out.note, answer_tokens=answer_tokens,
                    kv_bits=kv_bits, question_list=pool or None, agreement_tokens=agreement_tokens)
    if json_out:
        out.json_doc(result)
    else:
        out.table(bn.render(result))
    return 0


@command
def serve(
    socket: SocketOpt = None,
    max_memory: Annotated[Optional[str], typer.Option(metavar="SIZE", help="Most memory for models and caches, e.g. 8G or 512M (default: half the RAM).", show_default=False)] = None,
    idle_timeout: Annotated[Optional[str], typer.Option(metavar="DURATION", help="Exit after this long unused, e.g. 30s, 10m, 2h (default: never).", show_default=False)] = None,
    detach: Annotated[bool, typer.Option("--detach", "-d", help="Run in the background: print its pid once it answers; log to $KVCLI_HOME/serve.log.")] = False,
    stop: Annotated[bool, typer.Option("--stop", help="Stop the server running on the socket.")] = False,
    http_at: Annotated[Optional[str], typer.Option("--http", metavar="HOST:PORT", help="Also serve the caches under --docs as OpenAI-compatible models at HOST:PORT (needs kvcli[serve]).", show_default=False)] = None,
    api_key: Annotated[Optional[str], typer.Option("--api-key", metavar="KEY", envvar="KVCLI_API_KEY", help="Bearer token HTTP clients must send; required unless HOST is loopback ($KVCLI_API_KEY).", show_default=False)] = None,
    docs: Annotated[list[Path], typer.Option("--docs", metavar="DIR", show_default=False, help="Folder whose caches --http offers as models (repeatable; default: the current folder).")] = [],  # noqa: B006
    batch_size: Annotated[int, typer.Option(min=1, metavar="N", help="Questions on one document decoded together, from any clients (1: one at a time).")] = 8,
    quiet: QuietOpt = False,
) -> int:
    """Keep models and restored caches warm on a unix socket; ask and prefill use it when it runs."""
    from .serve import client, server as sv, units

    out = Output(quiet=quiet)
    path = client.socket_path(socket)
    size = units.parse_size(max_memory) if max_memory else None
    idle = units.parse_duration(idle_timeout) if idle_timeout else None
    if http_at:
        from .serve import http

        host, port = http.parse_address(http_at)
        http.check_bind(host, api_key)
        docs = [d.resolve() for d in (docs or [Path(".")])]
        for d in docs:
            if not d.is_dir():
                raise UsageError(f"--docs {d}: not a folder")
    elif docs:
        raise UsageError("--docs goes with --http HOST:PORT")
    if stop:
        pid = sv.stop_server(path)
        if pid is None:
            raise ServerError(f"{path}: no kvcli server answers here")
        out.note(f"stopped the server on {path} (pid {pid})")
        return 0
    if detach:
        args = (["--max-memory", max_memory] if max_memory else []) + (["--idle-timeout", idle_timeout] if idle_timeout else [])
        args += ["--batch-size", str(batch_size)]
        if http_at:
            args += ["--http", http_at, *[a for d in docs for a in ("--docs", str(d))]]
        pid = sv.detach(path, args, env={"KVCLI_API_KEY": api_key} if api_key else None)  # the key never on a command line
        out.write(f"{pid}\n")
        out.note(f"serving on {path} (log: {sv.log_path()})")
        return 0
    from .serve.warm import Warm

    server = sv.Server(path, Warm(size, batch_size=batch_size), idle_timeout=idle, log=out.note)
    with out.status("starting"):
        server.start()
    web = None
    if http_at:
        from .serve.docs import WarmProvider

        web = http.start(host, port, provider=WarmProvider(server.warm, docs, on_use=server.touch), api_key=api_key)
        out.note(f"OpenAI-compatible endpoint on {web.base_url} for the caches in {', '.join(map(str, docs))}")
    try:
        server.serve_forever()
    finally:
        if web is not None:
            web.stop()
    return 0


@command
def ps(
    socket: SocketOpt = None,
    json_out: JsonOpt = False,
) -> int:
    """Show what the running server holds: models, caches, bytes, last use, answers served."""
    import time

    from rich.table import Table
    from rich.text import Text

    from .serve import client

    out = Output()
    path = client.socket_path(socket)
    reply = client.call(path, "status")
    if reply is None:
        raise ServerError(f"{path}: no kvcli server answers here", hint="start one with 'kvcli serve --detach'")
    s = reply.get("status") or {}
    if json_out:
        out.json_doc(s)
        return 0
    now = time.time()
    out.table(Text(f"pid {s['pid']} on {s['socket']}, up {_age(s['uptime_s'])}, {human_bytes(s['bytes'])} of {human_bytes(s['max_memory'])} held, "
             f"{s['done']} requests answered, {s['active']} active, {s['cancelled']} cancelled"))
    models = Table("model", "dtype", "device", "memory", "last used", "answers", title="models")
    for m in s["models"]:
        models.add_row(Text(str(m["name"])), m["dtype"], m["device"], human_bytes(m["bytes"]), _age(now - m["last_used"]) + " ago", str(m["served"]))
    caches = Table("cache", "tokens", "model", "memory", "last used", "answers", "most together", title="caches")
    for c in s["caches"]:
        b = c.get("batch")  # questions one decoding step ran at most, of the batch's width
        caches.add_row(Text(c["path"]), f"{c['num_tokens']:,}", Text(str(c["model"])), human_bytes(c["bytes"]), _age(now - c["last_used"]) + " ago",
                       str(c["served"]), f"{b['peak_rows']} of {b['width']}" if b else "1")
    out.table(models)
    out.table(caches)
    return 0


def _age(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def main() -> None:
    app(prog_name="kvcli")


if __name__ == "__main__":
    main()
