"""What the reliability suites share: how long a pass is and where its figures go.

Every suite runs a short pass in `make test`; `make fuzz` and `make chaos` set
INFEROPS_RELIABILITY_LONG=1 for the long one and INFEROPS_RELIABILITY_RESULTS to the folder
that keeps its figures (bench/reliability/results/).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path
from typing import Any

LONG = os.environ.get("INFEROPS_RELIABILITY_LONG") == "1"


def scaled(short: int | float, long: int | float) -> int | float:
    """`long` in a long pass, else `short`."""
    return long if LONG else short


def record(name: str, figures: dict[str, Any]) -> None:
    """Write `figures` to <results>/<name>.json when a long pass asks for results, with when and where."""
    folder = os.environ.get("INFEROPS_RELIABILITY_RESULTS")
    if not folder:
        return
    path = Path(folder) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {"suite": name, "long": LONG,
                "finished_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                            "load_avg": os.getloadavg()},
                "figures": figures}
    path.write_text(json.dumps(document, indent=2, default=str) + "\n")
