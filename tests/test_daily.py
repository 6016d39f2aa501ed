"""kvcli as a daily tool: early validation, pipes, collisions, rm/prune/ls, model errors, count,
anti-repetition options (still exact), terminal-only headings and timings."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kvcli
from tests.conftest import sample_text
from tests.helpers import assert_clean_error, error_lines, json_lines, run, run_python

HEAVY = ("torch", "transformers", "safetensors", "numpy")


@pytest.fixture(scope="module")
def doc_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("daily") / "lic.txt"
    path.write_text(sample_text()[:2500], encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def cache_dir(doc_file, tiny_model_dir):
    result = run("prefill", doc_file, "--model", tiny_model_dir)
    assert result.exit_code == 0, result.stderr
    return doc_file.with_suffix(".kv")


def _in_subprocess(argv: list[str]) -> dict:
    """Run the CLI in a fresh interpreter; report exit code, stderr and which heavy modules got imported."""
    code = (
        "import io, json, sys\n"
        "from contextlib import redirect_stderr\n"
        "from kvcli.cli import app\n"
        "err = io.StringIO()\n"
        "try:\n"
        f"    with redirect_stderr(err):\n        app({argv!r}, prog_name='kvcli')\n"
        "    code = 0\n"
        "except SystemExit as e:\n    code = e.code or 0\n"
        f"print(json.dumps({{'code': code, 'stderr': err.getvalue(), 'heavy': [m for m in {HEAVY!r} if m in sys.modules]}}))\n"
    )
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- 1. validate before loading anything


@pytest.mark.parametrize("args, needles", [
    (["prefill", "{doc}", "--device", "tpu"], ["tpu", "auto", "cpu", "cuda", "mps"]),
    (["prefill", "{doc}", "--dtype", "int8"], ["int8", "float32", "bfloat16", "float16"]),
    (["prefill", "{doc}", "--framing", "weird"], ["weird", "chat", "plain"]),
    (["prefill", "{doc}", "--encoding", "nosuch"], ["nosuch", "utf-8"]),
    (["ask", "Who?"], ["--cache"]),
    (["ask", "-c", "{cache}", ""], ["empty"]),
    (["ask", "-c", "{cache}", "Who?", "   "], ["question 2 is empty"]),
    (["ask", "-c", "{cache}", "--dtype", "auto", "Q?"], ["float32"]),
    (["count", "{doc}", "--framing", "weird"], ["chat", "plain"]),
    (["bench", "{doc}", "--device", "tpu"], ["cuda"]),
])
def test_bad_options_are_usage_errors_before_any_model_loads(doc_file, cache_dir, args, needles):
    argv = [a.format(doc=doc_file, cache=cache_dir) for a in args]
    result = run(*argv)
    assert result.exit_code == 2, (result.exit_code, result.stderr)
    assert result.stdout == "" and "Traceback" not in result.stderr
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr)
    fresh = _in_subprocess(argv)
    assert fresh["code"] == 2 and fresh["heavy"] == [], fresh  # refused before torch/transformers were imported


def test_empty_question_on_stdin_is_a_usage_error(cache_dir):
    assert_clean_error(run("ask", "-c", cache_dir, input="  \n"), 2, "no question")


def test_help_shows_choices_and_no_type_labels():
    for cmd in ("prefill", "ask", "chat", "count", "info", "verify", "ls", "rm", "prune", "bench", "serve", "ps"):
        result = run(cmd, "--help")
        assert result.exit_code == 0, result.stderr
        for label in ("<bool>", "<list[", "<str>", "<path>", "<int>", "<int range>", "<float>", "<float range>", "<Path"):
            assert label not in result.stdout, (cmd, label, result.stdout)
    text = run("prefill", "--help").stdout
    assert "<auto|cpu|cuda|mps>" in text and "<auto|float32|bfloat16|float16>" in text and "<auto|chat|plain>" in text
    assert "DOC..." in text


def test_help_texts_say_what_each_command_takes():
    helps = {cmd: run(cmd, "--help") for cmd in ("prefill", "ask", "chat", "count", "bench", "serve", "rm", "verify")}
    assert all(h.exit_code == 0 for h in helps.values())
    text = {cmd: " ".join(h.stdout.split()) for cmd, h in helps.items()}
    usage = {cmd: h.stdout.splitlines()[0] for cmd, h in helps.items()}
    assert all("{" not in line for line in usage.values()), usage
    assert usage["rm"].endswith(" CACHE...") and usage["verify"].endswith(" CACHE...") and usage["count"].endswith(" DOC...")
    assert usage["prefill"].endswith(" [DOC]...") and usage["ask"].endswith(" [QUESTION]...")
    for cmd in ("ask", "chat"):  # the range shown is the range accepted: 0 is refused
        assert "0.0<x<=1.0" in text[cmd] and "0.0<=x" not in text[cmd]
        assert "the model the cache was built with" in text[cmd] and "$KVCLI_MODEL" not in text[cmd]
    for cmd in ("prefill", "count", "bench"):
        assert "$KVCLI_MODEL" in text[cmd] and "for ask" not in text[cmd]
    assert "above: 400" not in text["serve"] and "refused with HTTP 400" in text["serve"]
    assert not [cmd for cmd, t in text.items() if "measured" in t or re.search(r"\d\.?\d*x faster", t)]  # no benchmark figures
    assert "-f, --force" not in text["prefill"] and "-f, --questions-file" in text["ask"]
    assert ".txt" in text["prefill"] and "MPL-2.0.kv" in text["prefill"]
    assert_clean_error(run("prefill", "doc.txt", "-f"), 2, "-f")


# ---- 2. pipes


def _closed_pipe_run(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    """Run `python -m kvcli ARGS` with stdout a pipe whose reader has already gone (as after `| head -1`)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
        return subprocess.run([sys.executable, "-m", "kvcli", *map(str, args)], stdout=write_end, stderr=subprocess.PIPE,
                              stdin=subprocess.DEVNULL, text=True, timeout=timeout, env=env)
    finally:
        os.close(write_end)


