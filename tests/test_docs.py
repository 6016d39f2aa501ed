"""README.md stays a newcomer's page (short, no run diary), and every path README.md and docs/ name exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# `kvcli/...`, `tests/...` or `docs/...` as a path, not a module name or a word: a file name or a folder's trailing slash
PATH = re.compile(r"(?<![\w./-])((?:kvcli|tests|docs)/[\w./-]*[\w/])")
# `engine/answer.py`: a module named from inside the package, found under kvcli/ (or the repository root)
MODULE = re.compile(r"`([\w.]+/[\w./-]*\.py)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
BANNED = (re.compile(r"load average", re.I), re.compile(r"\b\d{1,2}:\d{2}(?:-\d{1,2}:\d{2})? UTC\b"), re.compile(r"this project's machines?", re.I),
          re.compile(r"\b[0-9a-f]{7,40}\b"))


def test_readme_fits_on_a_few_screens():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200 and len(text.encode()) <= 12 * 1024


@pytest.mark.parametrize("pattern", BANNED, ids=lambda p: p.pattern)
def test_readme_names_no_run_of_one_afternoon(pattern):
    lines = [line for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines() if pattern.search(line)]
    assert lines == []


def _named_paths(page: Path) -> set[str]:
    text = page.read_text(encoding="utf-8")
    text = re.sub(r"https?://\S+", "", text)  # a URL's path is not this repository's
    return {m.rstrip("/.") for m in PATH.findall(text)}


def _exists(path: str) -> bool:
    return (ROOT / path).exists() or (not path.startswith(("kvcli/", "tests/", "docs/")) and (ROOT / "kvcli" / path).exists())


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_path_a_page_names_exists(page):
    named = _named_paths(page) | set(MODULE.findall(page.read_text(encoding="utf-8")))
    missing = sorted(p for p in named if not _exists(p))
    assert missing == [], f"{page.relative_to(ROOT)} names paths that do not exist"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page):
    text = page.read_text(encoding="utf-8")
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(target)
    assert broken == [], f"{page.relative_to(ROOT)} links to what does not exist"


def _anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens."""
    heads = re.findall(r"^#+\s+(.*?)\s*$", page.read_text(encoding="utf-8"), re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower().replace("`", "")).replace(" ", "-") for h in heads}


# A user guide says what is true now: no dated run, no issue number, no session (history goes to CHANGELOG.md).
DIARY = (*BANNED, re.compile(r"\b20\d\d-\d\d-\d\d\b"), re.compile(r"\bissues? \d+", re.I),
         re.compile(r"\b(?:this|earlier|next) session\b|\btoday\b", re.I))
DOCS = sorted((ROOT / "docs").glob("*.md"))


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_page_of_docs_is_a_diary(page):
    lines = [line for line in page.read_text(encoding="utf-8").splitlines() if any(p.search(line) for p in DIARY)]
    assert lines == []


def _sections(page: Path) -> dict[str, str]:
    """Each `## ` section's heading -> its text (the intro before the first one left out)."""
    parts = re.split(r"^## +(.+?)\s*$", page.read_text(encoding="utf-8"), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def _commands(text: str) -> list[str]:
    """Lines of fenced code blocks that run kvcli or python, comments cut off."""
    blocks = re.findall(r"^```[\w-]*\n(.*?)^```", text, re.M | re.S)
    lines = (line.split(" #")[0].strip() for block in blocks for line in block.splitlines())
    return [line for line in lines if line.startswith(("kvcli ", "python "))]


PERFORMANCE = ROOT / "docs" / "performance.md"


def test_every_benchmark_section_names_the_command_that_reproduces_it():
    sections = _sections(PERFORMANCE)
    assert sections, "docs/performance.md has no sections"
    assert [head for head, text in sections.items() if not _commands(text)] == []


def test_every_benchmark_command_takes_the_options_it_is_given():
    wrong = []
    cli_source = "".join(p.read_text(encoding="utf-8") for p in sorted((ROOT / "kvcli" / "cli").glob("*.py")))
    for text in _sections(PERFORMANCE).values():
        for line in _commands(text):
            words = line.split()
            if words[0] == "python":
                script = ROOT / words[1]
                assert script.is_file(), line
                source = script.read_text(encoding="utf-8")
            else:
                source = cli_source
            wrong += [f"{line}: {flag}" for flag in re.findall(r"(?<!\S)(--[\w-]+)", line) if f'"{flag}"' not in source]
    assert wrong == []


SOURCE_FILE = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.py)\b")


def test_every_path_kvcli_sources_name_exists():
    """A comment's or docstring's `engine/decoding/solo.py`, `solo.py` or `tests/bench/bench_decode.py` is a file:
    from the repository root, from kvcli/, or from the naming file's own package or one above it."""
    missing = []
    for source in sorted((ROOT / "kvcli").rglob("*.py")):
        text = re.sub(r"https?://\S+", "", source.read_text(encoding="utf-8"))
        bases = [ROOT, *(p for p in source.parents if p.is_relative_to(ROOT / "kvcli"))]
        named = {m.rstrip("/.") for m in PATH.findall(text)} | set(SOURCE_FILE.findall(text))
        missing += [f"{source.relative_to(ROOT)}: {name}" for name in sorted(named)
                    if not any((base / name).exists() for base in bases)]
    assert missing == []
