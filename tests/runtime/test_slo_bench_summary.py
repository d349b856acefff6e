"""bench/engine/slo_bench.py's arithmetic on made-up runs: medians over seeds, ratios, and the issue's
goals judged met or not (the bench itself needs a quiet machine and vLLM; these need neither)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "engine"))
import slo_bench  # noqa: E402


def run(goodput: float, served_good_share: float = 1.0, rejected: int = 0, throughput: float = 1.0) -> dict:
    return {"request_goodput": goodput, "request_throughput": throughput, "median_ttft_ms": 100.0,
            "p99_ttft_ms": 900.0, "median_tpot_ms": 50.0, "p99_tpot_ms": 90.0, "rejected": rejected,
            "served_good_share": served_good_share}


def test_medians_ratios_and_goals():
    saturation = 1.0
    results = {
        "vllm": {"0": {"2.0": run(0.10), "burst": run(0.0)}, "1": {"2.0": run(0.30)}, "2": {"2.0": run(0.20)}},
        "slo": {"0": {"2.0": run(0.9, 0.85, 9), "burst": run(0.3)}, "1": {"2.0": run(0.5, 0.95)},
                "2": {"2.0": run(0.6, 0.70)}},
    }
    summary = slo_bench.summarise(results, saturation, ["2.0", "burst"])
    row = summary["2.0"]
    assert row["vllm"]["request_goodput"] == 0.2 and row["slo"]["request_goodput"] == 0.6
    assert row["slo"]["served_good_share"] == 0.85 and row["slo"]["seeds"] == 3
    assert row["slo_over_vllm_goodput"] == 3.0
    assert row["goals"] == {"goodput >= 1.5x vLLM's": True, "goodput >= 0.5x vLLM's saturation rate": True,
                            ">= 80% of served meet both": True}
    assert summary["burst"]["goals"] == {"goodput >= 0.25x vLLM's saturation rate": True}
    assert slo_bench.summarise(results, 2.0, ["burst"])["burst"]["goals"] == {
        "goodput >= 0.25x vLLM's saturation rate": False}


@pytest.mark.parametrize("only, expected", [
    ("", [(0, "vllm", ["1.0", "burst"]), (0, "slo", ["1.0", "burst"]), (1, "vllm", ["1.0", "burst"]),
          (1, "slo", ["1.0", "burst"])]),
    ("slo,burst", [(0, "vllm", ["1.0", "burst"]), (0, "slo", ["1.0", "burst"]), (1, "vllm", ["1.0"])]),
])
def test_the_plan_runs_first_seed_only_servers_and_multiples_once(only, expected):
    args = slo_bench.parse_args(["--servers", "vllm,slo", "--seeds", "0,1", "--multiples", "1.0,burst",
                                 "--only-first-seed", only])
    assert slo_bench.plan(args) == expected
