"""Print the chaos table of bench/reliability/README.md from results/chaos.json (`make chaos` writes it).

    python bench/reliability/table.py [results/chaos.json]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

COLUMNS = ("scenario", "fault injected", "held", "load", "requests sent / served", "failed before first byte",
           "failed after first byte", "events lost / doubled", "recovery (s)", "restarted by the supervisor")


def rows(document: dict) -> list[list[str]]:
    table = []
    for name, row in document["figures"]["scenarios"].items():
        soak = name == "soak"
        held = f"{row['duration_s'] / 60:.0f} min" if soak else f"{row['fault_held_s']} s"
        restarts = ", ".join(f"{process} {n}" for process, n in row.get("restarted_by_supervisor", {}).items())
        table.append([name, "none (memory sampled every 30 s)" if soak else row["fault"], held, row["load"],
                      f"{row['sent']:,} / {row['served']:,}", str(row["failed_before_first_byte"]),
                      str(row["failed_after_first_byte"]), f"{row['events_lost']} / {row['events_doubled']}",
                      "-" if soak else str(row["recovery_s"]), restarts or "none"])
    return table


def main() -> None:
    path = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "results" / "chaos.json")
    document = json.loads(path.read_text())
    print(f"| {' | '.join(COLUMNS)} |")
    print(f"|{'---|' * len(COLUMNS)}")
    for row in rows(document):
        print(f"| {' | '.join(row)} |")
    machine = document["machine"]
    print(f"\n{document['finished_utc']}, {machine['cores']} cores, load average {machine['load_avg'][0]:.1f}, "
          f"faults held {document['figures']['fault_s']} s.")


if __name__ == "__main__":
    main()
