"""Daily use through the command line: what a new user meets on real files (several documents at once, a damaged
cache among good ones, a document given where its cache belongs), each answered with the documented exit code and
one line saying what to do next."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.helpers import assert_clean_error, error_lines, json_lines, run

# ---- options checked up front


@pytest.mark.parametrize(("args", "needles"), [
    (["--seed", str(2**64)], ["--seed", "0 to 18446744073709551615"]),
    (["--seed", "-1"], ["--seed", "0 to 18446744073709551615"]),
    (["--temperature", "inf"], ["--temperature", "finite"]),
    (["--temperature", "nan"], ["--temperature", "finite"]),
    (["--repetition-penalty", "inf"], ["--repetition-penalty", "finite"]),
])
@pytest.mark.parametrize("command", ["ask", "chat"])
def test_out_of_range_sampling_options_are_usage_errors_naming_the_range(tmp_path, command, args, needles):
    missing = tmp_path / "no-such.kv"  # refused before the cache is even looked at (that would be exit 3)
    rest = ["Q?"] if command == "ask" else []
    assert_clean_error(run(command, "-c", missing, *args, "--no-server", *rest, input="Q?\n"), 2, *needles)


def test_the_largest_seed_is_accepted(cache_dir):
    result = run("ask", "-c", cache_dir, "--seed", str(2**64 - 1), "--temperature", "0.7", "--max-new-tokens", "3",
                 "--no-server", "Who?")
    assert result.exit_code == 0, result.stderr


# ---- count: every document, a bad one among them


def test_count_of_several_documents_counts_the_good_ones_and_reports_the_bad_one(doc_file, tiny_model_dir, tmp_path):
    broken = tmp_path / "broken.pdf"
    broken.write_bytes(b"%PDF-1.4\nnot really\n")  # cut off: no %%EOF
    other = tmp_path / "c.txt"
    other.write_text("A second, shorter document about the harbour.", encoding="utf-8")
    result = run("count", doc_file, broken, other, "--model", tiny_model_dir)
    assert result.exit_code == 1
    rows = result.stdout.splitlines()
    assert [r.split("\t")[0] for r in rows[1:]] == [str(doc_file), str(other), str(broken)]
    assert rows[3].split("\t")[1] == "unreadable"
    errors = error_lines(result)
    assert errors[0] == f"kvcli: error: {broken}: a truncated PDF (no %%EOF at its end); download or copy it again"
    assert errors[-1] == "kvcli: error: 1 of 3 documents could not be read; the others are counted above"
    as_json = json_lines(run("count", doc_file, broken, other, "--model", tiny_model_dir, "--json").stdout)
    assert [c["document"] for c in as_json] == [str(doc_file), str(other), str(broken)]
    assert as_json[0]["tokens"] > 0 and "truncated PDF" in as_json[2]["error"]


# ---- rm: a damaged cache among good ones


def test_rm_removes_what_it_can_and_reports_a_damaged_cache(cache_dir, tmp_path):
    good, bad = tmp_path / "good.kv", tmp_path / "bad.kv"
    shutil.copytree(cache_dir, good)
    shutil.copytree(cache_dir, bad)
    (bad / "manifest.json").write_text("{cut off", encoding="utf-8")
    assert "bad.kv" in run("ls", tmp_path).stdout  # ls lists it, with what is wrong
    result = run("rm", good, bad)
    assert result.exit_code == 1 and not good.exists() and bad.exists()
    assert error_lines(result) == [f"kvcli: error: {bad}: a damaged cache (manifest.json is not readable JSON); not removed"]
    assert f"hint: 'kvcli rm --force {bad}' removes it too" in result.stderr and f"removed {good}" in result.stderr
    forced = run("rm", "--force", bad)
    assert forced.exit_code == 0 and not bad.exists() and forced.stderr.startswith(f"removed {bad}")


def test_rm_still_refuses_what_is_no_cache_at_all(cache_dir, tmp_path):
    good = tmp_path / "good.kv"
    shutil.copytree(cache_dir, good)
    other = tmp_path / "photos"
    other.mkdir()
    (other / "manifest.json").write_text("{}", encoding="utf-8")
    (other / "cat.jpg").write_bytes(b"\xff\xd8")
    assert_clean_error(run("rm", "--force", good, other), 1, "photos", "nothing was removed")
    assert good.exists() and (other / "cat.jpg").exists()


# ---- prefill -o FILE: the message and --force agree


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_prefill_never_replaces_a_file_and_says_so(doc_file, tiny_model_dir, tmp_path, force):
    target = tmp_path / "notes"
    target.write_text("keep me", encoding="utf-8")
    result = run("prefill", doc_file, "-o", target, "--model", tiny_model_dir, "--no-server", *force)
    line = assert_clean_error(result, 1, "notes", "a file, not a cache", "not even with --force")
    assert "use --force" not in result.stderr and "hint: give -o another path" in result.stderr, line
    assert target.read_text(encoding="utf-8") == "keep me"


# ---- help and unknown commands


def test_help_lists_whole_summaries():
    result = run("--help")
    assert result.exit_code == 0
    listing = " ".join(result.stdout.split("Commands:", 1)[1].split())
    assert "..." not in listing
    for summary in ("Run documents through the model once and write their key/value caches.",
                    "Tokens, cache size and room left for each document, from the tokenizer and config only (no model run)."):
        assert summary in listing


@pytest.mark.parametrize(("typed", "line"), [
    ("prefil", "kvcli: error: no such command 'prefil'; did you mean 'prefill'?"),
    ("frobnicate", "kvcli: error: no such command 'frobnicate'"),
])
def test_an_unknown_command_says_so_and_the_nearest(typed, line):
    result = run(typed, "x")
    assert_clean_error(result, 2)
    assert error_lines(result) == [line] and "hint: 'kvcli --help' lists the commands" in result.stderr


# ---- info and ls: a summary, aligned on a terminal, tabs on a pipe


def test_info_summarises_the_layers_and_lists_them_with_layers(cache_dir):
    short = run("info", cache_dir)
    assert short.exit_code == 0
    assert "layers\t2 full; stored " in short.stdout and "(--layers: each layer)" in short.stdout
    assert "kind\twindow" not in short.stdout  # no per-layer table by default
    full = run("info", cache_dir, "--layers")
    assert full.exit_code == 0 and "layer\tkind\twindow\tcached\traw\tstored\tratio" in full.stdout
    assert len(json.loads(run("info", cache_dir, "--json").stdout)["layers"]) == 2  # --json keeps them all


@pytest.mark.parametrize("command", ["info", "ls"])
def test_info_and_ls_align_columns_on_a_terminal_and_tab_them_on_a_pipe(cache_dir, monkeypatch, command):
    from kvcli.cli import output

    target = cache_dir if command == "info" else cache_dir.parent
    piped = run(command, target)
    assert piped.exit_code == 0 and "\t" in piped.stdout
    monkeypatch.setattr(output, "is_terminal", lambda stream: True)
    shown = run(command, target)
    assert shown.exit_code == 0 and "\t" not in shown.stdout and "lic.kv" in shown.stdout


# ---- numbers and names as the user reads them


def test_info_writes_token_counts_with_separators(tiny_model_dir, tmp_path):
    import kvcli

    from tests.conftest import sample_text

    doc = tmp_path / "long.txt"
    doc.write_text(sample_text()[:6000], encoding="utf-8")
    assert run("prefill", doc, "--model", tiny_model_dir, "--no-server", "-q").exit_code == 0
    n = kvcli.read_manifest(tmp_path / "long.kv").num_tokens
    assert n >= 1000
    result = run("info", tmp_path / "long.kv")
    assert f"num_tokens\t{n:,}" in result.stdout and f"\t{n}\n" not in result.stdout


def test_ask_of_a_document_names_its_cache(cache_dir, doc_file):
    result = run("ask", "--cache", doc_file, "--no-server", "Who?")
    assert_clean_error(result, 3, str(doc_file), "is a file, not a cache directory")
    assert f"hint: did you mean {cache_dir}?" in result.stderr


def test_ask_of_a_document_without_a_cache_says_how_to_make_one(tmp_path):
    doc = tmp_path / "memo.txt"
    doc.write_text("A memo.", encoding="utf-8")
    result = run("ask", "--cache", doc, "--no-server", "Who?")
    assert_clean_error(result, 3, "is a file, not a cache directory")
    assert f"hint: a cache is a folder that 'kvcli prefill {doc}' writes" in result.stderr


def test_one_failed_prefill_is_one_event(tiny_model_dir, tmp_path):
    listed = tmp_path / "list.txt"
    missing = tmp_path / "gone.txt"
    listed.write_text(f"{missing}\n", encoding="utf-8")
    result = run("prefill", "--from-list", listed, "-o", tmp_path / "out", "--model", tiny_model_dir, "--no-server")
    assert result.exit_code == 1
    assert error_lines(result) == [f"kvcli: error: {missing}: no such file"]
    assert "failed of" not in result.stderr


# ---- a document edited in the middle


def test_prefill_of_an_edited_document_says_it_changed_and_what_to_do(tiny_model_dir, tmp_path):
    from tests.conftest import sample_text

    doc = tmp_path / "contract.txt"
    text = sample_text()[:2000]
    doc.write_text(text, encoding="utf-8")
    assert run("prefill", doc, "--model", tiny_model_dir, "--no-server", "-q").exit_code == 0
    doc.write_text(text.replace("License", "Licence", 1), encoding="utf-8")  # edited, not grown
    result = run("prefill", doc, "--model", tiny_model_dir, "--no-server")
    line = assert_clean_error(result, 1, "contract.kv", "contract.txt", "has changed since")
    assert "hint: --force rebuilds it from the new text, or -o another path keeps both" in result.stderr, line
    again = run("prefill", doc, "--model", tiny_model_dir, "--no-server", "--force", "-q")
    assert again.exit_code == 0, again.stderr
    same = run("prefill", doc, "--model", tiny_model_dir, "--no-server")  # unchanged: as before
    assert_clean_error(same, 1, "already exists")


# ---- a prefill retried right after an interrupted one


def test_a_prefill_retried_while_an_interrupted_one_cleans_up_waits_for_it(doc_file, tiny_model_dir, tmp_path):
    import threading

    from kvcli.format import writing

    target = tmp_path / "retry.kv"
    holding, release = threading.Event(), threading.Event()

    def interrupted_writer():  # holds the lock as a cancelled run does while it ends its chunk and cleans up
        with writing.writer_lock(target):
            holding.set()
            release.wait(30)

    thread = threading.Thread(target=interrupted_writer)
    thread.start()
    holding.wait(30)
    timer = threading.Timer(1.0, release.set)
    timer.start()
    try:
        result = run("prefill", doc_file, "-o", target, "--model", tiny_model_dir, "--no-server")
    finally:
        release.set()
        timer.cancel()
        thread.join()
    assert result.exit_code == 0, result.stderr
    assert (target / "manifest.json").is_file() and "another prefill" not in result.stderr


# ---- ask --json: small lines that say the format; a warning when the document changed


def test_ask_json_lines_carry_the_format_and_prompt_ids_only_with_ids(cache_dir):
    plain = run("ask", "-c", cache_dir, "--json", "--max-new-tokens", "4", "--no-server", "Who?")
    assert plain.exit_code == 0, plain.stderr
    (a,) = json_lines(plain.stdout)
    assert a["format"] == "text" and "prompt_token_ids" not in a and len(plain.stdout) < 2000
    assert len(a["document_ids_sha256"]) == 64 and a["cached_tokens"] > 0
    (full,) = json_lines(run("ask", "-c", cache_dir, "--json", "--ids", "--max-new-tokens", "4", "--no-server", "Who?").stdout)
    assert full["format"] == "text" and len(full["prompt_token_ids"]) == full["cached_tokens"] + full["new_tokens"]
    assert full["answer_token_ids"] == a["answer_token_ids"]


def test_a_follow_up_without_ids_still_refuses_another_documents_answer(cache_dir, tiny_model_dir, tmp_path):
    first = run("ask", "-c", cache_dir, "--json", "--max-new-tokens", "4", "--no-server", "Who?")
    (tmp_path / "turn.jsonl").write_text(first.stdout, encoding="utf-8")
    on = run("ask", "-c", cache_dir, "--json", "--max-new-tokens", "4", "--no-server", "--follow-up", tmp_path / "turn.jsonl", "And?")
    assert on.exit_code == 0, on.stderr
    assert json_lines(on.stdout)[0]["history"][0]["question"] == "Who?"
    other = tmp_path / "other.txt"
    other.write_text("A different short document about ships and harbours. " * 20, encoding="utf-8")
    assert run("prefill", other, "--model", tiny_model_dir, "--no-server", "-q").exit_code == 0
    refused = run("ask", "-c", tmp_path / "other.kv", "--no-server", "--follow-up", tmp_path / "turn.jsonl", "And?")
    assert_clean_error(refused, 2, "another document")


def test_ask_warns_when_the_document_beside_the_cache_changed(tiny_model_dir, tmp_path):
    from tests.conftest import sample_text

    doc = tmp_path / "memo.txt"
    doc.write_text(sample_text()[:1500], encoding="utf-8")
    assert run("prefill", doc, "--model", tiny_model_dir, "--no-server", "-q").exit_code == 0
    fresh = run("ask", "-c", tmp_path / "memo.kv", "--max-new-tokens", "2", "--no-server", "Who?")
    assert fresh.exit_code == 0 and "warning" not in fresh.stderr
    doc.write_text(sample_text()[:1500].replace("License", "Licence", 1), encoding="utf-8")
    stale = run("ask", "-c", tmp_path / "memo.kv", "--max-new-tokens", "2", "--no-server", "Who?")
    assert stale.exit_code == 0 and stale.stdout
    warnings = [line for line in stale.stderr.splitlines() if line.startswith("kvcli: warning:")]
    assert warnings == [f"kvcli: warning: {doc} has changed since {tmp_path / 'memo.kv'} was made from it; the answers come "
                        f"from the text as it was then ('kvcli prefill {doc}' extends the cache if the document only grew, "
                        "'--force' rebuilds it)"]


# ---- a small model's loop ends the answer; nothing before it changes


@pytest.mark.parametrize("n", [2, 3])
def test_stop_loops_ends_a_looping_answer_and_changes_no_token_before(cache_dir, n):
    args = ["ask", "-c", cache_dir, "--json", "--max-new-tokens", "200", "--no-server", "What is the Licensor?"]
    (free,) = json_lines(run(*args, "--stop-loops", "0").stdout)  # the tiny random model repeats itself
    result = run(*args, "--stop-loops", str(n))
    assert result.exit_code == 0, result.stderr
    (a,) = json_lines(result.stdout)
    ids = a["answer_token_ids"]
    assert a["finish_reason"] == "loop" and len(ids) < len(free["answer_token_ids"])
    assert ids == free["answer_token_ids"][:len(ids)]  # the same tokens, ended where the loop was seen
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    assert grams.count(grams[-1]) == 3  # ended the first time an n-gram came a third time
    assert all(grams[:i + 1].count(grams[i]) < 3 for i in range(len(grams) - 1))
    plain = run(*args[:3], "--max-new-tokens", "200", "--no-server", "--stop-loops", str(n), "What is the Licensor?")
    assert plain.exit_code == 0 and "kvcli: note: the answer was ended where it began to repeat itself" in plain.stderr


def test_stop_loops_is_on_by_default_on_the_command_line_and_checked(cache_dir, tmp_path):
    from kvcli.generation import DEFAULT_STOP_LOOPS

    args = ["ask", "-c", cache_dir, "--json", "--max-new-tokens", "200", "--no-server", "What is the Licensor?"]
    (default,) = json_lines(run(*args).stdout)
    (explicit,) = json_lines(run(*args, "--stop-loops", str(DEFAULT_STOP_LOOPS)).stdout)
    assert default["answer_token_ids"] == explicit["answer_token_ids"]
    assert_clean_error(run("ask", "-c", tmp_path / "none.kv", "--stop-loops", "-1", "--no-server", "Q?"), 2,
                       "--stop-loops", "at least 0")


# ---- kvcli serve beside the warm server a command started by itself


def test_serve_takes_the_place_of_an_autostarted_server_and_names_the_way_past_a_users(tmp_path):
    import threading

    from kvcli.serve import client
    from kvcli.serve.server import Server
    from kvcli.serve.warm import Warm
    from tests.serve_helpers import short_dir

    sock = short_dir() / "s.sock"
    auto = Server(sock, Warm(), autostarted=True)  # what `ask` starts on its own, here in a thread
    auto.start(preload=False)
    thread = threading.Thread(target=auto.serve_forever, daemon=True)
    thread.start()
    assert client.call(sock, "status")["status"]["autostarted"] is True
    started = run("serve", "--detach", "--socket", sock)
    try:
        assert started.exit_code == 0, started.stderr
        thread.join(30)
        assert not thread.is_alive()  # the autostarted one stopped
        pid = int(started.stdout.strip())
        assert "stopped the warm server that a command started by itself" in started.stderr
        status = client.call(sock, "status")["status"]
        assert status["pid"] == pid and status["autostarted"] is False
        again = run("serve", "--detach", "--socket", sock)  # a server the user started is never stopped for another
        assert_clean_error(again, 1, str(sock), f"already running here (pid {pid})")
        assert "hint: 'kvcli serve --stop' stops it (then run this again), or --socket PATH starts one beside it" in again.stderr
        assert client.call(sock, "status")["status"]["pid"] == pid
    finally:
        run("serve", "--stop", "--socket", sock)
