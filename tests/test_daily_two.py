"""Daily use, round two (issue 24): what a new user tripped on in 0.2, one test (or more) per item.

1 warnings reach a served client as they reach an in-process one; 2 several plain answers on a pipe are
told apart, a cut answer says so; 3 tables are never cut on a pipe; 4/8 a refused request loads nothing;
5 every address a server listens on is printed and shown; 6 one shape for usage errors; 7 one set of
counters; 9 count loads only what it says; 10 a spinner for a long question; 11 -o DIR is created for
--from-list, by several processes at once.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import sample_text, tiny_llama
from tests.helpers import assert_clean_error, json_lines, run, run_python
from tests.serve_helpers import ThreadServer, kvcli_cmd, short_dir

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def here(tmp_path_factory):
    return tmp_path_factory.mktemp("daily2")


@pytest.fixture(scope="module")
def doc_file(here):
    path = here / "lic.txt"
    path.write_text(sample_text()[:2500], encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def cache_dir(doc_file, tiny_model_dir):
    result = run("prefill", doc_file, "--model", tiny_model_dir)
    assert result.exit_code == 0, result.stderr
    return doc_file.with_suffix(".kv")


@pytest.fixture(scope="module")
def short_cache(here, short_model_dir):
    doc = here / "short.txt"
    doc.write_text(sample_text()[:2500], encoding="utf-8")
    assert run("prefill", doc, "--model", short_model_dir).exit_code == 0
    return here / "short.kv"


@pytest.fixture()
def server(monkeypatch):
    folder = short_dir()
    s = ThreadServer(folder / "s.sock")
    monkeypatch.setenv("KVCLI_SOCKET", str(s.path))
    yield s
    s.close()


def _both(server, monkeypatch, *args, input=None):
    """The same command through the server and in-process: (served, local)."""
    served = run(*args, "--server", input=input)
    local = run(*args, "--no-server", input=input)
    return served, local


# ---- 1. every warning both ways


def test_room_warning_both_ways(short_cache, server, monkeypatch):
    served, local = _both(server, monkeypatch, "ask", "-c", short_cache, "--max-new-tokens", "2000", "--json", "Who?")
    assert served.exit_code == local.exit_code == 0, (served.stderr, local.stderr)
    assert "positions are left" in local.stderr and served.stderr == local.stderr


def test_convert_dtype_warning_both_ways(cache_dir, server, monkeypatch):
    served, local = _both(server, monkeypatch, "ask", "-c", cache_dir, "--dtype", "bfloat16", "--convert-dtype",
                          "--max-new-tokens", "2", "--json", "Who?")
    assert served.exit_code == local.exit_code == 0, (served.stderr, local.stderr)
    assert "converted to bfloat16" in local.stderr and served.stderr == local.stderr


def test_chat_warnings_both_ways(short_cache, server, monkeypatch):
    """chat in-process warns of the room left at each turn, as a served chat does; the cache's own warnings
    come once per chat through the server, as in-process."""
    served = run("chat", "-c", short_cache, "--max-new-tokens", "2000", "--json", "--server", input="Who?\n")
    local = run("chat", "-c", short_cache, "--max-new-tokens", "2000", "--json", "--no-server", input="Who?\n")
    assert served.exit_code == local.exit_code == 0, (served.stderr, local.stderr)
    assert local.stderr.count("positions are left") == 1 and served.stderr == local.stderr
    lines = "Who?\nAnd then?\n"
    args = ("chat", "-c", short_cache, "--dtype", "bfloat16", "--convert-dtype", "--max-new-tokens", "2", "--json")
    served = run(*args, "--server", input=lines)
    local = run(*args, "--no-server", input=lines)
    assert local.stderr.count("converted to bfloat16") == 1 and served.stderr == local.stderr


def test_follow_up_warning_both_ways(short_cache, server, monkeypatch, tmp_path):
    first = run("ask", "-c", short_cache, "--max-new-tokens", "4", "--json", "--no-server", "Who?")
    earlier = tmp_path / "a.json"
    earlier.write_text(first.stdout, encoding="utf-8")
    served, local = _both(server, monkeypatch, "ask", "-c", short_cache, "--follow-up", earlier, "--max-new-tokens", "2000",
                          "--json", "And?")
    assert served.exit_code == local.exit_code == 0, (served.stderr, local.stderr)
    assert "positions are left" in local.stderr and served.stderr == local.stderr


# ---- 2. several plain answers on a pipe


def test_piped_answers_are_separated_and_cut_ones_say_so(cache_dir, server, monkeypatch):
    qs = ["First?", "Second\nline?"]
    answers = json_lines(run("ask", "-c", cache_dir, "--json", "--max-new-tokens", "6", "--no-server", *qs).stdout)
    served, local = _both(server, monkeypatch, "ask", "-c", cache_dir, "--max-new-tokens", "6", *qs)
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


# ---- 3. tables are never cut on a pipe


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


# ---- 4/8. a refused request loads nothing


def test_dtype_refusal_loads_no_model_in_the_server(cache_dir, server):
    result = run("ask", "-c", cache_dir, "--dtype", "bfloat16", "Q?", "--server")
    assert_clean_error(result, 3, "dtype", "--convert-dtype")
    assert server.server.warm.status()["models"] == []  # 0.2 kept a bfloat16 copy of the model, 0 answers


def test_dtype_refusal_loads_no_model_in_process(cache_dir, monkeypatch):
    from kvcli.engine.model import models

    def no_load(*a, **k):
        raise AssertionError("a model was loaded for a refused request")

    monkeypatch.setattr(models, "load", no_load)
    assert_clean_error(run("ask", "-c", cache_dir, "--dtype", "bfloat16", "Q?", "--no-server"), 3, "dtype", "--convert-dtype")


def test_prefill_onto_an_existing_cache_is_refused_before_loading(cache_dir, doc_file, tiny_model_dir, server, monkeypatch):
    line = assert_clean_error(run("prefill", doc_file, "--model", tiny_model_dir, "--server"), 1, "already exists", "--force")
    assert server.server.warm.status()["models"] == []
    # in a fresh process: refused without importing torch (0.2 loaded the model first, ~7 s)
    code = ("import sys, time\nfrom kvcli.cli import app\nt0 = time.perf_counter()\n"
            f"try:\n    app(['prefill', {str(doc_file)!r}, '--model', {str(tiny_model_dir)!r}, '--no-server'], prog_name='kvcli')\n"
            "except SystemExit as e:\n    code = e.code\n"
            "print(code, 'torch' in sys.modules, round(time.perf_counter() - t0, 2))\n")
    proc = run_python(code)
    code, torch_loaded, seconds = proc.stdout.split()
    assert code == "1" and torch_loaded == "False", (proc.stdout, proc.stderr, line)


# ---- 5. every address


def test_ps_shows_every_address(cache_dir, server):
    server.server.listening("http", "http://127.0.0.1:9/v1")
    s = json.loads(run("ps", "--json").stdout)
    assert s["addresses"] == {"socket": str(server.path), "http": "http://127.0.0.1:9/v1"}
    text = run("ps").stdout
    assert str(server.path) in text and "http://127.0.0.1:9/v1" in text


def test_detach_prints_every_address(here, tmp_path):
    pytest.importorskip("uvicorn")
    folder = short_dir()
    sock = folder / "d.sock"
    env = {**os.environ, "KVCLI_HOME": str(folder), "PYTHONPATH": str(REPO), "KVCLI_SOCKET": str(sock)}
    up = subprocess.run(kvcli_cmd("serve", "--detach", "--socket", sock, "--http", "127.0.0.1:0", "--docs", here),
                        capture_output=True, text=True, env=env, timeout=300)
    try:
        assert up.returncode == 0, up.stderr
        assert up.stdout.strip().isdigit()  # stdout: the pid alone, as before
        assert f"socket {sock}" in up.stderr and "http http://127.0.0.1:" in up.stderr, up.stderr
        ps = subprocess.run(kvcli_cmd("ps", "--json", "--socket", sock), capture_output=True, text=True, env=env, timeout=60)
        addresses = json.loads(ps.stdout)["addresses"]
        assert addresses["socket"] == str(sock) and addresses["http"].startswith("http://127.0.0.1:")
        assert addresses["http"] in up.stderr and addresses["http"].split(":")[-1] != "0/v1"
    finally:
        subprocess.run(kvcli_cmd("serve", "--stop", "--socket", sock), capture_output=True, env=env, timeout=120)


# ---- 6. one shape for usage errors


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


# ---- 7. one set of counters


def test_one_set_of_counters(cache_dir, server):
    from kvcli.serve.server import COUNTERS, counters_line

    assert run("ask", "-c", cache_dir, "--max-new-tokens", "2", "--server", "A?", "B?").exit_code == 0
    assert run("ask", "-c", cache_dir, "--max-new-tokens", "2", "--server", "C?").exit_code == 0
    for _ in range(3):
        run("ps")  # looking changes nothing
    s = json.loads(run("ps", "--json").stdout)
    assert {k: s[k] for k in COUNTERS} == {"requests": 2, "socket_requests": 2, "http_requests": 0, "answers": 3, "prefills": 0,
                                           "failed": 0, "refused": 0, "cancelled": 0, "busy": 0}
    assert sum(c["answers"] for c in s["caches"]) == s["answers"] == 3
    assert counters_line(s) in run("ps").stdout
    server.close()
    assert any(counters_line(s) in line for line in server.logs), server.logs
    server.close = lambda: None


# ---- 9. count loads only what it says


def test_count_imports_no_model_code(doc_file, tiny_model_dir):
    code = ("import sys, time, resource\nfrom kvcli.cli import app\nt0 = time.perf_counter()\n"
            f"try:\n    app(['count', {str(doc_file)!r}, '--model', {str(tiny_model_dir)!r}, '--json'], prog_name='kvcli')\n"
            "except SystemExit as e:\n    assert e.code in (0, None), e.code\n"
            "import json\nprint(json.dumps({'torch': 'torch' in sys.modules,"
            " 'modeling': sorted(m for m in sys.modules if m.startswith('transformers.models.') and '.modeling_' in m),"
            " 's': time.perf_counter() - t0, 'rss_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))\n")
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    # no model code: 0.2 built the model on the meta device (transformers.models.llama.modeling_llama and
    # its imports); and no torch: config.json and the tokenizer are read without it (engine/model/light.py)
    assert got["modeling"] == [] and got["torch"] is False, got
    (c,) = json_lines(proc.stdout.strip().splitlines()[0])
    assert (c["prefill_s_estimate"] is None) == (c["prefill_s_reason"] is not None)  # stated, or why not


def test_count_parameters_match_the_model(tiny_model_dir):
    from kvcli.engine import counting

    counter = counting.Counter(str(tiny_model_dir))
    model = tiny_llama(counter.tokenizer.__len__())
    assert counter.params == sum(p.numel() for p in model.parameters())


# ---- 10. progress for a long question


def test_spinner_for_a_slow_question(monkeypatch):
    import io

    from rich.console import Console

    from kvcli.cli import output
    from kvcli.cli.rendering import AskRenderer

    out = output.Output()
    out.interactive = True
    out.err = Console(file=io.StringIO(), force_terminal=True, width=100)
    written = []
    out.write = written.append
    render = AskRenderer(out, ["d.kv"], questions=1)
    monkeypatch.setattr(output, "WAIT_S", 0.05)
    render({"event": "begin", "index": 0, "question": "x" * 20000, "cache": "d.kv"})
    waiting = render._waiting
    deadline = time.monotonic() + 10
    while not waiting.shown and time.monotonic() < deadline:
        time.sleep(0.05)
    assert waiting.shown  # no text after WAIT_S: the spinner runs
    render({"event": "text", "text": "Answer"})
    assert render._waiting is None and written == ["Answer"]
    assert "20,000 characters" in out.err.file.getvalue()
    quick = AskRenderer(out, ["d.kv"], questions=1)
    quick({"event": "begin", "index": 0, "question": "Q?", "cache": "d.kv"})
    w = quick._waiting
    quick({"event": "text", "text": "A"})
    time.sleep(0.2)
    assert not w.shown  # a quick answer never shows one
    out.interactive = False  # stderr not a terminal (or --quiet): no spinner at all
    silent = AskRenderer(out, ["d.kv"], questions=1)
    silent({"event": "begin", "index": 0, "question": "x" * 20000, "cache": "d.kv"})
    time.sleep(0.2)
    assert not silent._waiting.shown


# ---- 11. -o DIR for --from-list, created by several processes at once


def test_from_list_creates_the_output_folder_under_concurrent_tasks(here, tiny_model_dir, tmp_path):
    docs = []
    for i in range(3):
        d = tmp_path / f"doc{i}.txt"
        d.write_text(f"Document number {i} is about ducks.", encoding="utf-8")
        docs.append(d)
    listing = tmp_path / "list.txt"
    listing.write_text("".join(f"{d}\n" for d in docs), encoding="utf-8")
    out = tmp_path / "new" / "deeper"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(kvcli_cmd("prefill", "--from-list", listing, "--shard", f"{i}/3", "-o", out, "--model", tiny_model_dir,
                                        "--no-server"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for i in range(3)]
    results = [(p.wait(timeout=600), p.stderr.read()) for p in procs]
    assert all(code == 0 for code, _ in results), results
    assert sorted(p.name for p in out.iterdir()) == ["doc0.kv", "doc1.kv", "doc2.kv"]
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert_clean_error(run("prefill", "--from-list", listing, "-o", afile, "--model", tiny_model_dir), 2, "afile", "folder")
