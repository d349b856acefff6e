"""Every relative link of the README and of docs/*.md resolves (issue 37).

A link is `[text](target)` outside fenced code blocks and code spans. A target with a scheme
(`https:`, `mailto:`) is left alone; any other names a file or folder of the repository, relative
to the page, which must exist and stay inside the checkout. A `#anchor`, alone or after a
Markdown file, must name a heading of that page, slugged as GitHub slugs headings (lower case,
punctuation dropped, spaces to hyphens, `-1`, `-2` after repeats).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^ {0,3}(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) or [text](target "title"); the text may hold one level of brackets (a badge, a code span).
LINK = re.compile(r"\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line with its code spans blanked) for every line outside fenced code blocks."""
    lines, fenced = [], None
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if match:
            fenced = None if fenced == match.group(1) else fenced or match.group(1)
            continue
        if fenced is None:
            lines.append((number, CODE_SPAN.sub(lambda m: " " * len(m.group()), line)))
    return lines


def links(text: str) -> list[tuple[int, str]]:
    return [(number, match.group(1)) for number, line in prose_lines(text) for match in LINK.finditer(line)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.replace("`", "").replace("*", "").lower().strip()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    original = text.splitlines()
    for number, line in prose_lines(text):
        if not HEADING.match(line):
            continue
        # prose_lines blanked the heading's code spans, which GitHub keeps as text: slug the original.
        base = slug(HEADING.match(original[number - 1]).group(2))
        count = seen.get(base, 0)
        found.add(base if count == 0 else f"{base}-{count}")
        seen[base] = count + 1
    return found


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """'page:line: target (why)' for every relative link of the page that does not resolve."""
    text = page.read_text(encoding="utf-8")
    label = page.relative_to(root)
    problems = []
    for number, target in links(text):
        if SCHEME.match(target):
            continue
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        if root.resolve() not in resolved.parents and resolved != root.resolve():
            problems.append(f"{label}:{number}: {target} (outside the repository)")
        elif not resolved.exists():
            problems.append(f"{label}:{number}: {target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text(encoding="utf-8")):
            problems.append(f"{label}:{number}: {target} (no heading #{anchor} in {resolved.relative_to(root)})")
    return problems


def test_the_readme_and_every_docs_page_link_to_what_exists():
    assert (ROOT / "docs" / "README.md").exists()
    problems = [problem for page in pages() for problem in broken_links(page)]
    assert not problems, "broken relative links:\n" + "\n".join(problems)


def test_every_docs_page_is_in_the_index():
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    linked = {target.partition("#")[0] for _, target in links(index)}
    missing = [page.name for page in pages()[1:] if page.name != "README.md" and page.name not in linked]
    assert not missing, f"docs pages the index (docs/README.md) does not link: {missing}"


@pytest.mark.parametrize("heading, expected", [
    ("Users, roles and API tokens", "users-roles-and-api-tokens"),
    ("`inferops rollout` in a CI job", "inferops-rollout-in-a-ci-job"),
    ("Processes, health and logs", "processes-health-and-logs"),
    ("LD_PRELOAD for vLLM's CPU build", "ld_preload-for-vllms-cpu-build"),
    ("Costs (`costing/`)", "costs-costing"),
])
def test_headings_slug_as_on_github(heading, expected):
    assert slug(heading) == expected


def test_a_broken_link_or_anchor_is_found_and_code_is_not_read(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## Some part\n\n## Some part\n", encoding="utf-8")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "# Page\n\n"
        "[fine](other.md) [fine too](other.md#some-part) [repeat](other.md#some-part-1) [here](#page)\n"
        "[gone](missing.md) [no anchor](other.md#nowhere) [up and out](../../x.md) [web](https://example.com/x)\n"
        "`[in code](nothing.md)`\n\n```\n[in a block](nothing.md)\n```\n",
        encoding="utf-8")
    problems = broken_links(page, tmp_path)
    assert [problem.split(": ", 1)[1] for problem in problems] == [
        "missing.md (no such file)", "other.md#nowhere (no heading #nowhere in docs/other.md)",
        "../../x.md (outside the repository)"]
