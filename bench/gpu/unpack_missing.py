"""Unpack each wheel of WHEELS whose top-level package this Python cannot import into SITE (put
on PYTHONPATH by gpu-check.sh): a machine without network or pip gets only what it lacks, and
keeps its own builds of everything else. Wheels are zip files laid out as site-packages is.

    python bench/gpu/unpack_missing.py WHEELS SITE
"""

from __future__ import annotations

import importlib.util
import sys
import zipfile
from pathlib import Path


def top_level_names(wheel: zipfile.ZipFile) -> set[str]:
    names = set()
    for member in wheel.namelist():
        first = member.split("/", 1)[0]
        if first.endswith((".dist-info", ".data")):
            continue
        names.add(first.removesuffix(".py").split(".", 1)[0])
    return names


def main(wheels: Path, site: Path) -> int:
    site.mkdir(parents=True, exist_ok=True)
    if not wheels.is_dir():
        print(f"no bundle at {wheels}: run `bench/gpu/gpu-check.sh bundle` where a package index is reachable")
        return 1
    for path in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(path) as wheel:
            names = sorted(name for name in top_level_names(wheel) if not name.startswith("_") or name == "_pytest")
            missing = [name for name in names if importlib.util.find_spec(name) is None]
            if missing:
                wheel.extractall(site)
                print(f"unpacked {path.name} ({', '.join(missing)} missing)")
            else:
                print(f"kept this machine's {', '.join(names)} ({path.name} not needed)")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
