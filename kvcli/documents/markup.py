"""HTML to the text a model reads, with the standard library's parser: headings as `# Heading` lines, list items as
`- item`, table cells joined by ` | `; scripts, styles, menus, headers, footers, sidebars and forms left out.

A web page keeps only its main content: the `<main>` element (or role="main") if there is one, else its
`<article>` elements, else the whole body, always less what is marked as navigation or page furniture. An EPUB
chapter (`web=False`) keeps its whole body. The output depends on the bytes alone (deterministic).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from html.parser import HTMLParser

VERSION = 1  # of this module's output: bump it when the text it makes changes, so caches of HTML and EPUB are rebuilt
SKIP = {"script", "style", "noscript", "template", "svg", "math", "iframe", "canvas", "object", "embed", "head", "nav", "aside",
        "footer", "form", "button", "select", "textarea", "dialog", "menu"}
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "param", "source", "track", "wbr"}
BLOCK = {"p", "div", "section", "article", "main", "header", "li", "ul", "ol", "dl", "dt", "dd", "tr", "table", "thead", "tbody",
         "blockquote", "pre", "figure", "figcaption", "br", "hr", "body", "address", "details", "summary", "caption", "center"}
HEADINGS = {f"h{n}": n for n in range(1, 7)}
SKIP_ROLES = {"navigation", "banner", "contentinfo", "complementary", "search", "menu", "menubar", "dialog", "alertdialog", "toolbar"}
# class/id words of page furniture (split on spaces, '-' and '_'): "site-nav", "cookie_banner", "share-buttons"
FURNITURE = {"nav", "navbar", "navigation", "menu", "sidebar", "breadcrumb", "breadcrumbs", "cookie", "cookies", "consent", "share",
             "sharing", "social", "related", "advert", "advertisement", "ads", "promo", "newsletter", "comments", "subscribe",
             "popup", "modal", "skip", "footer", "masthead", "toolbar", "pagination"}
_WORDS = re.compile(r"[\s_-]+")
_SPACE = re.compile(r"\s+")
MAX_DEPTH = 512  # open elements kept track of; deeper nesting (hostile markup) is flattened
PIECE = 1 << 20  # characters fed to the parser at a time, the time limit checked between pieces


class _Blocks(HTMLParser):
    """Collects blocks of text with the scope each was in: (kind, text, in_main, in_article)."""

    def __init__(self, web: bool):
        super().__init__(convert_charrefs=True)
        self.web = web
        self.stack: list[tuple[str, bool, bool]] = []  # (tag, skipped, main content)
        self.open: Counter[str] = Counter()  # tags on the stack, to tell a stray end tag at once
        self.skipping = self.main = self.article = self.pre = 0
        self.blocks: list[tuple[str, str, bool, bool]] = []
        self.line: list[str] = []
        self.kind = "p"
        self.cells = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in BLOCK or tag in HEADINGS or tag in ("td", "th"):
            self._flush_cell(tag)
        if tag in VOID:
            return
        skip = self._skip(tag, dict(attrs))
        if len(self.stack) >= MAX_DEPTH:
            return
        main = tag == "main" or dict(attrs).get("role") == "main"
        self.stack.append((tag, skip, main))
        self.open[tag] += 1
        self.skipping += skip
        self.main += main
        self.article += tag == "article"
        self.pre += tag == "pre"
        if tag in HEADINGS:
            self.kind = "#" * HEADINGS[tag]
        elif tag == "li":
            self.kind = "-"

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in BLOCK:
            self._flush()

    def handle_endtag(self, tag: str) -> None:
        if not self.open[tag]:
            return  # a stray end tag
        if tag in BLOCK or tag in HEADINGS:
            self._flush()
        while self.stack:
            t, skip, main = self.stack.pop()
            self.open[t] -= 1
            self.skipping -= skip
            self.main -= main
            self.article -= t == "article"
            self.pre -= t == "pre"
            if t == tag:
                break
        if tag in ("tr", "table"):
            self.cells = 0

    def handle_data(self, data: str) -> None:
        if not self.skipping:
            self.line.append(data if self.pre else _SPACE.sub(" ", data))

    def _skip(self, tag: str, attrs: dict[str, str | None]) -> bool:
        if tag in SKIP or "hidden" in attrs or attrs.get("aria-hidden") == "true":
            return True
        if not self.web:
            return False
        if tag == "header" and not (self.main or self.article):  # a page's masthead; an article's header holds its title
            return True
        if (attrs.get("role") or "") in SKIP_ROLES:
            return True
        words = set(_WORDS.split(f"{attrs.get('class') or ''} {attrs.get('id') or ''}".lower()))
        return bool(words & FURNITURE) and tag not in ("body", "main", "article", "html")

    def _flush_cell(self, tag: str) -> None:
        if tag in ("td", "th"):
            if self.cells and not self.skipping:
                self.line.append(" | ")
            self.cells += 1
        else:
            self._flush()

    def _flush(self) -> None:
        text = "".join(self.line)
        text = text.strip("\n") if self.pre else _SPACE.sub(" ", text).strip(" |")
        if text:
            self.blocks.append((self.kind, text, self.main > 0, self.article > 0))
        self.line, self.kind = [], "p"

    def close(self) -> None:
        super().close()
        self._flush()


def to_text(html: str, web: bool = True, check: Callable[[], None] | None = None) -> tuple[str, int]:
    """(text, headings kept): the page's main content (web) or a whole chapter (web=False); check() (a time limit)
    runs between pieces of the input."""
    parser = _Blocks(web)
    for start in range(0, len(html), PIECE):
        parser.feed(html[start:start + PIECE])
        if check is not None:
            check()
    parser.close()
    blocks = parser.blocks
    if web:
        everything = sum(len(b[1]) for b in blocks)
        for scope in (2, 3):  # <main>, then <article>: used when it holds a fair part of the page's text
            chosen = [b for b in blocks if b[scope]]
            if chosen and sum(len(b[1]) for b in chosen) >= min(500, everything // 4):
                blocks = chosen
                break
    lines: list[str] = []
    headings = 0
    for kind, text, *_ in blocks:
        if kind.startswith("#"):
            headings += 1
            lines.append(f"\n{kind} {text}")
        else:
            lines.append(f"- {text}" if kind == "-" else text)
    return "\n".join(lines).strip("\n"), headings


def charset(head: bytes) -> str | None:
    """The charset an HTML or XHTML file declares in its first bytes (meta charset, http-equiv or XML declaration)."""
    m = re.search(rb"""<meta[^>]+charset\s*=\s*["']?([A-Za-z0-9_.:-]+)|<\?xml[^>]+encoding\s*=\s*["']([A-Za-z0-9_.:-]+)""", head[:4096], re.I)
    return (m.group(1) or m.group(2)).decode("ascii") if m else None
