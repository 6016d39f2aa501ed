"""Corpus prefill: lists, shares, skipping what is up to date (manifest only), failures that never
stop the others, and overlapping shares that still leave one valid cache per document."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcli import documents
from kvcli.engine import corpus
from kvcli.errors import UsageError
from kvcli.format import store
from tests.conftest import sample_text
from tests.helpers import assert_clean_error, json_lines, PREFILL_RECORD, REPO, run
from tests.serve_helpers import kvcli_cmd


@pytest.fixture(scope="module")
def docs(tmp_path_factory) -> list[Path]:
    folder = tmp_path_factory.mktemp("corpus-docs")
    text = sample_text()
    paths = []
    for i in range(4):
        p = folder / f"doc{i}.txt"
        p.write_text(text[i * 300 : i * 300 + 400], encoding="utf-8")
        paths.append(p)
    return paths




def write_list(path: Path, entries: list) -> Path:
    path.write_text("# a corpus\n\n" + "\n".join(str(e) for e in entries) + "\n", encoding="utf-8")
    return path


def prefill_list(listing: Path, out: Path, model: Path, *extra: str):
    return run("prefill", "--from-list", listing, "-o", out, "--model", model, "--json", "--chunk-size", "128", *extra)


# ---- the library: lists and shares


def test_read_list_skips_blanks_comments_and_repeats(tmp_path):
    listing = write_list(tmp_path / "l.txt", ["a.txt", "  b.txt  ", "a.txt", "s3://bucket/c.txt"])
    assert corpus.read_list(str(listing)) == ["a.txt", "b.txt", "s3://bucket/c.txt"]
    with pytest.raises(UsageError, match="cannot read the document list"):
        corpus.read_list(str(tmp_path / "nope.txt"))


def test_shares_cover_the_list_exactly_once():
    entries = [f"d{i}.txt" for i in range(11)]
    for n in (1, 2, 3, 5, 11, 16):
        shares = [corpus.share(entries, i, n) for i in range(n)]
        assert sorted(sum(shares, [])) == sorted(entries)
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
    assert corpus.share(entries, 1, 3) == corpus.share(entries, 1, 3)  # deterministic


@pytest.mark.parametrize("spec", ["3/3", "-1/2", "1", "a/b", "0/0", "1/2/3"])
def test_bad_shard_specs(spec):
    with pytest.raises(UsageError, match="--shard"):
        corpus.parse_shard(spec)


def test_shard_from_scheduler_environment():
    assert corpus.shard_from_env({}) is None
    assert corpus.shard_from_env({"SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_COUNT": "3"}) == (2, 3)
    slurm = {"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_STEP": "2", "SLURM_ARRAY_TASK_COUNT": "3"}
    assert corpus.shard_from_env(slurm) == (2, 3)  # --array=1-5:2 -> ids 1, 3, 5
    assert corpus.shard_from_env({"JOB_COMPLETION_INDEX": "4", "KVCLI_SHARD_COUNT": "8"}) == (4, 8)
    with pytest.raises(UsageError, match="KVCLI_SHARD_COUNT"):
        corpus.shard_from_env({"JOB_COMPLETION_INDEX": "0"})
    with pytest.raises(UsageError, match="outside"):
        corpus.shard_from_env({"JOB_COMPLETION_INDEX": "8", "KVCLI_SHARD_COUNT": "8"})
    with pytest.raises(UsageError, match="SLURM_ARRAY_TASK_ID"):
        corpus.shard_from_env({"SLURM_ARRAY_TASK_ID": "x", "SLURM_ARRAY_TASK_COUNT": "3"})


def test_cache_names_and_collisions(tmp_path):
    assert documents.cache_name("a/b/report.txt") == "report.kv"
    assert documents.cache_name("https://host/x/notes.md?v=2") == "notes.kv"
    assert documents.cache_name("https://host/licences/MPL-2.0") == "MPL-2.0.kv" and documents.cache_name("a/LGPL-2.1") == "LGPL-2.1.kv"
    assert documents.cache_name("REPORT.TXT") == "REPORT.kv" and documents.cache_name("archive.tar.gz") == "archive.tar.gz.kv"
    jobs = corpus.plan(["a/doc.txt", "b/doc.txt", "c/other.txt"], lambda e: corpus.LocalTarget(tmp_path / documents.cache_name(e)))
    assert [bool(j.error) for j in jobs] == [True, True, False]
    assert "named by 2 documents" in jobs[0].error


# ---- the command


def test_list_builds_then_skips_without_reading_shards(docs, tiny_model_dir, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    listing = write_list(tmp_path / "list.txt", docs)
    first = prefill_list(listing, out, tiny_model_dir)
    assert first.exit_code == 0, first.stderr
    rows = json_lines(first.stdout)
    assert [r["status"] for r in rows] == ["built"] * 4
    assert set(rows[0]) == PREFILL_RECORD
    assert all(r["num_tokens"] > 0 and r["seconds"] >= r["compute_s"] > 0 and r["error"] is None and r["served"] is False for r in rows)
    for r in rows:
        assert store.verify(r["cache"]).document["sha256"]

    def no_shard_reads(*_a, **_k):
        raise AssertionError("an up-to-date check read a shard")

    monkeypatch.setattr(store.OpenedCache, "read_shard", no_shard_reads)
    again = prefill_list(listing, out, tiny_model_dir)
    assert again.exit_code == 0, again.stderr
    assert [r["status"] for r in json_lines(again.stdout)] == ["skipped"] * 4
    skipped = json_lines(again.stdout)
    assert [r["num_tokens"] for r in skipped] == [r["num_tokens"] for r in rows] and {r["compute_s"] for r in skipped} == {0}
    assert [r["bytes_on_disk"] for r in skipped] == [r["bytes_on_disk"] for r in rows]
    monkeypatch.undo()

    docs[1].write_text("A new first clause.\n" + docs[1].read_text(encoding="utf-8"), encoding="utf-8")  # document changed
    docs[2].write_text(docs[2].read_text(encoding="utf-8") + "\nA new clause.", encoding="utf-8")  # document grew
    framing = prefill_list(listing, out, tiny_model_dir)
    assert [r["status"] for r in json_lines(framing.stdout)] == ["skipped", "built", "extended", "skipped"]
    system = prefill_list(listing, out, tiny_model_dir, "--system", "Be brief.")  # framing changed: all stale
    assert [r["status"] for r in json_lines(system.stdout)] == ["built"] * 4
    forced = prefill_list(listing, out, tiny_model_dir, "--system", "Be brief.", "--force")
    assert [r["status"] for r in json_lines(forced.stdout)] == ["built"] * 4
    assert sorted(p.name for p in out.iterdir()) == [f"doc{i}.kv" for i in range(4)]  # no leftovers


def test_another_model_makes_caches_stale(docs, tiny_model_dir, tmp_path):
    from tests.conftest import tiny_llama

    other = tmp_path / "other-model"
    tiny_llama(len(__import__("transformers").AutoTokenizer.from_pretrained(tiny_model_dir)), seed=7).save_pretrained(other)
    for f in tiny_model_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            (other / f.name).write_bytes(f.read_bytes())
    out = tmp_path / "out"
    out.mkdir()
    listing = write_list(tmp_path / "list.txt", docs[:2])
    assert prefill_list(listing, out, tiny_model_dir).exit_code == 0
    result = prefill_list(listing, out, other)
    assert [r["status"] for r in json_lines(result.stdout)] == ["built", "built"]


def test_kv_bits_with_a_list_builds_quantized_caches_and_another_storage_makes_them_stale(docs, tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    listing = write_list(tmp_path / "list.txt", docs[:2])
    built = prefill_list(listing, out, tiny_model_dir, "--kv-bits", "8")
    assert built.exit_code == 0, built.stderr
    assert [r["status"] for r in json_lines(built.stdout)] == ["built", "built"]
    assert [store.verify(out / f"doc{i}.kv").quant["bits"] for i in range(2)] == [8, 8]
    again = prefill_list(listing, out, tiny_model_dir, "--kv-bits", "8")
    assert [r["status"] for r in json_lines(again.stdout)] == ["skipped", "skipped"]
    for extra, want in ((("--kv-bits", "4"), 4), ((), None)):  # another storage: rebuilt as asked
        result = prefill_list(listing, out, tiny_model_dir, *extra)
        assert [r["status"] for r in json_lines(result.stdout)] == ["built", "built"], result.stderr
        assert (store.verify(out / "doc0.kv").quant or {}).get("bits") == want
    assert [r["status"] for r in json_lines(prefill_list(listing, out, tiny_model_dir).stdout)] == ["skipped", "skipped"]


def test_failures_never_stop_the_others(docs, tiny_model_dir, tmp_path):
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\x00\x01\x02 not text")
    twin = tmp_path / "twin"
    twin.mkdir()
    (twin / "doc0.txt").write_text("same name as another document", encoding="utf-8")
    listing = write_list(tmp_path / "list.txt", [docs[0], tmp_path / "missing.txt", binary, docs[2], twin / "doc0.txt"])
    out = tmp_path / "out"
    out.mkdir()
    result = prefill_list(listing, out, tiny_model_dir)
    assert result.exit_code == 1
    rows = {Path(r["document"]).name + ("@twin" if "twin" in r["document"] else ""): r for r in json_lines(result.stdout)}
    assert rows["doc2.txt"]["status"] == "built"
    assert rows["missing.txt"]["status"] == "failed" and "no such file" in rows["missing.txt"]["error"]
    assert rows["binary.txt"]["status"] == "failed" and "binary" in rows["binary.txt"]["error"]
    assert rows["doc0.txt"]["status"] == rows["doc0.txt@twin"]["status"] == "failed"  # both name out/doc0.kv
    assert "named by 2 documents" in rows["doc0.txt"]["error"]
    assert "1 built, 0 skipped, 4 failed of 5 documents" in result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["doc2.kv"]


def test_shard_option_and_environment_pick_the_share(docs, tiny_model_dir, tmp_path):
    listing = write_list(tmp_path / "list.txt", docs)
    out = tmp_path / "out"
    out.mkdir()
    one = prefill_list(listing, out, tiny_model_dir, "--shard", "1/3")
    assert [Path(r["document"]).name for r in json_lines(one.stdout)] == ["doc1.txt"]
    env = run("prefill", "--from-list", listing, "-o", out, "--model", tiny_model_dir, "--json",
              env={"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_COUNT": "3"})
    assert [Path(r["document"]).name for r in json_lines(env.stdout)] == ["doc0.txt", "doc3.txt"]
    k8s = run("prefill", "--from-list", listing, "-o", out, "--model", tiny_model_dir, "--json",
              env={"JOB_COMPLETION_INDEX": "2", "KVCLI_SHARD_COUNT": "3"})
    assert [(Path(r["document"]).name, r["status"]) for r in json_lines(k8s.stdout)] == [("doc2.txt", "built")]
    empty = prefill_list(listing, out, tiny_model_dir, "--shard", "5/6")
    assert empty.exit_code == 0 and empty.stdout == "" and "no documents to prefill (shard 5/6)" in empty.stderr


def test_list_from_stdin_and_usage_errors(docs, tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    result = run("prefill", "--from-list", "-", "-o", out, "--model", tiny_model_dir, "--json", input=f"{docs[0]}\n")
    assert [r["status"] for r in json_lines(result.stdout)] == ["built"]
    assert_clean_error(run("prefill", docs[0], "--shard", "0/2"), 2, "--shard needs --from-list")
    assert_clean_error(run("prefill", "--from-list", tmp_path / "none.txt"), 2, "cannot read the document list")
    made = run("prefill", "--from-list", "-", "-o", tmp_path / "nowhere", input=f"{docs[0]}\n")  # -o DIR is created (issue 24)
    assert made.exit_code == 0 and (tmp_path / "nowhere").is_dir() and any((tmp_path / "nowhere").iterdir()), made.stderr
    assert_clean_error(run("prefill", "--from-list", "-", "--shard", "2/2", input="x\n"), 2, "--shard 2/2")
    assert_clean_error(run("prefill"), 2, "no document given")


def test_overlapping_shares_leave_one_valid_cache_each(docs, tiny_model_dir, tmp_path):
    """Two processes given the same share by mistake, at once: every document ends with one valid cache."""
    listing = write_list(tmp_path / "list.txt", docs)
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "kvcli", "prefill", "--from-list", str(listing), "-o", str(out), "--model", str(tiny_model_dir),
           "--json", "--quiet", "--chunk-size", "64"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [r[1] for r in results]
    statuses: dict[str, list[str]] = {}
    for stdout, _ in results:
        for row in json_lines(stdout):
            statuses.setdefault(Path(row["document"]).name, []).append(row["status"])
    assert sorted(statuses) == [d.name for d in docs]
    assert all("built" in s for s in statuses.values())  # at least one process built each (the other built or skipped)
    assert sorted(p.name for p in out.iterdir()) == [f"doc{i}.kv" for i in range(4)]  # one cache each, no temporary folders
    for d in docs:
        assert store.verify(out / (d.stem + ".kv")).document["sha256"] == __import__("hashlib").sha256(d.read_bytes()).hexdigest()


# ---- where several documents' caches go


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


def test_output_folder_for_several_documents_is_created(tmp_path, tiny_model_dir):
    doc_file = tmp_path / "lic.txt"
    doc_file.write_text(sample_text()[:2500], encoding="utf-8")
    other = tmp_path / "other.txt"
    other.write_text("A short document about ducks and ponds.", encoding="utf-8")
    out = tmp_path / "new" / "sub"
    result = run("prefill", doc_file, other, "-o", out, "--model", tiny_model_dir)
    assert result.exit_code == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["lic.kv", "other.kv"]
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert_clean_error(run("prefill", doc_file, other, "-o", afile, "--model", tiny_model_dir), 2, "afile", "folder")


def test_from_list_creates_the_output_folder_under_concurrent_tasks(tiny_model_dir, tmp_path):
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


# ---- the driver itself


def test_the_driver_isolates_failures_but_an_asker_leaving_ends_the_run(docs, tiny_lm, tmp_path):
    """engine.corpus.run as plain prefill runs it: every document checked first, the model opened only when one is
    built, a failure a record (its error kept to raise), and an exception from the caller's progress callback
    ending the run instead of failing one document."""
    opened = []

    def model():
        from contextlib import nullcontext

        opened.append(1)
        return nullcontext(corpus.lent(tiny_lm))

    jobs = [corpus.Job(str(tmp_path / "missing.txt"), corpus.LocalTarget(tmp_path / "missing.kv")),
            corpus.Job(str(docs[0]), corpus.LocalTarget(tmp_path / "d0.kv"))]
    records = list(corpus.run(model, jobs, read=documents.read, incremental=False, upfront=True, chunk_size=64))
    assert [(r.index, r.status) for r in records] == [(0, "failed"), (1, "built")] and opened == [1]
    assert "no such file" in records[0].error and isinstance(records[0].exc, Exception)
    assert set(records[1].to_json()) == PREFILL_RECORD and records[1].num_tokens == store.verify(tmp_path / "d0.kv").num_tokens

    class Gone(Exception):
        pass

    def leave(*_):
        raise Gone()

    with pytest.raises(Gone):
        list(corpus.run(model, [corpus.Job(str(docs[1]), corpus.LocalTarget(tmp_path / "d1.kv"))], read=documents.read,
                        incremental=False, progress=leave))
    assert not (tmp_path / "d1.kv").exists() and list(tmp_path.glob(".*")) == []  # nothing left, no lock
