"""Sectioned caches through every way in: chains (--after), blends, follow-ups and --kv-bits are refused with a
message saying why, before anything is written."""

from __future__ import annotations

import pytest

from tests.conftest import sample_text
from tests.helpers import assert_clean_error, json_lines, run

Q = "What does the licence say about trademarks?"
ASK = ("--max-new-tokens", "4", "--json")


@pytest.fixture(scope="module")
def cached(tiny_model_dir, here):
    folder = here / "docs"
    folder.mkdir()
    doc = here / "long.txt"
    doc.write_text(sample_text(), encoding="utf-8")
    made = run("prefill", doc, "-o", folder / "long.kv", "--model", tiny_model_dir, "--window", "1024", "--no-server")
    assert made.exit_code == 0, made.stderr
    return folder / "long.kv"


@pytest.fixture(scope="module")
def plain(cached, tiny_model_dir, here):
    """A cache of one prompt beside the sectioned one."""
    doc = here / "short.txt"
    doc.write_text(sample_text()[:1200], encoding="utf-8")
    made = run("prefill", doc, "-o", cached.parent / "short.kv", "--model", tiny_model_dir, "--no-server")
    assert made.exit_code == 0, made.stderr
    return cached.parent / "short.kv"


def test_chains_blends_and_kv_bits_are_refused_saying_why(cached, plain, tiny_model_dir, here):
    doc, short = here / "long.txt", here / "short.txt"
    m = ("--model", tiny_model_dir, "--no-server")
    assert_clean_error(run("prefill", short, "-o", here / "c1.kv", "--after", cached, *m), 2,
                       "is a sectioned cache", "--after extends only a cache of one prompt")
    assert_clean_error(run("prefill", doc, "-o", here / "c2.kv", "--after", plain, "--window", "1024", *m), 2,
                       "--window", "(--after) is not cut")
    assert_clean_error(run("prefill", doc, "-o", here / "c3.kv", "--window", "1024", "--kv-bits", "8", *m), 2,
                       "--kv-bits does not apply to a sectioned cache")
    for order in ((cached, plain), (plain, cached)):
        blended = run("ask", "--blend", "-c", order[0], "-c", order[1], "Who?", *m)
        assert_clean_error(blended, 3, f"{cached}: a sectioned cache", "cannot be blended")
    assert_clean_error(run("ask", "-c", cached, "Who?", "--follow-up", here / "earlier.json", *m), 2,
                       "--follow-up cannot continue a sectioned cache's prompt")
    assert not any((here / f"c{i}.kv").exists() for i in (1, 2, 3))
    both = run("ask", "-c", cached, "-c", plain, "Who?", "--max-new-tokens", "2", "--json", *m)  # one after the other
    assert both.exit_code == 0, both.stderr
    first, second = json_lines(both.stdout)
    assert first["sources"] and "sources" not in second
