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


def test_goals_not_met_fcfs_at_0_7_and_a_multiple_written_either_way():
    results = {
        "vllm": {"0": {"2": run(0.4), "0.7": run(0.5)}},
        "fcfs": {"0": {"2": run(0.1), "0.7": run(0.5)}},
        "slo": {"0": {"2": run(0.5, 0.79, 20), "0.7": run(0.45)}},
    }
    summary = slo_bench.summarise(results, 1.2, ["2", "0.7"])
    assert summary["2"]["slo_over_vllm_goodput"] == 1.25 and summary["2"]["slo_over_fcfs_goodput"] == 5.0
    # 0.5 < 1.5 x 0.4, 0.5 < 0.5 x 1.2 and 79 % < 80 %: "2" is judged as 2.0 and nothing is met.
    assert summary["2"]["goals"] == {"goodput >= 1.5x vLLM's": False,
                                     "goodput >= 0.5x vLLM's saturation rate": False,
                                     ">= 80% of served meet both": False}
    assert summary["0.7"]["goals"] == {"goodput no worse than fcfs": False}
    assert summary["2"]["slo"]["rejected"] == 20
    # Without vLLM's own runs the vLLM ratio and goal are left out, not judged.
    assert "goodput >= 1.5x vLLM's" not in slo_bench.summarise({"slo": results["slo"]}, 1.2, ["2"])["2"]["goals"]


EXPOSITION = """# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="tiny"} 3.0
inferops:slo_requests_judged_total{engine="0",model_name="tiny"} 40.0
inferops:slo_deadline_misses_total{engine="0",model_name="tiny",phase="ttft"} 7.0
inferops:slo_deadline_misses_total{engine="0",model_name="tiny",phase="tpot"} 2.0
inferops:slo_rejected_late_total{engine="0",model_name="tiny"} 5.0
inferops:slo_admission_slack_seconds_bucket{engine="0",le="-1",model_name="tiny"} 4.0
inferops:slo_admission_slack_seconds_bucket{engine="0",le="0",model_name="tiny"} 6.0
inferops:slo_admission_slack_seconds_bucket{engine="0",le="1",model_name="tiny"} 30.0
inferops:slo_admission_slack_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 45.0
inferops:scheduling_policy_info{engine="0",model_name="tiny",policy="slo"} 1.0
inferops:slo_target_ttft_seconds{engine="0",model_name="tiny"} 2.0
inferops:slo_target_tpot_seconds{engine="0",model_name="tiny"} 0.2
"""


def test_replica_counters_read_by_label_and_absent_series_left_out():
    assert slo_bench.counters(EXPOSITION) == {
        "preemptions": 3.0, "slo_judged": 40.0, "slo_ttft_misses": 7.0, "slo_tpot_misses": 2.0,
        "slo_rejected_late": 5.0, "slo_admitted": 45.0, "slo_admitted_late": 6.0}
    assert slo_bench.replica_settings(EXPOSITION) == {
        "policy": "slo", "slo_target_ttft_seconds": 2.0, "slo_target_tpot_seconds": 0.2}
    # vLLM exports none of the inferops:* series.
    assert slo_bench.counters('vllm:num_preemptions_total{engine="0",model_name="tiny"} 1.0\n') == {"preemptions": 1.0}


def test_a_run_record_counts_rejections_and_good_from_loadgen_and_replica_deltas():
    metrics = {key: 0.0 for key in slo_bench.shared.REPORTED} | {
        "completed": 8, "failed": 1, "rejected": 3, "good_requests": 6, "errors": {"http_500": 1}}
    before = {"preemptions": 3.0, "slo_rejected_late": 5.0, "slo_admitted": 45.0}
    after = {"preemptions": 4.0, "slo_rejected_late": 8.0, "slo_admitted": 57.0, "slo_judged": 8.0}
    record = slo_bench.run_record(metrics, float("inf"), before, after)
    assert (record["rate"], record["completed"], record["failed"], record["rejected"]) == ("inf", 8, 1, 3)
    assert record["good"] == 6 and record["served_good_share"] == 0.75
    # A series that appeared during the run has no before: no delta rather than a made-up one.
    assert record["replica_counters"] == {"preemptions": 1.0, "slo_rejected_late": 3.0, "slo_admitted": 12.0}
    nothing_served = slo_bench.run_record(metrics | {"completed": 0, "good_requests": 0}, 2.0, {}, {})
    assert nothing_served["served_good_share"] is None and nothing_served["rate"] == 2.0


def test_dry_run_prints_rates_from_a_given_saturation_and_the_commands():
    args = slo_bench.parse_args(["--dry-run", "--saturation-rate", "0.8", "--servers", "fcfs,slo", "--seeds", "3",
                                 "--multiples", "0.7,2,burst", "--burst-prompts", "40"])
    text = slo_bench.dry_run_plan(args, slo_bench.server_specs(Path("m"), args))
    lines = text.splitlines()
    assert lines[0] == "saturation: 0.8 req/s, given" and len(lines) == 3
    assert lines[1].startswith("seed 3: fcfs, 100 requests at 0.7x (0.560 req/s), 2x (1.600 req/s), "
                               "burst (40 at once): ")
    assert "--scheduling-policy fcfs" in lines[1] and "--slo-reject-late" not in lines[1]
    assert lines[2].endswith("--slo-ttft-ms 2000 --slo-tpot-ms 200 --scheduling-policy slo --slo-reject-late")