def test_closed_stdout_ends_info_quietly(cache_dir):
    proc = _closed_pipe_run(["info", cache_dir])
    assert proc.returncode == 141 and proc.stderr == "", (proc.returncode, proc.stderr)


def test_closed_stdout_ends_ask_quietly_and_stops_the_work(cache_dir, tmp_path):
    qfile = tmp_path / "q.txt"
    qfile.write_text("\n".join(f"Question number {i}?" for i in range(200)), encoding="utf-8")
    for extra in (["--json"], []):  # how long it takes is measured by tests/bench/bench_pipes.py, not bounded here
        proc = _closed_pipe_run(["ask", "-c", cache_dir, "-f", qfile, "--max-new-tokens", "64", *extra])
        assert proc.returncode == 141 and proc.stderr == "", (extra, proc.returncode, proc.stderr)


def test_broken_pipe_through_the_runner(cache_dir, monkeypatch):
    from kvcli.cli import output

    def gone(self, text):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(output.Output, "write", gone)
    result = run("ask", "-c", cache_dir, "--json", "Q?", "--max-new-tokens", "3")
    assert result.exit_code == 141 and result.stderr == "" and result.stdout == ""
    result = run("verify", cache_dir, "--json")
    assert result.exit_code == 141 and result.stderr == ""


# ---- 3. collisions and housekeeping


def test_prefill_output_collision_is_refused_before_any_work(tmp_path, tiny_model_dir):
    for sub in ("d1", "d2"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "lic.txt").write_text(f"Document {sub} about licences.", encoding="utf-8")
    out = tmp_path / "coll"
    result = run("prefill", tmp_path / "d1/lic.txt", tmp_path / "d2/lic.txt", "-o", out, "--force", "--model", tiny_model_dir)
    line = assert_clean_error(result, 2, "d1/lic.txt", "d2/lic.txt", "lic.kv")
    assert "both" in line and not out.exists()


def test_cache_names_keep_every_dot_but_a_text_extension(tmp_path, tiny_model_dir):
    for name in ("MPL-2.0", "LGPL-2", "LGPL-2.1", "notes.MD"):
        (tmp_path / name).write_text(f"The licence called {name}, in a few words.", encoding="utf-8")
    one = run("prefill", tmp_path / "MPL-2.0", "--model", tiny_model_dir)
    assert one.exit_code == 0, one.stderr
    several = run("prefill", tmp_path / "LGPL-2", tmp_path / "LGPL-2.1", tmp_path / "notes.MD", "--model", tiny_model_dir)
    assert several.exit_code == 0, several.stderr
    assert sorted(p.name for p in tmp_path.glob("*.kv")) == ["LGPL-2.1.kv", "LGPL-2.kv", "MPL-2.0.kv", "notes.kv"]
    asked = run("ask", "--cache", tmp_path / "MPL-2.0.kv", "--model", tiny_model_dir, "--max-new-tokens", "2", "Which licence?")
    assert asked.exit_code == 0, asked.stderr


