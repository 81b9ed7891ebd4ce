"""The README is a front door and the docs hold together: every relative link of README.md
and docs/*.md reaches an existing file (and, with ``#anchor``, an existing heading of a
Markdown file, by GitHub's slug rule), the README stays short, and no README or docs page
(the decision log aside), option help or ``senseshield/defaults.py`` names an internal issue
number: they say what is, not what changed it."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
# a decision log may say which issue decided what
CLI_FILES = [*sorted((ROOT / "senseshield" / "cli").glob("*.py")),
             ROOT / "coordinator" / "cli.py", ROOT / "edge_agent" / "cli.py", ROOT / "keyserver" / "cli.py"]
DEFAULTS = ROOT / "senseshield" / "defaults.py"
README_MAX_LINES = 250

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"\[([^\]]*)\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto:, ...
ISSUE = re.compile(r"\bissue[ -]?#?\d+|\(issue\b|(?<![\w/&#`])#\d+\b", re.I)


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(number, line) of every line outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lowercase, every character but letters,
    digits, `_`, `-` and spaces removed, spaces to `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, a repeated heading numbered as GitHub does."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(path):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every relative link of a Markdown file (code spans and blocks aside)."""
    found = []
    for number, line in prose_lines(path):
        # a code span inside a link's text stays text; elsewhere it is code, not a link
        line = INLINE_CODE.sub(lambda m: "code" if "](" not in m.group(2) else "", line)
        for match in LINK.finditer(line):
            target = match.group(2)
            if not EXTERNAL.match(target):
                found.append((number, target))
    return found


LINKS = [(page, number, target) for page in PAGES for number, target in links(page)]


def test_the_pages_have_links_to_check() -> None:
    assert len(LINKS) > 100
    assert any(page == README and target.startswith("docs/limits.md#") for page, _, target in LINKS)


@pytest.mark.parametrize("page, number, target", LINKS,
                         ids=[f"{p.relative_to(ROOT)}:{n}:{t}" for p, n, t in LINKS])
def test_a_relative_link_reaches_its_file_and_heading(page: Path, number: int, target: str) -> None:
    where = f"{page.relative_to(ROOT)}:{number}"
    file_part, _, anchor = target.partition("#")
    dest = (page.parent / unquote(file_part)).resolve() if file_part else page
    assert dest.exists(), f"{where} links to {target}, and {file_part} does not exist"
    if anchor and dest.suffix == ".md":
        assert unquote(anchor) in anchors(dest), (
            f"{where} links to {target}, and {dest.relative_to(ROOT)} has no heading with that anchor")


def test_the_slug_rule_is_githubs() -> None:
    assert slug("Start and stop: measured") == "start-and-stop-measured"
    assert slug("`masked-dp`'s guarantee rests on the key server") == "masked-dps-guarantee-rests-on-the-key-server"
    assert slug("A cluster's round aggregates at most 65,536 samples") == "a-clusters-round-aggregates-at-most-65536-samples"
    assert slug("Not every release is in ε") == "not-every-release-is-in-ε"
    assert slug("Distributed DP on masked sums (`masked-dp`)") == "distributed-dp-on-masked-sums-masked-dp"


def test_the_readme_is_a_front_door() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; at most {README_MAX_LINES}"
    text = "\n".join(lines)
    assert "make test" in text and "make demo" in text  # CI calls make test; the README says so


def test_no_issue_numbers_in_the_readme_or_the_docs() -> None:
    found = [f"{page.relative_to(ROOT)}:{number}: {line.strip()}"
             for page in PAGES
             for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
             if ISSUE.search(line)]
    assert found == []


def help_texts(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every `help=` string and every docstring (a command's help) of a file;
    the constant parts of f-strings and concatenations."""

    def text(node: ast.AST) -> str:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.JoinedStr):
            return "".join(text(v) for v in node.values)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return text(node.left) + text(node.right)
        return ""

    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = [(node.value.lineno, text(node.value)) for node in ast.walk(tree)
             if isinstance(node, ast.keyword) and node.arg == "help"]
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                found.append((getattr(node, "lineno", 1), doc))
    return found


def test_the_help_texts_are_found() -> None:
    texts = [t for path in CLI_FILES for _, t in help_texts(path)]
    assert len(texts) > 200 and any("--password-file" in t or "MQTT password" in t for t in texts)


def test_no_issue_numbers_in_option_help_or_the_defaults() -> None:
    found = [f"{path.relative_to(ROOT)}:{number}: {text!r}"
             for path in CLI_FILES for number, text in help_texts(path) if ISSUE.search(text)]
    found += [f"{DEFAULTS.relative_to(ROOT)}:{number}: {line.strip()}"
              for number, line in enumerate(DEFAULTS.read_text(encoding="utf-8").splitlines(), 1)
              if ISSUE.search(line)]
    assert found == []
