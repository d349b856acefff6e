"""Disk size of the Python packages each image installs (docs/operations.md, Containers), measured from an
environment that has them all installed (`make install`'s .venv).

No Docker engine runs on the development machines, so this sums the installed files of each
target's requirement closure (requirements.py's lists, followed through their own dependencies);
the image adds the python:3.11-slim base under it. torch counts as the CPU wheel that .venv holds.
usage: .venv/bin/python platform/image_sizes.py
"""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from requirements import requirements  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# Image target -> the extras it installs (platform/Dockerfile).
TARGETS = {"web, worker, beat, gateway": [], "replica": ["engine"]}


def name_of(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def closure(names: list[str]) -> set[str]:
    """Every distribution the names need, following their requirements (extras left out, markers
    for this interpreter only)."""
    seen: set[str] = set()
    todo = [name_of(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        seen.add(name)
        for requirement in dist.requires or []:
            marker = requirement.partition(";")[2]
            if "extra ==" in marker:
                continue
            if marker and not _marker_holds(marker):
                continue
            todo.append(name_of(requirement))
    return seen


def _marker_holds(marker: str) -> bool:
    from packaging.markers import Marker

    return Marker(marker).evaluate()


def installed_bytes(name: str) -> int:
    dist = metadata.distribution(name)
    return sum(path.stat().st_size for file in dist.files or []
               if (path := Path(dist.locate_file(file))).is_file())


def main() -> None:
    for target, extras in TARGETS.items():
        names = closure([*requirements(ROOT / "pyproject.toml", extras), "inferops"])
        sizes = sorted(((installed_bytes(n), n) for n in names), reverse=True)
        total = sum(size for size, _ in sizes)
        largest = ", ".join(f"{n} {size / 2**20:.0f}" for size, n in sizes[:4])
        print(f"{target}: {total / 2**20:.0f} MiB in {len(names)} distributions (largest, MiB: {largest})")


if __name__ == "__main__":
    main()
