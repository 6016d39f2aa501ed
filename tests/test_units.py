"""The one size and duration parser (kvcli/units.py), and every option and variable that reads one."""

from __future__ import annotations

import pytest

from kvcli.errors import UsageError
from kvcli.units import parse_duration, parse_size
from tests.helpers import assert_clean_error, run


@pytest.mark.parametrize("text,size", [
    ("512", 512), ("512B", 512), ("1KB", 1000), ("1kb", 1000), ("1MB", 10**6), ("1GB", 10**9), ("1.5GB", 1_500_000_000),
    ("2TB", 2 * 10**12), ("1KiB", 1024), ("1MiB", 1 << 20), ("1GiB", 1 << 30), ("1TiB", 1 << 40), ("512M", 512 << 20),
    ("8G", 8 << 30), ("8g", 8 << 30), ("1.5G", 3 << 29), ("64k", 64 << 10), ("2 GiB", 2 << 30), (" 3T ", 3 << 40),
])
def test_sizes(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text,seconds", [
    ("30", 30), ("30s", 30), ("5m", 300), ("5min", 300), ("2h", 7200), ("7d", 7 * 86400), ("2w", 14 * 86400),
    ("1.5h", 5400), ("90M", 5400), ("0.5d", 43200),
])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["", "lots", "8X", "-1G", "0", "1..5G", "G", "1 G B"])
def test_bad_sizes_name_the_option(bad):
    with pytest.raises(UsageError, match="--max-memory"):
        parse_size(bad)
    assert parse_size("0", "$X", zero=True) == 0


@pytest.mark.parametrize("bad", ["", "soon", "3y", "0", "-5m"])
def test_bad_durations_name_the_option(bad):
    with pytest.raises(UsageError, match="--older-than"):
        parse_duration(bad, "--older-than")


def test_every_option_reads_the_same_units(monkeypatch, tmp_path):
    from kvcli.remote import local_store

    monkeypatch.setenv(local_store.MAX_VARIABLE, "1GB")
    assert local_store.max_bytes() == 10**9  # as --max-memory 1GB
    monkeypatch.setenv(local_store.MAX_VARIABLE, "1G")
    assert local_store.max_bytes() == 1 << 30
    monkeypatch.setenv(local_store.MAX_VARIABLE, "0")
    assert local_store.max_bytes() == 0
    monkeypatch.setenv(local_store.MAX_VARIABLE, "huge")
    with pytest.raises(UsageError, match="KVCLI_REMOTE_STORE_MAX"):
        local_store.max_bytes()
    assert run("prune", str(tmp_path), "--older-than", "2w").exit_code == 0
    assert_clean_error(run("prune", str(tmp_path), "--older-than", "7"), 2, "--older-than", "a number and a unit")
    assert_clean_error(run("prune", str(tmp_path), "--older-than", "soon"), 2, "--older-than")
    assert_clean_error(run("serve", "--idle-timeout", "2x", "--socket", str(tmp_path / "s.sock")), 2, "--idle-timeout")
    assert_clean_error(run("serve", "--max-memory", "8X", "--socket", str(tmp_path / "s.sock")), 2, "--max-memory")
