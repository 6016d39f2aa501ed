"""kvcli in scripts: many questions, many documents, several caches, stop strings, seeds, quiet."""

from __future__ import annotations

import json
import os
import sys

import pytest

import kvcli
from tests.conftest import sample_text
from tests.helpers import assert_clean_error, json_lines, run, run_python

QUESTIONS = ["What is the Licensor?", "What is a Derivative Work?", "Is there a warranty?"]


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("many")
    text = sample_text()
    (folder / "a.txt").write_text(text[:1500], encoding="utf-8")
    (folder / "b.txt").write_text(text[4000:5200], encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def caches(docs, tiny_model_dir):
    result = run("prefill", docs / "a.txt", docs / "b.txt", "--model", tiny_model_dir)
    assert result.exit_code == 0, result.stderr
    return docs / "a.kv", docs / "b.kv"


def _ask(*args, input=None):
    result = run("ask", "--json", "--max-new-tokens", "12", *args, input=input)
    assert result.exit_code == 0, result.stderr
    return json_lines(result.stdout)


def test_several_documents_in_one_run(caches):
    for cache in caches:
        assert kvcli.verify(cache).num_tokens > 100


def test_several_documents_into_folder_and_one_failure(docs, tiny_model_dir, tmp_path):
    bad = docs / "bad.txt"
    bad.write_bytes(b"\xff\xfe\xfa not utf-8")
    out = tmp_path / "out"
    out.mkdir()
    result = run("prefill", docs / "a.txt", bad, docs / "b.txt", "-o", out, "--model", tiny_model_dir)
    assert result.exit_code == 1
    assert "bad.txt" in result.stderr and "1 of 3 documents failed" in result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["a.kv", "b.kv"]
    bad.unlink()


def test_three_questions_equal_asking_each_alone(caches):
    together = _ask("-c", caches[0], *QUESTIONS)
    assert [a["question"] for a in together] == QUESTIONS
    for a in together:
        (alone,) = _ask("-c", caches[0], a["question"])
        assert alone["answer_token_ids"] == a["answer_token_ids"]
        assert alone["answer"] == a["answer"]


def test_questions_from_file_and_stdin_match_arguments(caches, tmp_path):
    qfile = tmp_path / "q.txt"
    qfile.write_text("# questions\n\n" + "\n".join(QUESTIONS) + "\n\n", encoding="utf-8")
    by_args = _ask("-c", caches[0], *QUESTIONS)
    by_file = _ask("-c", caches[0], "-f", qfile)
    by_stdin = _ask("-c", caches[0], "-f", "-", input=qfile.read_text())
    strip = lambda rows: [{k: v for k, v in r.items() if not k.endswith("_s")} for r in rows]  # noqa: E731
    assert strip(by_file) == strip(by_args) == strip(by_stdin)


def test_whole_stdin_is_one_question(caches):
    (a,) = _ask("-c", caches[0], input="What is the Licensor?\n")
    (b,) = _ask("-c", caches[0], "What is the Licensor?")
    assert a["answer_token_ids"] == b["answer_token_ids"]


def test_no_question_is_a_usage_error(caches):
    assert_clean_error(run("ask", "-c", caches[0], input=""), 2, "no question")


def test_stop_string_ends_the_answer(caches):
    (full,) = _ask("-c", caches[0], QUESTIONS[0], "--max-new-tokens", "24")
    text = full["answer"]
    assert len(text) > 4, text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    (cut,) = _ask("-c", caches[0], QUESTIONS[0], "--max-new-tokens", "24", "--stop", stop)
    assert cut["answer"] == text[: text.index(stop)]
    assert cut["finish_reason"] == "stop"
    plain = run("ask", "-c", caches[0], QUESTIONS[0], "--max-new-tokens", "24", "--stop", stop)
    assert plain.stdout == text[: text.index(stop)] + "\n"


def test_same_seed_same_sample(caches):
    args = ("-c", caches[0], QUESTIONS[1], "--temperature", "1.0", "--top-p", "0.95", "--max-new-tokens", "16")
    (a,) = _ask(*args, "--seed", "7")
    (b,) = _ask(*args, "--seed", "7")
    (greedy,) = _ask("-c", caches[0], QUESTIONS[1], "--max-new-tokens", "16")
    seeds = {tuple(_ask(*args, "--seed", str(s))[0]["answer_token_ids"]) for s in (1, 2, 3)}
    assert a["answer_token_ids"] == b["answer_token_ids"]
    assert len(seeds | {tuple(greedy["answer_token_ids"])}) > 1  # sampling really samples


def test_two_caches_in_one_ask(caches):
    both = _ask("-c", caches[0], "-c", caches[1], *QUESTIONS[:2])
    assert [(a["cache"], a["question"]) for a in both] == [(str(c), q) for c in caches for q in QUESTIONS[:2]]
    for cache in caches:
        alone = _ask("-c", cache, *QUESTIONS[:2])
        mine = [a for a in both if a["cache"] == str(cache)]
        assert [a["answer_token_ids"] for a in mine] == [a["answer_token_ids"] for a in alone]


def test_one_bad_cache_among_several(caches, tmp_path):
    result = run("ask", "--json", "--max-new-tokens", "4", "-c", tmp_path / "gone.kv", "-c", caches[0], "Q?")
    assert result.exit_code == 3
    assert len(json_lines(result.stdout)) == 1 and "gone.kv" in result.stderr


def test_quiet_silences_stderr(docs, tiny_model_dir, tmp_path, caches):
    result = run("prefill", docs / "a.txt", "-o", tmp_path / "q.kv", "--model", tiny_model_dir, "--quiet")
    assert result.exit_code == 0 and result.stderr == ""
    result = run("ask", "-c", caches[0], "Q?", "--max-new-tokens", "3", "--quiet")
    assert result.exit_code == 0 and result.stderr == ""


def test_verify_names_each_bad_file(caches, tmp_path):
    import shutil

    broken = tmp_path / "broken.kv"
    shutil.copytree(caches[1], broken)
    shard = broken / "layer_000.safetensors.zst"
    shard.write_bytes(shard.read_bytes()[:-1])
    result = run("verify", caches[0], broken, "--json")
    assert result.exit_code == 3
    rows = json_lines(result.stdout)
    assert rows[0]["ok"] is True and rows[1]["ok"] is False and "layer_000" in rows[1]["error"]


def test_ls(caches, docs):
    result = run("ls", docs, "--json")
    assert result.exit_code == 0
    rows = json.loads(result.stdout)
    assert {os.path.basename(r["path"]) for r in rows} >= {"a.kv", "b.kv"}
    for r in rows:
        assert r["num_tokens"] > 0 and r["bytes_on_disk"] > 0 and 0 < r["ratio"] < 1 and r["age_s"] >= 0
    human = run("ls", docs)
    assert human.exit_code == 0 and "a.kv" in human.stdout


@pytest.mark.parametrize("argv", [["--help"], ["info", "{cache}"], ["verify", "{cache}"], ["ls", "{folder}"], ["ask", "--help"],
                                  ["ls", "{empty}"], ["prune", "{folder}", "--older-than", "30d", "--dry-run"], ["rm", "{copy}"],
                                  ["count", "--help"], ["rm", "--help"]])
def test_light_commands_do_not_import_torch(caches, argv, tmp_path):
    import shutil

    shutil.copytree(caches[0], tmp_path / "copy.kv")
    (tmp_path / "empty").mkdir()
    argv = [a.format(cache=caches[0], folder=caches[0].parent, empty=tmp_path / "empty", copy=tmp_path / "copy.kv") for a in argv]
    code = (
        "import sys\n"
        "from kvcli.cli import app\n"
        f"try:\n    app({argv!r}, prog_name='kvcli')\n"
        "except SystemExit as e:\n    assert e.code in (0, None), e.code\n"
        "heavy = [m for m in ('torch', 'transformers', 'safetensors', 'numpy') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr


def test_module_entry_point(caches):
    proc = run_python(f"import sys; sys.argv=['kvcli','verify',{str(caches[0])!r}]; import runpy; runpy.run_module('kvcli', run_name='__main__')")
    assert proc.returncode == 0, proc.stderr


def test_completion_is_offered():
    result = run("--help")
    assert "--install-completion" in result.stdout
    assert sys.executable  # completion scripts come from typer itself
