"""Benchmark (not collected by pytest): every kvcli mode and llama.cpp side by side on one GGUF file and the same
prompt ids.

    .ci/llamacpp-up                       # once: llama-cpp-python built from source in a venv of its own
    nice python tests/bench/bench_llamacpp.py [--model FILE.gguf] [--modes float32,q8,bfloat16,llamacpp]
        [--tokens 2048] [--repeats 3] [--max-new-tokens 64] [--questions 4] [--doc samples/document.txt]
        [--generate] [--fresh-convert] [--first] [--threads N] [--busy N] [--json]
    nice python tests/bench/bench_llamacpp.py --tokens 512 --repeats 1 --max-new-tokens 16    # a quick look
    nice python tests/bench/bench_llamacpp.py --weights q4                # one mode beside llama.cpp: --modes q4,llamacpp

Run from kvcli's venv. --model: any .gguf file (default: kvcli's default model file). --modes, a comma list
(default: every mode): float32 and bfloat16 (--dtype, float weights), each --weights mode of
kvcli.engine.model.stored.MODES but "float" (read at run time), WEIGHTS+DTYPE for both (q8+bfloat16), and
llamacpp. Each kvcli mode runs in a fresh process of kvcli's python (an honest load time, no shared memory),
one after another: a load alone (what a first load in this KVCLI_HOME prepares is done there), then in a new
process the timed run: load ("ready": interpreter, imports and load, as a user's later runs meet it), prefill the
document (its first --tokens tokens, when given), a warm-up answer, then --repeats times a fresh Session (restore)
and the first question, then the other questions. --first also times each mode's first load in an empty
KVCLI_HOME (hashing the file, reading its header, preparing what is kept), and the table says what KVCLI_HOME keeps
per mode. --busy N runs N busy-looping processes beside the whole run (both sides). llama.cpp runs in
its own venv ($KVCLI_LLAMACPP_PYTHON, default /opt/kvcli-llamacpp-venv/bin/python; tests/bench/llamacpp_run.py)
on the GGUF as stored, with the exact ids kvcli framed. All answer greedily, stopping at the model's end-of-turn
ids. Prints a Markdown table (docs/performance.md), the answers' agreement with kvcli float32's tokens (reported,
never asserted), the first load of the GGUF (its one-time conversion into a float32 folder; --fresh-convert
measures it in a temporary KVCLI_HOME when it is already done), the CPU, its flags, the threads and the load
average before and after. --generate adds transformers' generate() on each mode's own model and cache.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BUSY = "import os, sys\nwhile os.getppid() == int(sys.argv[1]): pass"  # a busy loop that ends with the benchmark, killed or not
SAMPLES = HERE.parents[1] / "samples"
sys.path.insert(0, str(HERE))
from bench_batch import EXTRA  # noqa: E402  (questions after the sample's own)

FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
         "avx512_bf16", "avx512vbmi", "amx_tile", "amx_int8", "amx_bf16")
DTYPES = ("float32", "bfloat16", "float16")
LLAMACPP = "llamacpp"


def cpu() -> dict:
    info = {"model": "?", "flags": []}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and info["model"] == "?":
            info["model"] = value.strip()
        elif key.strip() == "flags":
            have = set(value.split())
            info["flags"] = [f for f in FLAGS if f in have]
            break
    info["cores"] = os.cpu_count()
    return info


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def parse_mode(name: str) -> tuple[str, str]:
    """A --modes name as kvcli.load's (weights, dtype): float32 -> (float, float32), q8+bfloat16 -> (q8, bfloat16)."""
    weights, _, dtype = name.partition("+")
    return ("float", weights) if weights in DTYPES else (weights, dtype or "auto")


def modes(text: str | None) -> list[str]:
    from kvcli.engine.model.stored import MODES

    names = [m.strip() for m in text.split(",") if m.strip()] if text else \
        ["float32", "bfloat16", *(m for m in MODES if m != "float"), LLAMACPP]
    for name in names:
        weights, dtype = parse_mode(name)
        if name != LLAMACPP and (weights not in MODES or dtype not in ("auto", *DTYPES)):
            sys.exit(f"bench_llamacpp: --modes {name}: choose {', '.join(DTYPES)}, {', '.join(MODES)}, "
                     f"WEIGHTS+DTYPE (q8+bfloat16) or {LLAMACPP}")
    return names


