"""The project's Markdown stays true to the repository: README.md is a newcomer's page (short, with the
test command), every link stays inside the repository and lands on a file (and a heading) that
exists, docs/settings.md names every worker and daemon setting the code has, and every dated
measurement page says its machine and its command."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import msgspec
import pytest

from ember.daemon.settings import Settings
from ember.worker.config import WorkerConfig

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SETTINGS = ROOT / "docs" / "settings.md"
MAX_README_LINES = 250


def _pages() -> list[Path]:
    """The Markdown a user reads: README.md, docs/ and kernels/ (tests/ and build trees are not docs)."""
    pages = [README, *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "kernels").rglob("*.md"))]
    return [p for p in pages if p.is_file()]


_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_LINK = re.compile(r"^[ \t]{0,3}\[[^\]]+\]:[ \t]*<?(\S+?)>?(?:[ \t]+.*)?$", re.MULTILINE)
_AUTOLINK = re.compile(r"<((?:[a-z][a-z0-9+.-]*):[^>\s]+)>", re.IGNORECASE)
_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)


def _prose(text: str) -> str:
    """The text without fenced code blocks and code spans (a link written in code is not a link)."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def links(text: str) -> list[str]:
    prose = _prose(text)
    return [*_INLINE_LINK.findall(prose), *_REF_LINK.findall(prose), *_AUTOLINK.findall(prose)]


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub writes it: markup and punctuation dropped, lower case, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"[`*_]", "", text.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    found: set[str] = set()
    counts: dict[str, int] = {}
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", _FENCE.sub("", text), re.MULTILINE):
        base = _slug(m.group(1))
        n = counts.get(base, 0)
        counts[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def test_the_pages_exist():
    for page in ("README.md", "docs/architecture.md", "docs/models.md", "docs/settings.md", "docs/operations.md",
                 "docs/benchmarks/README.md", "kernels/README.md", "kernels/docs/README.md"):
        assert (ROOT / page).is_file(), f"{page} is missing"


def test_readme_is_a_short_page():
    n = len(README.read_text().splitlines())
    assert n < MAX_README_LINES, f"README.md has {n} lines; a newcomer's page stays under {MAX_README_LINES}"


def test_readme_names_the_test_commands():
    text = README.read_text()
    assert "bash .ci/run" in text and "python -m pytest" in text


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_links_stay_inside_the_repository_and_resolve(page):
    text = page.read_text()
    assert "../shared" not in text, f"{page.name} mentions ../shared, which a clone of ember does not have"
    for target in links(text):
        assert not _SCHEME.match(target), f"{page.relative_to(ROOT)}: {target} points outside the repository"
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest == ROOT or ROOT in dest.parents, f"{page.relative_to(ROOT)}: {target} leaves the repository"
        assert dest.exists(), f"{page.relative_to(ROOT)}: {target} does not exist"
        if anchor and dest.suffix == ".md":
            assert anchor in anchors(dest.read_text()), f"{page.relative_to(ROOT)}: {target}: no such heading"


def _named(text: str) -> set[str]:
    return set(re.findall(r"`([a-z_][a-z0-9_]*)`", text))


def test_every_worker_setting_is_documented():
    names = [f.name for f in msgspec.structs.fields(WorkerConfig)]
    assert len(names) > 30  # the struct was read, not an empty stand-in
    missing = [n for n in names if n not in _named(SETTINGS.read_text())]
    assert not missing, f"docs/settings.md does not document the worker settings {missing}"


def test_every_daemon_setting_is_documented():
    names = [f.name for f in dataclasses.fields(Settings)]
    assert len(names) > 30
    missing = [n for n in names if n not in _named(SETTINGS.read_text())]
    assert not missing, f"docs/settings.md does not document the daemon settings {missing}"


def _dated_pages() -> list[Path]:
    pages = [*(ROOT / "docs" / "benchmarks").glob("*.md"), *(ROOT / "kernels" / "docs").glob("*.md")]
    return sorted(p for p in pages if re.match(r"\d{4}-\d{2}-\d{2}-", p.name))


def test_there_are_dated_measurement_pages():
    assert len(_dated_pages()) >= 5


@pytest.mark.parametrize("page", _dated_pages(), ids=lambda p: p.name)
def test_a_measurement_page_says_its_machine_and_command(page):
    text = page.read_text()
    assert re.search(r"^\*\*Machine[^*]*\*\*", text, re.MULTILINE), f"{page.name} does not name its machine"
    assert re.search(r"^\*\*Commands?[^*]*\*\*", text, re.MULTILINE), f"{page.name} does not name its command"


def test_the_link_reader_finds_what_it_should():
    text = ("[a](docs/x.md) ![b](img.png#f)\n[c]: ../out.md\n[d]: https://example.com\n<https://e.org>\n"
            "`[not](a-link)`\n```\n[nor](this)\n```\n[e [nested]](y.md#part \"title\")")
    assert links(text) == ["docs/x.md", "img.png#f", "y.md#part", "../out.md", "https://example.com",
                           "https://e.org"]
    assert anchors("# The `ember` CLI: start & stop\n## KV (on disk)\n## KV (on disk)") == {
        "the-ember-cli-start--stop", "kv-on-disk", "kv-on-disk-1"}
