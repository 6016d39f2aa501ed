"""What reaches stdout and stderr, on a pipe and on a terminal: a closed stdout ends a command quietly (exit
141), several answers are told apart, a cut answer says so, tables are never cut on a pipe, the room warning,
the spinner for a slow question and the prefill bar."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time


from tests.conftest import sample_text
from tests.helpers import json_lines, REPO, run, served_and_local


# ---- a closed stdout


def _closed_pipe_run(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    """Run `python -m kvcli ARGS` with stdout a pipe whose reader has already gone (as after `| head -1`)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
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


# ---- several answers, cut answers


def test_piped_answers_are_separated_and_cut_ones_say_so(cache_dir, server, monkeypatch):
    qs = ["First?", "Second\nline?"]
    answers = json_lines(run("ask", "-c", cache_dir, "--json", "--max-new-tokens", "6", "--no-server", *qs).stdout)
    served, local = served_and_local("ask", "-c", cache_dir, "--max-new-tokens", "6", *qs)
    assert served.exit_code == local.exit_code == 0, local.stderr
    expected = f"==> First? <==\n{answers[0]['answer']}\n\n==> Second line? <==\n{answers[1]['answer']}\n"
    assert local.stdout == served.stdout == expected
    cut = [a for a in answers if a["finish_reason"] == "length"]
    assert cut and local.stderr.count("(--max-new-tokens)") == len(cut) and served.stderr == local.stderr
    assert "'First?' was cut at 6 tokens" in local.stderr
    two = run("ask", "-c", cache_dir, "-c", cache_dir, "--max-new-tokens", "3", "--no-server", "Q?")
    assert two.stdout.startswith(f"==> {cache_dir}: Q? <==\n") and two.stdout.count("==> ") == 2
    nul = run("ask", "-c", cache_dir, "--max-new-tokens", "6", "-0", "--no-server", *qs)
    assert nul.stdout == "".join(a["answer"] + "\0" for a in answers)  # -0: no separator lines
    one = run("ask", "-c", cache_dir, "--max-new-tokens", "6", "--no-server", "First?")
    assert one.stdout == answers[0]["answer"] + "\n" and "cut at 6 tokens" in one.stderr


def test_cut_note_on_a_terminal_too(cache_dir, monkeypatch):
    from kvcli.cli import output

    monkeypatch.setattr(output, "is_terminal", lambda stream: True)
    tty = run("ask", "-c", cache_dir, "--max-new-tokens", "4", "--no-server", "First?")
    assert tty.exit_code == 0 and "was cut at 4 tokens" in tty.stderr


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


def test_ask_warns_when_max_new_tokens_cannot_fit(short_model_dir, tmp_path):
    doc = tmp_path / "d.txt"
    doc.write_text(sample_text()[:2500], encoding="utf-8")
    assert run("prefill", doc, "--model", short_model_dir).exit_code == 0, "prefill"
    result = run("ask", "-c", tmp_path / "d.kv", "--json", "--ids", "--max-new-tokens", "2000", "Who?")
    assert result.exit_code == 0, result.stderr
    (a,) = json_lines(result.stdout)
    room = 1024 - len(a["prompt_token_ids"])
    assert f"only {room} positions" in result.stderr and "--max-new-tokens 2000" in result.stderr
    assert len(a["answer_token_ids"]) <= room
    quiet = run("ask", "-c", tmp_path / "d.kv", "--max-new-tokens", "5", "Who?")
    assert "warning" not in quiet.stderr


# ---- tables are never cut on a pipe


def test_tables_keep_every_value_on_a_pipe(cache_dir, here, doc_file, tiny_model_dir, server, monkeypatch):
    import shutil

    folder = here / "names"
    folder.mkdir()
    names = [f"a-very-long-cache-name-that-a-table-would-cut-{i}.kv" for i in range(3)]
    for n in names:
        shutil.copytree(cache_dir, folder / n)
    listed = run("ls", folder, env={"COLUMNS": "40"})
    assert listed.exit_code == 0
    rows = [line.split("\t") for line in listed.stdout.splitlines() if not line.startswith("#")]
    assert rows[0][:3] == ["cache", "document", "tokens"] and sorted(r[0] for r in rows[1:]) == names
    for n in names:
        assert run("ask", "-c", folder / n, "Q?", "--max-new-tokens", "2", "--server").exit_code == 0
    ps = run("ps", env={"COLUMNS": "40"})
    assert ps.exit_code == 0
    for n in names:
        assert f"{folder / n}\t" in ps.stdout, ps.stdout
    long_doc = here / ("a-document-with-a-name-longer-than-any-terminal-column-would-allow" + "-x" * 20 + ".txt")
    long_doc.write_text("A short text.", encoding="utf-8")
    counted = run("count", long_doc, "--model", tiny_model_dir, env={"COLUMNS": "40"})
    assert counted.exit_code == 0 and f"{long_doc}\t" in counted.stdout
    assert json.loads(run("ls", folder, "--json").stdout)  # --json stays the machine format


# ---- progress


def test_spinner_for_a_slow_question(monkeypatch):
    import io

    from rich.console import Console

    from kvcli.cli import output
    from kvcli.cli.rendering import AskRenderer
    from kvcli.events import Begin, TextOut

    out = output.Output()
    out.interactive = True
    out.err = Console(file=io.StringIO(), force_terminal=True, width=100)
    written = []
    out.write = written.append
    render = AskRenderer(out, ["d.kv"], questions=1)
    monkeypatch.setattr(output, "WAIT_S", 0.05)
    render(Begin(0, "x" * 20000, "d.kv"))
    waiting = render._waiting
    deadline = time.monotonic() + 10
    while not waiting.shown and time.monotonic() < deadline:
        time.sleep(0.05)
    assert waiting.shown  # no text after WAIT_S: the spinner runs
    render(TextOut("Answer"))
    assert render._waiting is None and written == ["Answer"]
    assert "20,000 characters" in out.err.file.getvalue()
    quick = AskRenderer(out, ["d.kv"], questions=1)
    quick(Begin(0, "Q?", "d.kv"))
    w = quick._waiting
    quick(TextOut("A"))
    time.sleep(0.2)
    assert not w.shown  # a quick answer never shows one
    out.interactive = False  # stderr not a terminal (or --quiet): no spinner at all
    silent = AskRenderer(out, ["d.kv"], questions=1)
    silent(Begin(0, "x" * 20000, "d.kv"))
    time.sleep(0.2)
    assert not silent._waiting.shown


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
