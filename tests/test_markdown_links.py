"""The repository's markdown files: every relative link names a file that exists and every
#anchor a heading of that file, by GitHub's rules for heading anchors (the README split into
docs/ moved headings between files)."""
import re
import subprocess
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

_FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.M | re.S)
_INLINE_CODE = re.compile(r"(`+)(?!`).+?(?<!`)\1(?!`)", re.S)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$", re.M)
_HTML_ID = re.compile(r"<a\s[^>]*(?:name|id)=\"([^\"]+)\"", re.I)


def markdown_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.split()
    return [ROOT / name for name in listed]


def _prose(text: str) -> str:
    """The text with code blocks and code spans blanked (links there are no links)."""
    return _FENCE.sub("", text)


def heading_text(raw: str) -> str:
    """A heading's text as GitHub renders it: code spans, links and emphasis reduced to their
    text, HTML tags dropped."""
    text = _INLINE_CODE.sub(lambda m: m.group(0)[len(m.group(1)):-len(m.group(1))], raw)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text)
    return re.sub(r"(\*+|(?<!\w)_+|_+(?!\w))", "", text)


def github_slug(text: str) -> str:
    """GitHub's anchor of a heading's text: lower case, every character that is not a letter,
    a digit, a space, a hyphen or an underscore dropped, each space a hyphen."""
    kept = "".join(c for c in text.lower().strip()
                   if c in " -_" or unicodedata.category(c)[0] in "LNM")
    return kept.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives a file: one per heading (a repeated one gets -1, -2, ...),
    and those of HTML `<a name=...>` / `id=...`."""
    seen: dict[str, int] = {}
    out = set(_HTML_ID.findall(text))
    for _, raw in _HEADING.findall(_prose(text)):
        slug = github_slug(heading_text(raw))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def relative_links(text: str) -> list[str]:
    prose = _INLINE_CODE.sub("", _prose(text))
    targets = _LINK.findall(prose) + _REFERENCE.findall(prose)
    return [t for t in targets if t and not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I)]


def broken_links(path: Path) -> list[str]:
    """Each relative link of markdown file `path` whose file or #anchor is missing."""
    broken = []
    for target in relative_links(path.read_text(encoding="utf-8")):
        name, _, anchor = target.partition("#")
        dest = (path.parent / name).resolve() if name else path
        if not dest.exists() or ROOT not in dest.parents:
            broken.append(f"{target} (no file {dest} in the repository)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(
                dest.read_text(encoding="utf-8")):
            broken.append(f"{target} (no heading gives #{anchor})")
    return broken


def test_github_anchor_rules():
    assert github_slug(heading_text("Start-up (`make run`, `kiln generate`; early December "
                                    "2026)")) == "start-up-make-run-kiln-generate-early-december-2026"
    assert github_slug(heading_text("W8A8 int8 end to end (2026-12-02 to 12-05)")) == \
        "w8a8-int8-end-to-end-2026-12-02-to-12-05"
    assert github_slug(heading_text("The **Python** API: [LLM](x.md) & `generate()`")) == \
        "the-python-api-llm--generate"
    assert github_slug(heading_text("kv_cache_dtype, Déjà vu")) == "kv_cache_dtype-déjà-vu"
    text = "# A\n```\n# not a heading\n```\n## A\n### B #\n"
    assert anchors(text) == {"a", "a-1", "b"}


def test_links_are_found_outside_code_only(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("[a](b.md#x) `[c](d.md)` [e](https://x.y/z#q) [f](#here)\n"
                    "```\n[g](h.md)\n```\n[r]: ref.md\n")
    assert relative_links(page.read_text()) == ["b.md#x", "#here", "ref.md"]


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(path):
    assert broken_links(path) == []
