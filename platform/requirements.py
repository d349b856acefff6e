"""Print the pinned requirements of pyproject.toml for the given extras, one a line.

The Dockerfile installs dependencies from this before copying the source, so a code change does
not reinstall them; tests and the size table of docs/operations.md read the same lists.
usage: python requirements.py pyproject.toml [extra ...]
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path


def requirements(pyproject: Path, extras: list[str]) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [extra for extra in extras if extra not in optional]
    if unknown:
        raise SystemExit(f"unknown extras: {', '.join(unknown)} (have: {', '.join(sorted(optional))})")
    return [*project["dependencies"], *(req for extra in extras for req in optional[extra])]


if __name__ == "__main__":
    print("\n".join(requirements(Path(sys.argv[1]), sys.argv[2:])))
