"""The command line: stdout carries only answers/JSON, progress and errors go to stderr, exit codes."""

from __future__ import annotations

import json

import pytest

import kvcli
from kvcli.format import manifest as mf
from tests.conftest import reference_answer, sample_text
from tests.helpers import assert_clean_error, json_lines, run

JSON_FIELDS = {"question", "answer", "prompt_token_ids", "answer_token_ids", "cached_tokens", "new_tokens",
               "ttft_s", "total_s", "finish_reason", "cache"}


@pytest.fixture(scope="module")
def doc_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("docs") / "licence.txt"
    path.write_text(sample_text()[:3000], encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def cache_dir(doc_file, tiny_model_dir):
    result = run("prefill", doc_file, "--model", tiny_model_dir, "--chunk-size", "128")
    assert result.exit_code == 0, result.stderr
    return doc_file.with_suffix(".kv")


def test_prefill_writes_next_to_document_and_reports_on_stderr(cache_dir):
    assert cache_dir.name == "licence.kv" and (cache_dir / "manifest.json").is_file()
    m = kvcli.read_manifest(cache_dir)
    assert m.num_tokens > 500 and m.model["source"]["kind"] == "folder"


def test_prefill_summary_line(doc_file, tiny_model_dir, tmp_path):
    result = run("prefill", doc_file, "-o", tmp_path / "x.kv", "--model", tiny_model_dir)
    assert result.exit_code == 0
    assert result.stdout == ""
    assert "tokens in" in result.stderr and "on disk" in result.stderr and "raw" in result.stderr


def test_ask_stdout_holds_only_the_answer(cache_dir, tiny_model_dir):
    result = run("ask", "--cache", cache_dir, "What is the Licensor?", "--max-new-tokens", "12")
    assert result.exit_code == 0, result.stderr
    as_json = run("ask", "--cache", cache_dir, "What is the Licensor?", "--max-new-tokens", "12", "--json")
    (a,) = json_lines(as_json.stdout)
    assert result.stdout == a["answer"] + "\n"
    assert "kvcli:" not in result.stdout


def test_ask_json_fields_and_exactness(cache_dir, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    result = run("ask", "-c", cache_dir, "--json", "--ids", "--max-new-tokens", "16", "Who may grant a license?", "What is a Work?")
    assert result.exit_code == 0, result.stderr
    answers = json_lines(result.stdout)
    assert len(answers) == 2
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    m = kvcli.read_manifest(cache_dir)
    for a in answers:
        assert JSON_FIELDS <= set(a)
        assert a["cached_tokens"] == m.num_tokens and a["prompt_token_ids"][: m.num_tokens] == m.token_ids
        assert a["new_tokens"] == len(a["prompt_token_ids"]) - m.num_tokens
        assert a["finish_reason"] in ("stop", "length") and a["ttft_s"] > 0 and a["total_s"] >= a["ttft_s"]
        assert a["answer_token_ids"] == reference_answer(model, a["prompt_token_ids"], 16)


def test_several_plain_answers_are_nul_separated_with_null(cache_dir):
    result = run("ask", "-c", cache_dir, "-0", "--max-new-tokens", "5", "One?", "Two?")
    assert result.exit_code == 0
    parts = result.stdout.split("\0")
    assert len(parts) == 3 and parts[2] == ""


def test_existing_cache_needs_force(doc_file, cache_dir, tiny_model_dir):
    before = (cache_dir / "manifest.json").read_bytes()
    result = run("prefill", doc_file, "--model", tiny_model_dir)
    assert_clean_error(result, 1, str(cache_dir), "--force")
    assert (cache_dir / "manifest.json").read_bytes() == before


def test_force_replaces(doc_file, tiny_model_dir, tmp_path):
    out = tmp_path / "c.kv"
    assert run("prefill", doc_file, "-o", out, "--model", tiny_model_dir).exit_code == 0
    other = tmp_path / "other.txt"
    other.write_text("A short and different document about ducks.", encoding="utf-8")
    assert run("prefill", other, "-o", out, "--model", tiny_model_dir, "--force").exit_code == 0
    assert kvcli.read_manifest(out).document["name"] == "other.txt"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_stdin_document_needs_output(tiny_model_dir):
    assert_clean_error(run("prefill", "-", "--model", tiny_model_dir, input="hello"), 2, "-o")


def test_stdin_document(tiny_model_dir, tmp_path):
    out = tmp_path / "s.kv"
    result = run("prefill", "-", "-o", out, "--model", tiny_model_dir, input="Ducks live near water.")
    assert result.exit_code == 0, result.stderr
    assert kvcli.read_manifest(out).document["name"] == "-"


@pytest.mark.parametrize(
    "content, needles",
    [
        (b"", ["empty.txt", "empty"]),
        (b"  \n\n ", ["empty.txt", "empty"]),
        (b"caf\xe9 au lait", ["empty.txt", "byte offset 3"]),
        (b"\x7fELF\x00\x01binary", ["empty.txt", "binary"]),
    ],
)
def test_bad_documents_refused(tmp_path, tiny_model_dir, content, needles):
    doc = tmp_path / "empty.txt"
    doc.write_bytes(content)
    assert_clean_error(run("prefill", doc, "--model", tiny_model_dir), 1, *needles)
    assert not (tmp_path / "empty.kv").exists()


def test_document_longer_than_the_model_becomes_sections(tmp_path, tiny_model_dir):
    # refused only by models whose keys cannot move (tests/cli/test_count.py); here a sectioned cache (tests/engine/test_sections.py)
    doc = tmp_path / "long.txt"
    doc.write_text(sample_text(40_000), encoding="utf-8")
    result = run("prefill", doc, "--model", tiny_model_dir, "--json", "--no-server")
    assert result.exit_code == 0, result.stderr
    record = json_lines(result.stdout)[0]
    assert record["num_tokens"] > 8192 and record["sections"] > 16


def test_other_encoding(tmp_path, tiny_model_dir):
    doc = tmp_path / "latin.txt"
    doc.write_bytes("Le café est noir.".encode("latin-1"))
    assert run("prefill", doc, "--model", tiny_model_dir, "--encoding", "latin-1").exit_code == 0


# ---- damaged caches: exit code 3 and one line naming the file


def _copy(cache_dir, tmp_path):
    import shutil

    dst = tmp_path / "copy.kv"
    shutil.copytree(cache_dir, dst)
    return dst


def _rewrite_manifest(path, edit, fix_checksum=True):
    body = json.loads((path / "manifest.json").read_text())
    edit(body)
    if fix_checksum:
        body["manifest_sha256"] = mf.checksum(body)
    (path / "manifest.json").write_text(json.dumps(body))


def _flip(path):
    shard = path / "layer_001.safetensors.zst"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    return "layer_001"


def _truncate(path):
    shard = path / "layer_000.safetensors.zst"
    shard.write_bytes(shard.read_bytes()[:-100])
    return "layer_000"


def _remove_shard(path):
    (path / "layer_001.safetensors.zst").unlink()
    return "layer_001"


def _remove_manifest(path):
    (path / "manifest.json").unlink()
    return "manifest.json"


def _edit_manifest(path):
    _rewrite_manifest(path, lambda b: b["token_ids"].__setitem__(5, b["token_ids"][5] + 1), fix_checksum=False)
    return "checksum"


def _future_version(path):
    _rewrite_manifest(path, lambda b: b.update(format_version=99))
    return "version 99"


def _not_json(path):
    (path / "manifest.json").write_text("{not json")
    return "manifest.json"


DAMAGE = [_flip, _truncate, _remove_shard, _remove_manifest, _edit_manifest, _future_version, _not_json]


@pytest.mark.parametrize("damage", DAMAGE, ids=[d.__name__.strip("_") for d in DAMAGE])
@pytest.mark.parametrize("command", ["ask", "verify"])
def test_damaged_cache_exit_3(cache_dir, tiny_model_dir, tmp_path, damage, command):
    path = _copy(cache_dir, tmp_path)
    needle = damage(path)
    if command == "ask":
        result = run("ask", "--cache", path, "--model", tiny_model_dir, "Anything?")
    else:
        result = run("verify", path)
    assert_clean_error(result, 3, str(path), needle)


def test_missing_cache_exit_3(tmp_path):
    assert_clean_error(run("ask", "--cache", tmp_path / "nope.kv", "Q?"), 3, "nope.kv")


def test_traceback_only_with_debug(tmp_path):
    result = run("ask", "--cache", tmp_path / "nope.kv", "Q?", env={"KVCLI_DEBUG": "1"})
    assert result.exit_code == 3 and "Traceback" in result.stderr


def test_verify_prints_the_verified_caches_on_stdout(cache_dir, tmp_path):
    result = run("verify", cache_dir)
    assert result.exit_code == 0 and result.stderr == ""
    assert result.stdout.startswith(f"{cache_dir}: ok (") and len(result.stdout.splitlines()) == 1
    bad = _copy(cache_dir, tmp_path)
    _truncate(bad)
    both = run("verify", cache_dir, bad, "--quiet")
    assert both.exit_code == 3 and both.stdout == result.stdout and str(bad) in both.stderr


@pytest.mark.parametrize("damage", [_truncate, _remove_shard, _flip], ids=["truncate", "remove_shard", "flip"])
def test_info_reads_the_manifest_alone(cache_dir, tmp_path, damage):
    path = _copy(cache_dir, tmp_path)
    damage(path)
    result = run("info", path, "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["num_tokens"] == kvcli.read_manifest(cache_dir).num_tokens
    assert "verify" in " ".join(run("info", "--help").stdout.split())


def test_info_json(cache_dir):
    result = run("info", cache_dir, "--json")
    assert result.exit_code == 0
    info = json.loads(result.stdout)
    for key in ("format_version", "model", "num_tokens", "num_layers", "dtype", "bytes_on_disk", "bytes_raw"):
        assert key in info
    assert info["dtype"] == "float32" and info["num_layers"] == 2 and info["bytes_on_disk"] < info["bytes_raw"]
    assert (info["format_version"], info["shard_hash"]) == (3, "blake3")
    human = run("info", cache_dir)
    assert human.exit_code == 0 and "layer" in human.stdout and "3, shards checked with blake3" in human.stdout


def test_usage_error_exit_2(cache_dir):
    assert run("ask", "--cache", cache_dir, "--max-new-tokens", "lots", "Q?").exit_code == 2
    assert run("frobnicate").exit_code == 2


def test_trust_remote_code_needs_explicit_model(cache_dir):
    assert_clean_error(run("ask", "-c", cache_dir, "--trust-remote-code", "Q?"), 2, "--model")


def test_cache_strings_are_not_rich_markup(cache_dir, tmp_path):
    path = _copy(cache_dir, tmp_path)
    _rewrite_manifest(path, lambda b: b["document"].update(name="[/bold]evil[red]"))
    for args in (("info", path), ("ls", tmp_path)):
        result = run(*args)
        assert result.exit_code == 0, result.stderr
    assert "[/bold]evil[red]" in run("info", path).stdout


@pytest.mark.parametrize("args", [
    ("ask", "--max-new-tokens", "0", "Q?"), ("ask", "--temperature", "-1", "Q?"), ("ask", "--top-p", "0", "Q?"),
    ("ask", "--top-p", "1.5", "Q?"),
])
def test_out_of_range_generation_options_are_usage_errors(cache_dir, args):
    result = run(args[0], "-c", cache_dir, *args[1:])
    assert result.exit_code == 2 and "Traceback" not in result.stderr and result.stdout == ""


def test_bad_chunk_size_is_a_usage_error(doc_file, tiny_model_dir, tmp_path):
    result = run("prefill", doc_file, "-o", tmp_path / "c.kv", "--model", tiny_model_dir, "--chunk-size", "0")
    assert result.exit_code == 2 and not (tmp_path / "c.kv").exists()


def test_each_cut_answer_gets_one_line_on_a_terminal(cache_dir, monkeypatch):
    from kvcli.cli import output

    monkeypatch.setattr(output, "is_terminal", lambda stream: True)  # stdout and stderr a terminal
    result = run("ask", "-c", cache_dir, "--max-new-tokens", "4", "--no-server", "First?", "Second?")
    assert result.exit_code == 0, result.stderr
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 2, lines  # one per answer: the cut and its timing together
    for question, line in zip(("First?", "Second?"), lines):
        assert line.startswith(f"kvcli: note: the answer to {question!r} was cut at 4 tokens (--max-new-tokens)")
        assert line.endswith(")") and "4 tokens in " in line


def test_main_leaves_the_collector_frozen_for_the_exit(monkeypatch, capsys):
    """kvcli's main() freezes the collector after the command: the interpreter's last collections then skip what
    torch and transformers made, and a process exits in a fraction of the time (tests/bench/bench_coldstart.py)."""
    import gc
    import sys

    from kvcli.cli import main

    monkeypatch.setattr(sys, "argv", ["kvcli", "--version"])
    gc.unfreeze()
    try:
        with pytest.raises(SystemExit) as done:
            main()
        assert done.value.code == 0
        assert capsys.readouterr().out.startswith("kvcli ")
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
