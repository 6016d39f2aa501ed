"""kvcli rm, prune and ls: rm removes caches and refuses anything else (then removes nothing), prune clears
dead leftovers and old caches, ls says when there is no cache."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import assert_clean_error, json_lines, run


# ---- rm


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


# ---- prune and ls


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
