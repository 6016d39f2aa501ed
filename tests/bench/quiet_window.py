"""One run of the side-by-side figures for docs/performance.md (a script, not collected): kvcli against llama.cpp on
the same GGUF files and ids, against transformers' own decode, and against kvcli 0.2, once on a quiet machine and once
beside one busy process. About 20 minutes on a 2-core machine; nothing else should run meanwhile.

    export KVCLI_LLAMACPP_PYTHON=/opt/kvcli-llamacpp-venv/bin/python
    python tests/bench/quiet_window.py --small-model A.gguf --large-model B.gguf \\
        --old-tree /path/to/kvcli-0.2 --old-python /path/to/venv-0.2/bin/python [--out DIR] [--quick]

Each pass (quiet, then beside `python -c 'while True: pass'`) runs, each in fresh processes:
- tests/bench/bench_llamacpp.py on --small-model: kvcli float32, kvcli gguf and llama.cpp; the first load in an
  empty KVCLI_HOME (quiet pass only: it is the same one-time work), a fresh load, kept disk, prefill, restore +
  first token, decode (medians of the repeats), peak RSS (the process's maxrss, what /usr/bin/time -v reports),
  and transformers' generate() on each kvcli model;
- the same on --large-model for kvcli gguf and llama.cpp (float32 would not fit);
- tests/bench/bench_versions.py: this checkout against --old-tree on the default model (0.2 reads no GGUF); beside
  the busy process it is stopped after --versions-cap seconds (0.2's probe ran over 7 minutes there in a trial).
Every benchmark's JSON and stderr go to --out; the combined Markdown tables go to OUT/tables.md and stdout. --quick
runs every step on tiny settings (a check of the script, minutes; its figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
BUSY = "while True: pass"

# (tokens, questions, max new tokens, repeats) per model; --quick's below
FULL = {"small": (2048, 2, 32, 3), "large": (512, 1, 16, 2), "rounds": 2}
QUICK = {"small": (128, 1, 4, 1), "large": (64, 1, 2, 1), "rounds": 1}
TARGETS = {"ready": 3.0, "rss": 1.5, "prefill": 0.8, "decode": 1.25}  # the most kvcli gguf / llama.cpp


def llamacpp_cmd(model: str, modes: str, sizes: tuple, generate: bool, first: bool) -> list[str]:
    tokens, questions, new, repeats = sizes
    return [sys.executable, str(HERE / "bench_llamacpp.py"), "--model", model, "--modes", modes, "--tokens", str(tokens),
            "--questions", str(questions), "--max-new-tokens", str(new), "--repeats", str(repeats), "--json",
            *(["--first"] if first else []), *(["--generate"] if generate else [])]


def step(name: str, cmd: list[str], out: Path, timeout: float) -> dict:
    """Run one benchmark; its last stdout line parsed as JSON, or {"error": ...}. Output kept under `out`."""
    t = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        got = {"error": f"timed out after {timeout:.0f} s"}
    else:
        (out / f"{name}.stderr").write_text(proc.stderr)
        lines = proc.stdout.strip().splitlines()
        try:
            got = json.loads(lines[-1]) if proc.returncode == 0 and lines else {"error": f"exit {proc.returncode}"}
        except json.JSONDecodeError:
            got = {"error": "no JSON on stdout"}
    got["wall_s"] = time.time() - t
    (out / f"{name}.json").write_text(json.dumps(got))
    print(f"quiet_window: {name} done in {got['wall_s']:.0f} s{' (' + got['error'] + ')' if 'error' in got else ''}",
          file=sys.stderr, flush=True)
    return got


def one_pass(args, sizes: dict, busy: int, out: Path) -> dict:
    loops = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(busy)]
    tag = "busy" if busy else "quiet"
    got: dict = {"load_before": os.getloadavg()}
    try:
        got["small"] = step(f"{tag}-small", llamacpp_cmd(args.small_model, "float32,gguf,llamacpp", sizes["small"], True,
                                                         not busy), out, 900)
        got["large"] = step(f"{tag}-large", llamacpp_cmd(args.large_model, "gguf,llamacpp", sizes["large"], False, not busy),
                            out, 900)
        if args.old_tree:  # capped beside a busy process: a version whose threads wait on a descheduled one can take long
            got["versions"] = step(f"{tag}-versions", [sys.executable, str(HERE / "bench_versions.py"), "--other", args.old_tree,
                                                       "--other-python", args.old_python, "--rounds", str(sizes["rounds"]),
                                                       "--json"], out, args.versions_cap if busy else 900)
    finally:
        for p in loops:
            p.kill()
            p.wait()
    got["load_after"] = os.getloadavg()
    return got


# -- the tables ------------------------------------------------------------------------------------------------------

def _get(d: dict, *keys):
    for k in keys:
        if not isinstance(d, dict) or k not in d or d[k] is None:
            return None
        d = d[k]
    return d


def _fmt(v, f: str) -> str:
    return "-" if v is None else f.format(v)


def model_rows(r: dict) -> list[tuple[str, dict, str]]:
    """(title, {mode: value}, format) for one bench_llamacpp result."""
    res, first = r.get("results", {}), r.get("first", {})
    ll = res.get("llamacpp", {})
    rows = []

    def per_mode(title: str, kv, llama, fmt: str) -> None:
        vals = {m: kv(c, m) for m, c in res.items() if m != "llamacpp"}
        vals["llamacpp"] = llama(ll) if ll and "error" not in ll else None
        rows.append((title, vals, fmt))

    per_mode("model ready, first run (empty KVCLI_HOME), s", lambda c, m: _get(first, m, "ready_s"), lambda c: _get(c, "ready_s"),
             "{:.2f}")
    per_mode("peak RSS of that first run, MB", lambda c, m: _get(first, m, "peak_rss_mb"), lambda c: _get(c, "peak_rss_mb"),
             "{:,.0f}")
    per_mode("model ready, fresh process, s", lambda c, m: _get(c, "ready_s"), lambda c: _get(c, "ready_s"), "{:.2f}")
    per_mode("peak RSS, MB", lambda c, m: _get(c, "peak_rss_mb"), lambda c: _get(c, "peak_rss_mb"), "{:,.0f}")
    per_mode("kept in KVCLI_HOME for the model, MB", lambda c, m: _get(c, "kept_mb"), lambda c: 0.0, "{:,.1f}")
    tokens = next((c.get("document_tokens") for c in res.values() if c.get("document_tokens")), None)
    per_mode(f"prefill ({tokens:,} tokens), s" if tokens else "prefill, s", lambda c, m: _get(c, "prefill_s"),
             lambda c: (c["prefill_s"] + c.get("save_s", 0)) if "prefill_s" in c else None, "{:.2f}")
    per_mode("restore + first token, s",
             lambda c, m: c["restore_s"] + c["first_token_s"] if "restore_s" in c and "first_token_s" in c else None,
             lambda c: c["restore_s"] + c["one"]["first_token_s"] if "restore_s" in c and "one" in c else None, "{:.3f}")
    per_mode("decode, ms a token", lambda c, m: _get(c, "decode_ms_per_token"), lambda c: _get(c, "one", "decode_ms_per_token"),
             "{:.1f}")
    per_mode("transformers generate() decode on the same model, ms a token",
             lambda c, m: _get(c, "generate", "decode_ms_per_token"), lambda c: None, "{:.1f}")
    return rows


RATIO_TARGET = {"model ready, fresh process, s": TARGETS["ready"], "model ready, first run (empty KVCLI_HOME), s": TARGETS["ready"],
                "peak RSS, MB": TARGETS["rss"], "peak RSS of that first run, MB": TARGETS["rss"],
                "decode, ms a token": TARGETS["decode"]}


def model_table(title: str, passes: dict, key: str, file_mb: float) -> list[str]:
    modes = [m for m in ("float32", "gguf", "llamacpp") if any(m in _get(p, key, "results") or {} for p in passes.values())]
    names = {"float32": "kvcli float32", "gguf": "kvcli gguf", "llamacpp": "llama.cpp"}
    head = ["", *(f"{names[m]} ({tag})" for tag in passes for m in modes), *(f"gguf / llama.cpp ({tag})" for tag in passes),
            "target"]
    lines = [f"**{title}** (file {file_mb:,.0f} MB)", "", "| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    rows = {tag: model_rows(p.get(key, {})) for tag, p in passes.items()}
    for i, (name, _, fmt) in enumerate(next(iter(rows.values()))):
        cells = [_fmt(rows[tag][i][1].get(m), fmt) for tag in passes for m in modes]
        for tag in passes:
            v = rows[tag][i][1]
            g, ll = v.get("gguf"), (file_mb if name.startswith("kept") else v.get("llamacpp"))
            cells.append(f"{g / ll:.2f}x" + (" the file" if name.startswith("kept") else "") if g is not None and ll else "-")
        target = RATIO_TARGET.get(name) or (TARGETS["prefill"] if name.startswith("prefill") else None)
        if name.startswith("kept"):
            target_text = "1.3x the file"
        else:
            target_text = f"<= {target}x" if target else ""
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {target_text} |")
    for tag, p in passes.items():
        r = p.get(key, {})
        for m, c in {**r.get("results", {}), **{f"first {k}": v for k, v in r.get("first", {}).items()}}.items():
            if isinstance(c, dict) and "error" in c:
                lines.append(f"\n{tag}, {m}: failed: {c['error']}")
        if "error" in r:
            lines.append(f"\n{tag}: the benchmark failed: {r['error']}")
    return lines


def versions_table(passes: dict) -> list[str]:
    keys = [("ttft_s", "restore + first token, s", "{:.3f}"), ("decode_ms", "decode, ms a token", "{:.1f}"),
            ("batch8_s", "8 questions batched, s", "{:.2f}"), ("batch16_s", "16 questions batched, s", "{:.2f}"),
            ("serial8_s", "8 questions one by one, s", "{:.2f}")]
    head = ["", *(f"{side} ({tag})" for tag in passes for side in ("kvcli 0.2", "this")), *(f"this / 0.2 ({tag})" for tag in passes)]
    lines = ["**kvcli 0.2 against this checkout**, the default model (float32; 0.2 reads no GGUF), the sample document",
             "", "| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for k, title, fmt in keys:
        cells = []
        for tag, p in passes.items():
            med = _get(p, "versions", "median") or {}
            cells += [_fmt(_get(med, "other", k), fmt), _fmt(_get(med, "here", k), fmt)]
        for tag, p in passes.items():
            cells.append(_fmt(_get(p, "versions", "ratio_here_to_other", k), "{:.2f}x"))
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    for tag, p in passes.items():
        if "error" in (p.get("versions") or {}):
            lines.append(f"\n{tag}: bench_versions failed: {p['versions']['error']}")
    return lines


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


def render(args, passes: dict, commit: str) -> str:
    size = {k: Path(getattr(args, f"{k}_model")).stat().st_size / 1e6 for k in ("small", "large")}
    out = [f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {cpu_name()}, {os.cpu_count()} cores, kvcli at "
           f"{commit}, with `python tests/bench/quiet_window.py {' '.join(args.argv)}`. "
           "\"quiet\": nothing else running (llama.cpp's first run is its fresh run: it keeps nothing); "
           "\"busy\": beside one `python -c 'while True: pass'`. Each figure is one fresh process per mode; restore + "
           "first token and decode are medians of the repeats; peak RSS is the process's maxrss (as /usr/bin/time -v "
           "reports it, mapped file pages included). Load average before/after each pass: "
           + "; ".join(f"{tag} {tuple(round(x, 2) for x in p['load_before'])} / {tuple(round(x, 2) for x in p['load_after'])}"
                       for tag, p in passes.items()) + ".", ""]
    out += model_table(Path(args.small_model).name, passes, "small", size["small"]) + [""]
    out += model_table(Path(args.large_model).name, passes, "large", size["large"]) + [""]
    if args.old_tree:
        out += versions_table(passes) + [""]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small-model", required=True, help="a small GGUF (e.g. a 0.5B); kvcli float32 runs it too")
    ap.add_argument("--large-model", required=True, help="a large GGUF (e.g. 7B-shaped); gguf mode and llama.cpp only")
    ap.add_argument("--old-tree", help="a kvcli 0.2 checkout (bench_versions.py --other); left out: no version table")
    ap.add_argument("--old-python", default=sys.executable, help="its venv's python")
    ap.add_argument("--out", default=None, help="folder for every benchmark's JSON and the tables (default: a new temp one)")
    ap.add_argument("--busy", default="0,1", help="busy processes per pass (default 0,1: quiet, then beside one)")
    ap.add_argument("--versions-cap", type=float, default=240, help="seconds bench_versions may take beside a busy process")
    ap.add_argument("--quick", action="store_true", help="tiny settings: checks the script, its figures mean nothing")
    ap.add_argument("--render", action="store_true", help="only render OUT's JSON again")
    args = ap.parse_args()
    args.argv = sys.argv[1:]
    out = Path(args.out) if args.out else Path(f"/tmp/kvcli-quiet-window-{time.strftime('%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    passes: dict = {}
    if args.render:  # the run's own command line, not this one
        record = json.loads((out / "passes.json").read_text())
        passes, args.argv = record["passes"], record["argv"]
    else:
        sizes = QUICK if args.quick else FULL
        for busy in [int(b) for b in args.busy.split(",")]:
            tag = "busy" if busy else "quiet"
            passes[tag] = one_pass(args, sizes, busy, out)
            (out / "passes.json").write_text(json.dumps({"argv": args.argv, "passes": passes}))
    text = render(args, passes, commit)
    (out / "tables.md").write_text(text)
    print(text)
    print(f"quiet_window: everything is in {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