def label(name: str) -> str:
    if name == LLAMACPP:
        return "llama.cpp"
    weights, dtype = parse_mode(name)
    parts = ([f"`--weights {weights}`"] if weights != "float" else []) + ([f"`--dtype {dtype}`"] if dtype not in ("auto", "float32") else [])
    return "kvcli " + (" ".join(parts) or "float32")


# -- the child: one kvcli mode in a fresh process ------------------------------------------------------------------

def child(cfg_path: str, out_path: str) -> None:
    cfg = json.loads(Path(cfg_path).read_text())
    import torch

    torch.set_num_threads(cfg["threads"])
    import kvcli

    t = time.perf_counter()
    lm = kvcli.load(cfg["model"], weights=cfg.get("weights"), dtype=cfg.get("dtype", "auto"))
    out: dict = {"load_s": time.perf_counter() - t, "ready_s": time.time() - cfg["t0"], "threads": torch.get_num_threads()}
    if cfg.get("load_only"):  # a first load: timed only
        Path(out_path).write_text(json.dumps(out))
        return
    from kvcli.engine.decoding.batch import eos_ids
    from kvcli.engine.scheduling.scheduler import engine_for

    out.update(dtype=str(lm.dtype).removeprefix("torch."), weights_error=lm.fingerprint.get("weights_error"))
    work = Path(cfg["workdir"])
    doc = kvcli.read_document(cfg["doc"])
    if cfg.get("tokens"):  # the first N tokens' text, written once so every mode prefills the same document
        ids = lm.tokenizer(doc.text, add_special_tokens=False)["input_ids"][: cfg["tokens"]]
        cut = work / "doc" / Path(cfg["doc"]).name
        cut.parent.mkdir(exist_ok=True)
        cut.write_text(lm.tokenizer.decode(ids))
        doc = kvcli.read_document(str(cut))
    cache = work / f"{cfg['name']}.kv"
    t = time.perf_counter()
    kvcli.prefill(lm, doc, cache, force=True)
    out["prefill_s"] = time.perf_counter() - t
    out["bytes_on_disk"] = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())
    engine_for(lm).batched  # noqa: B018  the model's one-time batching probe (remembered on disk), not part of a restore
    questions, opts = cfg["questions"], kvcli.GenerationOptions(max_new_tokens=cfg["max_new_tokens"])
    kvcli.Session(lm, cache).ask(questions[0], kvcli.GenerationOptions(max_new_tokens=2))  # warm-up: first calls of the kernels
    runs = []
    for _ in range(cfg["repeats"]):  # each from a fresh restore: Session open, then the first question
        session = kvcli.Session(lm, cache)
        a = session.ask(questions[0], opts)
        n = len(a.answer_token_ids)
        runs.append({"restore_s": session.load_s, "first_token_s": a.ttft_s - session.load_s, "ids": a.answer_token_ids,
                     "decode_ms_per_token": 1000 * (a.total_s - a.ttft_s) / (n - 1) if n > 1 else None})
    for key in ("restore_s", "first_token_s", "decode_ms_per_token"):
        vals = [r[key] for r in runs if r[key] is not None]
        out[key], out[key.removesuffix("_s") + "_runs"] = statistics.median(vals) if vals else None, vals
    out["same_ids_every_run"] = all(r["ids"] == runs[0]["ids"] for r in runs)
    out["answers"] = [runs[0]["ids"]] + [session.ask(q, opts).answer_token_ids for q in questions[1:]]
    doc_ids = list(session.token_ids)
    out["prompt"] = {"document_ids": doc_ids, "eos_ids": sorted(session.eos),
                     "batch_ids": [session.prompt_ids(q)[len(doc_ids):] for q in questions]}
    out["document_tokens"] = len(doc_ids)
    if cfg["generate"]:
        out["generate"] = generate(lm, session, session.prompt_ids(questions[0]), eos_ids(lm.model), cfg)
        out["generate"]["same_ids"] = out["generate"]["ids"] == runs[0]["ids"]
    shutil.rmtree(cache, ignore_errors=True)
    Path(out_path).write_text(json.dumps(out))


