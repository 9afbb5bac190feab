"""Offline calibration and held-out texts for the accuracy bench (bench/accuracy.py).

Both come from files that the PyPI package ``gensim`` ships as test data (installed with
``pip install --no-deps gensim==4.4.0``; nothing of gensim is imported, only its files are read,
found through ``importlib.util.find_spec``):

* encyclopedia text: ``test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2``,
  a shortened English Wikipedia dump (2016, 206 pages). Articles (namespace 0, not redirects) are
  turned into plain text by :func:`wiki_plain_text`. Articles are assigned alternately, in dump
  order, to the calibration side (even positions) and to the held-out side (odd positions), so no
  article contributes to both;
* news: ``test_data/lee_background.cor``, 300 news articles of the Australian Broadcasting
  Corporation (the Lee corpus), one article per line: held-out only (out of domain).

A token stream is cut into consecutive, non-overlapping windows (:func:`token_windows`).
"""

from __future__ import annotations

import bz2
import html
import importlib.util
import re
import xml.etree.ElementTree as ElementTree
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "GENSIM_VERSION",
    "WIKI_FILE",
    "NEWS_FILE",
    "TextSources",
    "find_sources",
    "wiki_articles",
    "wiki_plain_text",
    "news_articles",
    "split_articles",
    "token_windows",
]

GENSIM_VERSION = "4.4.0"
WIKI_FILE = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
NEWS_FILE = "lee_background.cor"
INSTALL_HINT = f"pip install --no-deps gensim=={GENSIM_VERSION}"
MIN_ARTICLE_CHARS = 500  # shorter pages are stubs or lists


@dataclass(frozen=True)
class TextSources:
    """Where the two source files are."""

    wiki: Path
    news: Path


def find_sources() -> TextSources:
    """The gensim test files, located without importing gensim.

    :raises FileNotFoundError: saying how to install them when gensim is missing.
    """
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the bench texts come from gensim's test data: {INSTALL_HINT}")
    data = Path(list(spec.submodule_search_locations)[0]) / "test" / "test_data"
    sources = TextSources(data / WIKI_FILE, data / NEWS_FILE)
    for path in (sources.wiki, sources.news):
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing; reinstall: {INSTALL_HINT}")
    return sources


def _local(tag: str) -> str:
    """An XML tag without its namespace."""
    return tag.rpartition("}")[2]


def wiki_articles(path: Path) -> list[tuple[str, str]]:
    """``(title, plain text)`` of the dump's articles (namespace 0, no redirect, at least
    :data:`MIN_ARTICLE_CHARS` characters of text), in dump order."""
    with bz2.open(path, "rb") as handle:
        root = ElementTree.parse(handle).getroot()
    articles = []
    for page in root:
        if _local(page.tag) != "page":
            continue
        fields = {_local(child.tag): child for child in page}
        if fields.get("ns") is None or (fields["ns"].text or "").strip() != "0":
            continue
        if "redirect" in fields:
            continue
        revision = fields.get("revision")
        text_node = None if revision is None else _find_child(revision, "text")
        raw = "" if text_node is None else (text_node.text or "")
        if raw.lstrip().upper().startswith("#REDIRECT"):
            continue
        text = wiki_plain_text(raw)
        if len(text) >= MIN_ARTICLE_CHARS:
            title = (fields["title"].text or "") if "title" in fields else ""
            articles.append((title, text))
    return articles


def _find_child(node: ElementTree.Element, name: str) -> ElementTree.Element | None:
    return next((child for child in node if _local(child.tag) == name), None)


