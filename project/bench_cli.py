"""`inferops bench`: the load generator (runtime/loadgen.py), and with `--save-curve DEPLOYMENT` the
goodput curve it measured (`--rates`) stored in the control plane for the capacity planner:

    INFEROPS_URL=https://inferops.example INFEROPS_TOKEN=... inferops bench \\
        --base-url http://replica:8001 --model chat --rates 1,2,4,8 --step-seconds 20 \\
        --goodput ttft:500 tpot:50 --save-curve chat

The curve is stored against the deployment's version, hardware and engine arguments (the server
reads them from the deployment), so measure one replica of that deployment. Only httpx
(project.cli_client): no Django, so it runs from any machine with the package installed.
"""

from __future__ import annotations

import argparse
import sys

import httpx

from project.cli_client import api_client, base_url, say, say_refused, say_unreachable
from runtime import loadgen

CURVES_PATH = "/api/v1/capacity/curves/"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    loadgen.add_arguments(parser)
    parser.add_argument(
        "--save-curve", metavar="DEPLOYMENT", default=None,
        help="with --rates: store the curve in inferops (INFEROPS_URL, INFEROPS_TOKEN) for this deployment's "
             "version, hardware and engine arguments, for the capacity planner")


def curve_body(deployment: str, config: loadgen.BenchConfig, points: list[dict]) -> dict:
    """POST /api/v1/capacity/curves/'s body: a length range is stored as its mean."""
    return {"deployment": deployment, "points": points, "slo_ms": dict(config.goodput_slos_ms),
            "input_len": round((config.input_len.low + config.input_len.high) / 2),
            "output_len": round((config.output_len.low + config.output_len.high) / 2)}


def save_curve(deployment: str, config: loadgen.BenchConfig, points: list[dict]) -> int:
    base = base_url()
    try:
        with api_client() as client:
            response = client.post(base + CURVES_PATH, json=curve_body(deployment, config, points))
    except httpx.HTTPError as exc:
        say_unreachable(base, exc)
        return 2
    if response.status_code != 201:
        say_refused(response, base, not_found=f"Check that deployment {deployment!r} exists.")
        return 2
    curve = response.json()
    say(f"curve {curve['id']} saved: {curve['model']} v{curve['version']} on {curve['hardware']} "
        f"({len(curve['points'])} steps); plan with GET {base}/api/v1/capacity/plan/?deployment={deployment}&rps=N")
    return 0


def main(args: argparse.Namespace) -> int:
    if args.save_curve is not None and args.rates is None:
        raise SystemExit("inferops bench: --save-curve stores a curve: give --rates too (e.g. --rates 1,2,4,8)")
    code, config, result = loadgen.execute(args)
    if args.save_curve is None:
        return code
    if code:
        say("error: no request completed in any step; the curve is not saved", sys.stderr)
        return code
    if not config.goodput_slos_ms:
        say("note: no --goodput given, so the curve has no goodput; the planner judges its p95s alone")
    return save_curve(args.save_curve, config, result)
