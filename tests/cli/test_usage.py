"""Usage errors and help texts: a bad option is refused before any model loads (no torch imported), every
usage error has one shape, and each command's help says what it takes."""

from __future__ import annotations

import json
import re

import pytest

from tests.helpers import assert_clean_error, run, run_python

HEAVY = ("torch", "transformers", "safetensors", "numpy")


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


# ---- refused before anything loads


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


@pytest.mark.parametrize("args, needle", [
    (["ask", "-c", "x.kv", "--max-new-tokens", "-5", "Q?"], "--max-new-tokens"),
    (["ask", "-c", "x.kv", "--top-p", "3", "Q?"], "--top-p"),
    (["ask", "--no-such-option"], "--no-such-option"),
    (["chat"], "--cache"),
    (["ask", "-c", "x.kv", "--dtype", "int3", "Q?"], "int3"),
    (["no-such-command"], "no-such-command"),
    (["ask", "Q?"], "--cache"),  # kvcli's own check: the same shape
])
def test_every_usage_error_has_one_shape(args, needle):
    result = run(*args)
    line = assert_clean_error(result, 2, needle)
    assert line.startswith("kvcli: error: ") and "Usage:" not in result.stderr and "Try '" not in result.stderr


# ---- help


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
        assert "above 0 and at most 1" in text[cmd] and "0.0<=x" not in text[cmd]
        assert "the model the cache was built with" in text[cmd] and "$KVCLI_MODEL" not in text[cmd]
    for cmd in ("prefill", "count", "bench"):
        assert "$KVCLI_MODEL" in text[cmd] and "for ask" not in text[cmd]
    assert "above: 400" not in text["serve"] and "refused with HTTP 400" in text["serve"]
    assert not [cmd for cmd, t in text.items() if "measured" in t or re.search(r"\d\.?\d*x faster", t)]  # no benchmark figures
    assert "-f, --force" not in text["prefill"] and "-f, --questions-file" in text["ask"]
    assert ".txt" in text["prefill"] and "MPL-2.0.kv" in text["prefill"]
    assert_clean_error(run("prefill", "doc.txt", "-f"), 2, "-f")