_COMMENT = re.compile(r"<!--.*?-->", re.S)
_REF = re.compile(r"<ref[^>/]*/>|<ref[^>]*>.*?</ref>", re.S | re.I)
_DROPPED_ELEMENTS = re.compile(r"<(math|gallery|timeline|source|pre)[^>]*>.*?</\1>", re.S | re.I)
_TAG = re.compile(r"</?[a-zA-Z][^>]*>")
_TEMPLATE = re.compile(r"\{\{[^{}]*\}\}")
_TABLE = re.compile(r"\{\|[^{}]*?\|\}", re.S)
_FILE_LINK = re.compile(r"\[\[(?:File|Image|Category|Media):[^\[\]]*\]\]", re.I)
_INTERWIKI = re.compile(r"\[\[[a-z\-]{2,12}:[^\[\]]*\]\]")
_LINK = re.compile(r"\[\[([^\[\]|]*\|)?([^\[\]]*)\]\]")
_EXTERNAL = re.compile(r"\[(?:https?|ftp)://[^\s\]]+\s*([^\]]*)\]")
_EMPHASIS = re.compile(r"'{2,}")
_HEADING = re.compile(r"^=+\s*(.*?)\s*=+\s*$", re.M)
_LIST_PREFIX = re.compile(r"^[*#:;]+\s*", re.M)
# Trailing sections that are lists of references, not prose: the article is cut at the first one.
_BACK_MATTER = re.compile(
    r"^=+\s*(See also|References|Notes|Footnotes|Further reading|External links|Bibliography|"
    r"Sources|Citations)\s*=+\s*$",
    re.M | re.I,
)


def _remove_nested(pattern: re.Pattern[str], text: str) -> str:
    """Remove innermost matches until none is left (templates and tables nest)."""
    while True:
        text, count = pattern.subn("", text)
        if count == 0:
            return text


def wiki_plain_text(raw: str) -> str:
    """Readable prose from MediaWiki markup: templates, tables, references, files and categories
    dropped; links replaced by their label; headings kept as lines; paragraphs separated by one
    blank line; everything from the first reference section (See also, References, External
    links, ...) on is cut. Lines without a letter, and lines that still look like markup, are dropped."""
    text = html.unescape(raw)
    back_matter = _BACK_MATTER.search(text)
    if back_matter is not None:
        text = text[: back_matter.start()]
    text = _COMMENT.sub("", text)
    text = _REF.sub("", text)
    text = _DROPPED_ELEMENTS.sub("", text)
    text = _remove_nested(_TEMPLATE, text)
    text = _remove_nested(_TABLE, text)
    for _ in range(3):  # links inside file captions
        text = _FILE_LINK.sub("", text)
        text = _INTERWIKI.sub("", text)
        text = _LINK.sub(lambda m: m.group(2), text)
    text = _EXTERNAL.sub(lambda m: m.group(1), text)
    text = _TAG.sub("", text)
    text = _EMPHASIS.sub("", text)
    text = _HEADING.sub(lambda m: m.group(1), text)
    text = _LIST_PREFIX.sub("", text)
    paragraphs: list[str] = []
    for block in re.split(r"\n\s*\n", text):
        lines = [line.strip() for line in block.splitlines()]
        kept = [
            line
            for line in lines
            if re.search(r"[A-Za-z]", line) and not line.startswith(("|", "!", "{", "}"))
        ]
        if kept:
            paragraphs.append("\n".join(kept))
    return "\n\n".join(paragraphs)


def news_articles(path: Path) -> list[str]:
    """The Lee corpus: one news article per non-empty line."""
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def split_articles(articles: Sequence[str]) -> tuple[list[str], list[str]]:
    """Alternate articles between two disjoint sides: (even positions, odd positions)."""
    return list(articles[0::2]), list(articles[1::2])


def token_windows(
    texts: Sequence[str], encode: object, count: int, length: int, separator: str = "\n\n"
) -> list[list[int]]:
    """``count`` consecutive windows of ``length`` tokens from the texts joined by ``separator``
    and tokenized once (``encode(text) -> list[int]``).

    :raises ValueError: when the texts hold fewer than ``count * length`` tokens.
    """
    assert callable(encode)
    ids: list[int] = list(encode(separator.join(texts)))
    needed = count * length
    if len(ids) < needed:
        raise ValueError(f"the texts have {len(ids)} tokens, fewer than {count} x {length}")
    return [ids[i * length : (i + 1) * length] for i in range(count)]