def test_output_folder_for_several_documents_is_created(tmp_path, tiny_model_dir, doc_file):
    other = tmp_path / "other.txt"
    other.write_text("A short document about ducks and ponds.", encoding="utf-8")
    out = tmp_path / "new" / "sub"
    result = run("prefill", doc_file, other, "-o", out, "--model", tiny_model_dir)
    assert result.exit_code == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["lic.kv", "other.kv"]
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert_clean_error(run("prefill", doc_file, other, "-o", afile, "--model", tiny_model_dir), 2, "afile", "folder")


def test_rm_removes_a_cache(cache_dir, tmp_path):
    copy = tmp_path / "copy.kv"
    shutil.copytree(cache_dir, copy)
    result = run("rm", copy)
    assert result.exit_code == 0 and result.stdout == "" and "removed" in result.stderr and str(copy) in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_rm_one_cache_named_twice_removes_it_once(cache_dir, tmp_path, monkeypatch):
    copy = tmp_path / "copy.kv"
    shutil.copytree(cache_dir, copy)
    monkeypatch.chdir(tmp_path)
    result = run("rm", "copy.kv", copy, "./copy.kv/")
    assert result.exit_code == 0, result.stderr
    assert result.stderr.count("removed") == 1 and not copy.exists()


def _not_caches(tmp_path: Path, cache_dir: Path) -> dict[str, tuple[Path, str]]:
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "todo.txt").write_text("keep me")
    afile = tmp_path / "file.kv"
    afile.write_text("not a cache")
    link = tmp_path / "link.kv"
    link.symlink_to(cache_dir)
    extra = tmp_path / "extra.kv"
    shutil.copytree(cache_dir, extra)
    (extra / "mine.txt").write_text("someone's file")
    fake = tmp_path / "fake.kv"
    fake.mkdir()
    (fake / "manifest.json").write_text('{"format": "something-else"}')
    return {"folder": (folder, "not a kvcli cache"), "file": (afile, "file"), "link": (link, "symbolic link"),
            "extra": (extra, "mine.txt"), "fake": (fake, "not a kvcli manifest"), "missing": (tmp_path / "gone.kv", "no such")}


@pytest.mark.parametrize("kind", ["folder", "file", "link", "extra", "fake", "missing"])
def test_rm_refuses_anything_but_a_cache_and_then_removes_nothing(cache_dir, tmp_path, kind):
    target, needle = _not_caches(tmp_path, cache_dir)[kind]
    keep = tmp_path / "keep.kv"
    shutil.copytree(cache_dir, keep)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert_clean_error(run("rm", keep, target), 1, str(target), needle, "refusing")
    assert sorted(p.name for p in tmp_path.rglob("*")) == before and (cache_dir / "manifest.json").is_file()