def generate(lm, session, prompt: list[int], eos: set[int], cfg: dict) -> dict:
    """transformers' generate() from a DynamicCache of the session's document (bench_decode.generate_ms)."""
    from bench_decode import generate_ms

    states = session.cache.states()
    runs = [generate_ms(lm, states, prompt, cfg["max_new_tokens"], eos) for _ in range(cfg["repeats"] + 1)]  # the first: warm-up
    times = [ms for ms, _ in runs[1:]]
    return {"decode_ms_per_token": statistics.median(times), "decode_ms_per_token_runs": times, "ids": runs[-1][1]}


# -- the parent ------------------------------------------------------------------------------------------------------

def run(cmd: list[str], cfg: dict, name: str, work: Path, env: dict | None = None) -> dict:
    """One fresh process on CONFIG.json; its OUT.json with the process's peak RSS (its maxrss, as /usr/bin/time -v
    reports it: mapped file pages it touched included, for kvcli and llama.cpp alike), or {"error": ...}."""
    path, out = work / f"{name}.json", work / f"{name}-out.json"
    cfg["t0"] = time.time()  # the process's start: "ready" counts interpreter, imports and load
    path.write_text(json.dumps(cfg))
    proc = subprocess.Popen([*cmd, str(path), str(out)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode or not out.is_file():
        lines = [ln for ln in stderr.strip().splitlines() if ln.strip()] or [f"exit {proc.returncode}"]
        print(f"bench_llamacpp: {name} failed: {lines[-1]}", file=sys.stderr)
        return {"error": lines[-1][:200], "peak_rss_mb": usage.ru_maxrss / 1024}
    return {**json.loads(out.read_text()), "peak_rss_mb": usage.ru_maxrss / 1024}


def kept_mb(gguf: str, weights: str) -> float:
    """What KVCLI_HOME keeps for this file in this mode, MB: the converted float32 folder (float, q8, q4), or the
    kernels' prepared tensors (gguf); the small config-and-tokenizer folder in both."""
    from kvcli.engine.model.models import gguf_folders, resolve

    folder, light = gguf_folders(resolve(gguf)["sha256"])
    folders = [light, folder.with_name(folder.name + "-packed")] if weights == "gguf" else [light, folder]
    return sum(f.stat().st_size for d in folders if d.is_dir() for f in d.rglob("*") if f.is_file()) / 1e6


def first_ready(args, n: str, work: Path) -> dict:
    """A load alone in a fresh process and an empty KVCLI_HOME: what a first run pays (hashing the file, reading its
    config and tokenizer, converting or preparing its tensors)."""
    weights, dtype = parse_mode(n)
    home = work / f"home-{n.replace('+', '-')}"
    env = dict(os.environ, KVCLI_HOME=str(home))
    got = run([sys.executable, __file__, "--child"], {"model": args.model, "threads": args.threads, "load_only": True,
                                                      "weights": weights, "dtype": dtype}, f"first-{n}", work, env)
    shutil.rmtree(home, ignore_errors=True)
    return got


def first_load(args, work: Path) -> dict:
    """The first kvcli load of this GGUF converts it into a float32 folder once: timed here when it happens, or
    (--fresh-convert) in a temporary KVCLI_HOME when it already did."""
    from kvcli.engine.model.models import gguf_folders, resolve

    folder = gguf_folders(resolve(args.model)["sha256"])[0]
    done = (folder / "config.json").is_file()
    if done and not args.fresh_convert:
        return {"already": str(folder)}
    env = dict(os.environ, KVCLI_HOME=str(work / "home")) if done else None
    got = run([sys.executable, __file__, "--child"], {"model": args.model, "threads": args.threads, "weights": "float",
                                                      "load_only": True}, "convert", work, env)
    shutil.rmtree(work / "home", ignore_errors=True)
    return {**got, "folder": str(folder), "fresh_home": done}


def run_llamacpp(args, gguf: str, prompt: dict, questions: list[str], work: Path) -> dict:
    longest = max(len(q) for q in prompt["batch_ids"])
    need = len(prompt["document_ids"]) + longest + args.max_new_tokens
    cfg = dict(prompt, gguf=gguf, question_ids=prompt["batch_ids"][0], n_ctx=-(-need // 256) * 256, threads=args.threads,
               workdir=str(work), max_new_tokens=args.max_new_tokens, repeats=args.repeats)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return run([args.llamacpp_python, str(HERE / "llamacpp_run.py")], cfg, LLAMACPP, work, env)


def render(r: dict) -> str:
    names, cols, ref = r["modes"], r["results"], r["reference"]
    tokens = next((c["document_tokens"] for c in cols.values() if "document_tokens" in c), "?")
    ll = cols.get(LLAMACPP, {})
    head = [label(n) + (f" ({ll['model_type']})" if n == LLAMACPP and "model_type" in ll else "") for n in names]
    lines = ["| | " + " | ".join(head) + " |", "|---|" + "---:|" * len(names)]

    def row(title: str, get, fmt: str) -> None:
        cells = []
        for n in names:
            c = cols[n]
            try:
                v = get(c, n)
            except (KeyError, TypeError, ZeroDivisionError):
                v = None
            cells.append(("failed" if "error" in c else "-") if v is None else fmt.format(v) if not isinstance(v, str) else v)
        lines.append(f"| {title} | " + " | ".join(cells) + " |")

    def agree(c: dict, n: str) -> list[tuple[int, int, bool]]:
        mine = c["sequential"]["ids"] if n == LLAMACPP else c["answers"]
        return [(common_prefix(a, b), len(a), a == b) for a, b in zip(cols[ref]["answers"], mine)]

    row("model dtype", lambda c, n: "file's types, f16 KV" if n == LLAMACPP else c["dtype"], "{}")
    if r.get("first"):
        row("model ready, first run (fresh process, empty KVCLI_HOME), s",
            lambda c, n: c["ready_s"] if n == LLAMACPP else r["first"][n]["ready_s"], "{:.2f}")
        row("peak memory of that first load (RSS), MB",
            lambda c, n: c["peak_rss_mb"] if n == LLAMACPP else r["first"][n]["peak_rss_mb"], "{:.0f}")
    row("model ready in a fresh process, s", lambda c, n: c["ready_s"], "{:.2f}")
    row("kept in KVCLI_HOME for the model, MB", lambda c, n: 0.0 if n == LLAMACPP else c["kept_mb"], "{:.1f}")
    row(f"prefill of the document ({tokens:,} tokens), s" if isinstance(tokens, int) else "prefill, s",
        lambda c, n: c["prefill_s"] + c["save_s"] if n == LLAMACPP else c["prefill_s"], "{:.2f}")
    row("on disk (cache folder / state file), MB", lambda c, n: c["bytes_on_disk"] / 1e6, "{:.1f}")
    row("session open / restore (state load), s", lambda c, n: c["restore_s"], "{:.3f}")
    row("first token from the cache (warm), s",
        lambda c, n: c["one"]["first_token_s"] if n == LLAMACPP else c["first_token_s"], "{:.3f}")
    row(f"decode, ms a token (median of {r['repeats']})",
        lambda c, n: c["one"]["decode_ms_per_token"] if n == LLAMACPP else c["decode_ms_per_token"], "{:.1f}")
    if r["generate"]:
        row("transformers generate() decode, ms a token", lambda c, n: c["generate"]["decode_ms_per_token"], "{:.1f}")
    row("peak memory (RSS: maxrss of the process, mapped pages included), MB", lambda c, n: c["peak_rss_mb"], "{:.0f}")
    n_q = len(r["questions"])
    row(f"answers identical to {label(ref)}'s tokens", lambda c, n: f"{sum(s for _, _, s in agree(c, n))} of {n_q}", "{}")
    row("common prefix, tokens, per question", lambda c, n: " ".join(f"{p}/{m}" for p, m, _ in agree(c, n)), "{}")

    m, conv = r["machine"], r["convert"]
    notes = [""]
    if conv.get("already") == "-":
        pass  # no float mode measured: nothing converted
    elif "already" in conv:
        notes.append(f"first load (converts): already converted in {conv['already']} (--fresh-convert times it again)")
    elif "error" in conv:
        notes.append(f"first load (converts): failed: {conv['error']}")
    else:
        notes.append(f"first load (converts the GGUF once into a float32 folder{', in a temporary KVCLI_HOME' if conv['fresh_home'] else ''}):"
                     f" {conv['ready_s']:.1f} s in a fresh process (kvcli.load {conv['load_s']:.1f} s)")
    notes.append(f"model: {r['model']}; {n_q} questions, up to {r['max_new_tokens']} new tokens, greedy; agreement against "
                 f"{label(ref)} (common prefix / its answer's length)")
    for n in names:
        c = cols[n]
        if "error" in c:
            notes.append(f"{label(n)}: failed: {c['error']}")
        elif n == LLAMACPP:
            notes.append(f"llama.cpp: llama-cpp-python {c['version']}, {c['model_type']}, n_ctx {c['n_ctx']}, n_batch {c['n_batch']}, "
                         f"prefill = eval {c['prefill_s']:.2f} s + state file {c['save_s']:.2f} s; decode runs "
                         f"{', '.join(f'{x:.1f}' for x in c['one']['decode_ms_per_token_runs'])} ms; {c['system_info']}")
        else:
            extra = [f"decode runs {', '.join(f'{x:.1f}' for x in c['decode_ms_per_token_runs'])} ms",
                     f"restore runs {', '.join(f'{x:.3f}' for x in c['restore_runs'])} s"]
            extra += [f"new folders under KVCLI_HOME: {', '.join(c['prepared'])}"] if c.get("prepared") else []
            extra += ["generate() tokens " + ("identical" if c["generate"]["same_ids"] else "differ")] if "generate" in c else []
            extra += [f"weights error {c['weights_error']}"] if c.get("weights_error") else []
            extra += [c["warning"]] if c.get("warning") else []
            notes.append(f"{label(n)}: " + "; ".join(extra))
    threads = {c.get("threads") for c in cols.values() if c.get("threads")}
    notes += [f"CPU: {m['cpu']['model']}, {m['cpu']['cores']} cores; flags: {' '.join(m['cpu']['flags']) or '-'}; "
              f"threads {'/'.join(map(str, sorted(threads)))}",
              f"load average before {m['load_before']}, after {m['load_after']} (a shared machine makes every time noisy)"
              + (f"; {m['busy']} busy-looping process(es) beside the whole run" if m.get("busy") else "")]
    return "\n".join(lines + notes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a .gguf file (default: kvcli's default model file)")
    ap.add_argument("--modes", default=None, help="comma list (default: float32, bfloat16, each --weights mode, llamacpp)")
    ap.add_argument("--weights", help="one weights mode beside llama.cpp: --modes WEIGHTS,llamacpp (float: float32)")
    ap.add_argument("--doc", default=str(SAMPLES / "document.txt"))
    ap.add_argument("--tokens", type=int, default=None, help="the document's first N tokens only")
    ap.add_argument("--questions", type=int, default=4, help="questions answered one after another (default 4)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="restores (each with the first question) per mode; medians")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="threads of each side (default: the CPU's cores)")
    ap.add_argument("--generate", action="store_true", help="also transformers' generate() on each mode's model and cache")
    ap.add_argument("--fresh-convert", action="store_true", help="time the GGUF's conversion even when it is already done")
    ap.add_argument("--first", action="store_true", help="also each kvcli mode's first load, in an empty KVCLI_HOME")
    ap.add_argument("--llamacpp-python", default=os.environ.get("KVCLI_LLAMACPP_PYTHON")
                    or f"{os.environ.get('KVCLI_LLAMACPP_VENV', '/opt/kvcli-llamacpp-venv')}/bin/python")
    ap.add_argument("--busy", type=int, default=0, help="busy-looping processes beside the whole run")
    ap.add_argument("--json", action="store_true", help="print the whole result as JSON instead of the table")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(*args.child)
    if args.model and Path(args.model).suffix != ".gguf":
        sys.exit(f"bench_llamacpp: --model {args.model}: a .gguf file (llama.cpp runs the same file)")
    names = modes(args.modes or (f"{args.weights.replace('float', 'float32')},{LLAMACPP}" if args.weights else None))
    if LLAMACPP in names and not Path(args.llamacpp_python).is_file():
        sys.exit(f"bench_llamacpp: no llama.cpp python at {args.llamacpp_python}: run .ci/llamacpp-up "
                 f"(or set KVCLI_LLAMACPP_PYTHON), or leave {LLAMACPP} out of --modes")
    from kvcli.engine.model.models import default_gguf_path

    gguf = str(Path(args.model).resolve()) if args.model else str(default_gguf_path())
    base = [q.strip() for q in (SAMPLES / "questions.txt").read_text().splitlines() if q.strip() and not q.startswith("#")]
    questions = ((base + EXTRA) * 4)[: args.questions]
    kv = [n for n in names if n != LLAMACPP]
    ref = "float32" if "float32" in kv else (kv[0] if kv else None)
    if ref is None:
        sys.exit("bench_llamacpp: --modes needs a kvcli mode (the prompt ids and the reference answers)")
    result: dict = {"machine": {"cpu": cpu(), "load_before": [round(x, 2) for x in os.getloadavg()]}, "model": gguf,
                    "modes": names, "reference": ref, "questions": questions, "max_new_tokens": args.max_new_tokens,
                    "repeats": args.repeats, "tokens": args.tokens, "generate": args.generate, "results": {}, "first": {}}
    busy = [subprocess.Popen([sys.executable, "-c", BUSY, str(os.getpid())]) for _ in range(args.busy)]  # beside every side
    result["machine"]["busy"] = args.busy
    try:
        measure(args, result, names, kv, ref, gguf, questions)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    result["machine"]["load_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result) if args.json else render(result))


def measure(args, result: dict, names: list[str], kv: list[str], ref: str, gguf: str, questions: list[str]) -> None:
    """Each kvcli mode in a fresh process, then llama.cpp, into result["results"]."""
    from kvcli.home import kvcli_home

    with tempfile.TemporaryDirectory(prefix="kvcli-bench-llamacpp-") as tmp:
        work = Path(tmp)
        result["convert"] = first_load(args, work) if any(parse_mode(k)[0] != "gguf" for k in kv) else {"already": "-"}
        for n in kv if args.first else []:
            result["first"][n] = first_ready(args, n, work)
        doc, cut = args.doc, work / "doc" / Path(args.doc).name
        home = kvcli_home() / "models"
        for n in [ref] + [k for k in kv if k != ref]:  # the reference first: its cut document and ids serve the rest
            weights, dtype = parse_mode(n)
            before = set(os.listdir(home)) if home.is_dir() else set()
            cfg = {"model": args.model, "weights": weights, "dtype": dtype, "name": n.replace("+", "-"), "workdir": tmp,
                   "doc": str(cut) if cut.is_file() else doc, "tokens": None if cut.is_file() else args.tokens,
                   "questions": questions, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
                   "threads": args.threads, "generate": args.generate}
            warm = run([sys.executable, __file__, "--child"], {**cfg, "load_only": True}, f"warm-{cfg['name']}", work)
            got = run([sys.executable, __file__, "--child"], cfg, cfg["name"], work)  # "ready": a later load, as users meet it
            got["prepared"] = sorted(set(os.listdir(home)) - before) if home.is_dir() else []  # one-time work, in the warm-up
            got["warm_ready_s"] = warm.get("ready_s")
            got["kept_mb"] = kept_mb(gguf, weights)
            result["results"][n] = got
        prompt = result["results"][ref].get("prompt")
        for n in kv:
            c = result["results"][n]
            if "prompt" in c and prompt and c["prompt"] != prompt:
                c["warning"] = "framed other prompt ids than the reference: its agreement compares other prompts"
            c.pop("prompt", None)
        if LLAMACPP in names:
            result["results"][LLAMACPP] = (run_llamacpp(args, gguf, prompt, questions, work) if prompt
                                           else {"error": "no prompt ids: the reference mode failed"})


if __name__ == "__main__":
    main()
