"""Django's {# #} comment ends at the line's end: one spread over lines prints as page text."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UNCLOSED = re.compile(r"\{#(?!.*#\}).*$", re.MULTILINE)


def test_no_template_comment_spans_lines():
    templates = [p for p in ROOT.glob("**/templates/**/*.html") if ".venv" not in p.parts]
    assert templates
    offenders = [f"{path.relative_to(ROOT)}:{text[:match.start()].count(chr(10)) + 1}"
                 for path in templates for text in [path.read_text()] for match in UNCLOSED.finditer(text)]
    assert not offenders, f"multi-line {{# #}} comments (use {{% comment %}}): {offenders}"