def test_prune_clears_dead_leftovers_and_old_caches(cache_dir, tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    stale = tmp_path / f".a.kv.kvtmp-{dead}-deadbeef"
    stale.mkdir()
    (stale / "layer_000.safetensors.zst").write_bytes(b"x" * 100)
    live = tmp_path / f".b.kv.kvtmp-{os.getpid()}-cafef00d"  # this process is alive: its folder is in use
    live.mkdir()
    old, new = tmp_path / "old.kv", tmp_path / "new.kv"
    shutil.copytree(cache_dir, old)
    shutil.copytree(cache_dir, new)
    week_ago = time.time() - 8 * 86400
    os.utime(old / "manifest.json", (week_ago, week_ago))

    dry = run("prune", tmp_path, "--older-than", "7d", "--dry-run")
    assert dry.exit_code == 0, dry.stderr
    assert sorted(dry.stdout.splitlines()) == sorted([str(stale), str(old)]) and "would remove 1 cache and 1 leftover" in dry.stderr
    assert stale.exists() and old.exists()

    leftovers_only = run("prune", tmp_path, "--json")
    assert leftovers_only.exit_code == 0
    assert [(r["path"], r["kind"]) for r in json_lines(leftovers_only.stdout)] == [(str(stale), "leftover")]
    assert not stale.exists() and old.exists() and live.exists()

    result = run("prune", tmp_path, "--older-than", "7d")
    assert result.exit_code == 0 and result.stdout.splitlines() == [str(old)]
    assert not old.exists() and new.exists() and live.exists()


@pytest.mark.parametrize("age", ["7", "d", "3x", "-1d"])
def test_prune_bad_age_is_a_usage_error(tmp_path, age):
    assert_clean_error(run("prune", tmp_path, "--older-than", age), 2, "--older-than", "30d")


def test_ls_says_when_there_is_no_cache_and_shows_documents(cache_dir, tmp_path):
    empty = run("ls", tmp_path)
    assert empty.exit_code == 0 and empty.stdout == "" and "no kvcli cache" in empty.stderr
    assert json.loads(run("ls", tmp_path, "--json").stdout) == []
    listed = run("ls", cache_dir.parent)
    assert listed.exit_code == 0 and "document" in listed.stdout and "lic.txt" in listed.stdout


# ---- 4. model errors


def test_moved_model_folder_is_named(doc_file, tiny_model_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    cache = tmp_path / "c.kv"
    assert run("prefill", doc_file, "-o", cache, "--model", model).exit_code == 0
    model.rename(tmp_path / "moved")
    result = run("ask", "-c", cache, "Q?")
    line = assert_clean_error(result, 1, str(model), "no longer exists")
    assert "Repo id" not in result.stderr and "--model" in result.stderr
    assert run("ask", "-c", cache, "Q?", "--model", tmp_path / "moved", "--max-new-tokens", "2").exit_code == 0, line


@pytest.mark.parametrize("spec", ["./nope", "ABSOLUTE", "sub/nope", "not a model"])
def test_missing_model_path_is_not_a_hub_id(doc_file, tmp_path, spec, monkeypatch):
    (tmp_path / "sub").mkdir()  # "sub/nope": relative, under a folder that exists here
    monkeypatch.chdir(tmp_path)
    spec = str(tmp_path / "nope") if spec == "ABSOLUTE" else spec
    line = assert_clean_error(run("prefill", doc_file, "-o", tmp_path / "x.kv", "--model", spec), 1, spec, "no such model folder")
    assert "hub" not in line and not (tmp_path / "x.kv").exists()


# ---- 5. know before you pay


def test_count_matches_prefill_without_the_weights(doc_file, cache_dir, tiny_model_dir, tmp_path):
    no_weights = tmp_path / "config-only"
    shutil.copytree(tiny_model_dir, no_weights, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    result = run("count", doc_file, "--model", no_weights, "--json")
    assert result.exit_code == 0, result.stderr
    (c,) = json_lines(result.stdout)
    m = kvcli.read_manifest(cache_dir)
    assert c["tokens"] == m.num_tokens and c["bytes_raw"] == m.bytes_raw and c["dtype"] == "float32"
    assert c["bytes_on_disk_estimate"] == round(0.83 * m.bytes_raw)
    assert c["max_positions"] == 8192 and c["room"] == 8192 - m.num_tokens and c["fits"] is True
    assert (c["prefill_s_estimate"] is None) == (c["prefill_s_reason"] is not None)  # stated, or why not
    human = run("count", doc_file, "--model", no_weights)
    assert human.exit_code == 0 and f"{m.num_tokens:,}" in human.stdout and "estimate" in human.stderr


def test_count_flags_a_document_too_long(tmp_path, tiny_model_dir):
    long = tmp_path / "long.txt"
    long.write_text(sample_text(60_000), encoding="utf-8")
    result = run("count", long, "--model", tiny_model_dir, "--json")
    assert result.exit_code == 1 and "long.txt" in error_lines(result)[0]
    (c,) = json_lines(result.stdout)
    assert c["tokens"] > 8192 and c["fits"] is False and c["room"] < 0


def test_ask_warns_when_max_new_tokens_cannot_fit(short_model_dir, tmp_path):
    doc = tmp_path / "d.txt"
    doc.write_text(sample_text()[:2500], encoding="utf-8")
    assert run("prefill", doc, "--model", short_model_dir).exit_code == 0, "prefill"
    result = run("ask", "-c", tmp_path / "d.kv", "--json", "--max-new-tokens", "2000", "Who?")
    assert result.exit_code == 0, result.stderr
    (a,) = json_lines(result.stdout)
    room = 1024 - len(a["prompt_token_ids"])
    assert f"only {room} positions" in result.stderr and "--max-new-tokens 2000" in result.stderr
    assert len(a["answer_token_ids"]) <= room
    quiet = run("ask", "-c", tmp_path / "d.kv", "--max-new-tokens", "5", "Who?")
    assert "warning" not in quiet.stderr


# ---- 6. anti-repetition options, still exact


@pytest.mark.parametrize("settings", [("--repetition-penalty", "0.2"), ("--no-repeat-ngram-size", "3"),
                                      ("--repetition-penalty", "1.2", "--no-repeat-ngram-size", "4")])
def test_repetition_options_equal_generate_on_the_full_prompt(cache_dir, tiny_model_dir, settings):
    from transformers import AutoModelForCausalLM

    result = run("ask", "-c", cache_dir, "--json", "--max-new-tokens", "24", *settings, "What is the Licensor?")
    assert result.exit_code == 0, result.stderr
    (a,) = json_lines(result.stdout)
    (plain,) = json_lines(run("ask", "-c", cache_dir, "--json", "--max-new-tokens", "24", "What is the Licensor?").stdout)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    kw = dict(zip([s.lstrip("-").replace("-", "_") for s in settings[::2]], [float(v) if "." in v else int(v) for v in settings[1::2]]))
    assert a["answer_token_ids"] == _generate(model, a["prompt_token_ids"], 24, **kw)
    if "--no-repeat-ngram-size" in settings:  # no n-gram of the answer occurred earlier in prompt or answer
        n, ids = kw["no_repeat_ngram_size"], a["prompt_token_ids"] + a["answer_token_ids"]
        start = len(a["prompt_token_ids"]) - n + 1
        grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
        assert all(grams[i] not in grams[:i] for i in range(start, len(grams)))
    else:
        # the penalty reaches generate(): below 1 it favours the prompt's tokens, and the answer changes
        # (above 1 it often cannot change a random model's answer, whose picks are rarely prompt tokens)
        assert a["answer_token_ids"] != plain["answer_token_ids"]


def test_repetition_options_in_the_python_api(tiny_lm, tmp_path):
    doc = kvcli.read_document(_write(tmp_path / "d.txt", sample_text()[:1500]))
    kvcli.prefill(tiny_lm, doc, tmp_path / "d.kv")
    session = kvcli.Session(tiny_lm, tmp_path / "d.kv")
    opts = kvcli.GenerationOptions(max_new_tokens=20, repetition_penalty=1.25, no_repeat_ngram_size=2)
    a = session.ask("Is there a warranty?", opts)
    assert a.answer_token_ids == _generate(tiny_lm.model, a.prompt_token_ids, 20, repetition_penalty=1.25, no_repeat_ngram_size=2)


def test_bad_repetition_penalty_is_a_usage_error(cache_dir):
    assert_clean_error(run("ask", "-c", cache_dir, "--repetition-penalty", "0", "Q?"), 2, "--repetition-penalty")
    assert run("ask", "-c", cache_dir, "--no-repeat-ngram-size", "-1", "Q?").exit_code == 2


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def _generate(model, prompt_ids, max_new_tokens, **settings):
    import torch

    with torch.inference_mode():
        out = model.generate(input_ids=torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, **settings)
    return out[0, len(prompt_ids):].tolist()


# ---- 7. readable output


def test_terminal_shows_which_question_each_answer_belongs_to(cache_dir, doc_file, monkeypatch):
    from kvcli.cli import output

    piped = run("ask", "-c", cache_dir, "-c", cache_dir, "--max-new-tokens", "6", "First?", "Second?")
    assert piped.exit_code == 0 and "tokens in" not in piped.stderr
    assert piped.stdout.startswith(f"==> {cache_dir}: First? <==\n")  # a pipe gets separator lines, not the terminal's headings
    answers = json_lines(run("ask", "-c", cache_dir, "-c", cache_dir, "--json", "--max-new-tokens", "6", "First?", "Second?").stdout)
    monkeypatch.setattr(output, "is_terminal", lambda stream: True)
    tty = run("ask", "-c", cache_dir, "-c", cache_dir, "--max-new-tokens", "6", "First?", "Second?")
    assert tty.exit_code == 0, tty.stderr
    expected = "".join(f"{a['cache']}: {a['question']}\n{a['answer']}\n" for a in answers)
    assert tty.stdout == expected
    assert tty.stderr.count("tokens in") == 4 and "first token" in tty.stderr and "tokens/s" in tty.stderr
    one = run("ask", "-c", cache_dir, "--max-new-tokens", "6", "First?")
    assert one.stdout == answers[0]["answer"] + "\n"  # a single answer needs no heading


def test_prefill_bar_never_shows_an_unknown_total(tiny_lm, tmp_path):
    import io

    from rich.console import Console

    from kvcli.engine.prompt import framing as fr
    from kvcli.engine import prefilling as pf
    from kvcli.cli.output import Output

    calls = []
    ids = fr.document_ids(tiny_lm.tokenizer, fr.choose(tiny_lm.tokenizer), "A short document.")
    pf.run_chunks(tiny_lm, ids, 1024, progress=lambda done, total: calls.append((done, total)))
    assert calls[0] == (0, len(ids)) and calls[-1] == (len(ids), len(ids))

    out = Output()
    out.interactive = True
    buf = io.StringIO()
    out.err = Console(file=buf, force_terminal=True, width=100)
    with out.progress("prefill short.txt") as update:
        out.err.file.write("")
        time.sleep(0.3)  # let the live display refresh before any total is known
        update(0, 17)
        update(17, 17)
    text = buf.getvalue()
    assert "0/?" not in text and "/17" in text
