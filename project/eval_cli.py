"""`inferops eval`: score a deployment, a model version or a rollout's candidate on an eval set from
CI through the REST API, and fail the job when the score misses a floor.

    INFEROPS_URL=https://inferops.example INFEROPS_TOKEN=... \\
        inferops eval run --set qa --model tiny --version 7 --min-score 0.9 --wait

`eval run` starts a run; with --wait it shows a progress bar (plain lines when stderr is not a
terminal), then the scores per scorer and the failing cases (the first 10, then a link to the
rest). `eval sets` lists the eval sets; `eval upload --set NAME FILE` adds a version from a JSONL
file and names every bad line when the server refuses it.

Exit codes: 0 passed (or started, without --wait; listed; uploaded); 1 the score is under
--min-score, or the run failed, was cancelled or did not finish within --timeout; 2 a usage
error, refused by the API, or the server could not be reached or failed.

Only httpx (project.cli_client): no Django, so it runs from any CI image with the package installed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx
from tqdm import tqdm

from inferops.timeparse import parse_duration
from project.cli_client import Poller, api_client, base_url, say, say_refused, say_unreachable

EXIT_PASSED, EXIT_FAILED, EXIT_ERROR = 0, 1, 2
FINISHED = ("succeeded", "failed", "cancelled")
FAILING_SHOWN = 10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")

    run = actions.add_parser("run", help="score a target on an eval set", description="score a target on an eval set")
    run.add_argument("--set", required=True, dest="eval_set", metavar="NAME", help="eval set name")
    target = run.add_mutually_exclusive_group(required=True)
    target.add_argument("--deployment", metavar="D", help="score the deployment's replicas (its current version)")
    target.add_argument("--model", metavar="M", help="score version --version of this model on a temporary replica")
    target.add_argument("--rollout", type=int, metavar="ID", help="score a rollout's canary through its preview route")
    run.add_argument("--version", type=int, metavar="V", help="with --model: the version number")
    run.add_argument("--set-version", type=int, metavar="N", help="the eval set's version (default: its latest)")
    run.add_argument("--reference-model", metavar="M", help="parity cases compare with this model's version ...")
    run.add_argument("--reference-version", type=int, metavar="V", help="... this version (both or neither)")
    run.add_argument("--min-score", type=float, metavar="X",
                     help="with --wait: exit 1 when the overall score (fraction of cases passed, 0..1) is under X")
    run.add_argument("--wait", action="store_true", help="follow the run to its end and report its scores")
    run.add_argument("--timeout", default="30m", metavar="DURATION",
                     help="how long --wait waits, e.g. 90s, 30m, 1h (default 30m)")
    run.add_argument("--priority", type=int, metavar="N", help="engine priority of its requests (default: the lowest)")
    run.add_argument("--concurrency", type=int, metavar="N", help="cases scored at once (default: the server's, 4)")
    run.add_argument("--json", action="store_true", help="print the run as JSON on stdout instead of text")
    run.add_argument("--poll-interval", type=float, default=2, help="seconds between polls (default 2)")

    actions.add_parser("sets", help="list the eval sets", description="list the eval sets")

    upload = actions.add_parser("upload", help="upload a JSONL file as the set's next version",
                                description="upload a JSONL file as the set's next version")
    upload.add_argument("--set", required=True, dest="eval_set", metavar="NAME", help="eval set name")
    upload.add_argument("file", type=Path, metavar="FILE", help="JSONL: one case per line")


def build_body(args) -> dict:
    """The POST body of a run; ValueError with a message for options that do not go together."""
    if args.model is not None and args.version is None:
        raise ValueError("--model needs --version (the version number to score)")
    if args.version is not None and args.model is None:
        raise ValueError("--version goes with --model")
    if (args.reference_model is None) != (args.reference_version is None):
        raise ValueError("--reference-model and --reference-version go together")
    if args.min_score is not None and not args.wait:
        raise ValueError("--min-score is checked at the end of the run: add --wait")
    if args.min_score is not None and not 0 <= args.min_score <= 1:
        raise ValueError(f"--min-score {args.min_score:g}: expected a fraction of cases passed, from 0 to 1")
    if args.deployment is not None:
        target: dict = {"deployment": args.deployment}
    elif args.model is not None:
        target = {"model": args.model, "version": args.version}
    else:
        target = {"rollout": args.rollout, "track": "canary"}
    body: dict = {"eval_set": args.eval_set, "target": target}
    if args.set_version is not None:
        body["set_version"] = args.set_version
    if args.reference_model is not None:
        body["reference"] = {"model": args.reference_model, "version": args.reference_version}
    if args.priority is not None:
        body["priority"] = args.priority
    if args.concurrency is not None:
        body["concurrency"] = args.concurrency
    return body


def describe(run: dict) -> str:
    """`eval run 12 of qa v2 on deployment chat (tiny v3)`, `... on tiny v3`, `... on rollout 5 canary (tiny v3)`."""
    version = run.get("model_version") or {}
    scored = f"{version['model']} v{version['version']}" if version.get("model") else ""
    target = run.get("target") or {}
    if target.get("rollout"):
        named = f"rollout {target['rollout']} {target.get('track') or 'canary'}"
    elif target.get("deployment"):
        named = f"deployment {target['deployment']}"
    else:
        named = ""
    on = f"{named} ({scored})" if named and scored else named or scored or "its target"
    set_version = f" v{run['set_version']}" if run.get("set_version") else ""
    return f"eval run {run['id']} of {run.get('eval_set')}{set_version} on {on}"


def percent(score: float) -> str:
    return f"{100 * score:.1f} %"


def score_lines(run: dict) -> list[str]:
    """One line per scorer (cases passed, then the scorer's own figures) and the overall score."""
    lines = []
    for scorer, figures in sorted((run.get("scores") or {}).items()):
        line = f"  {scorer}: {figures.get('passed', 0)}/{figures.get('cases', 0)} passed"
        extra = [f"{name} {value:.4g}" for name, value in figures.items()
                 if name not in ("cases", "passed", "score") and isinstance(value, int | float)]
        lines.append(line + (f" ({', '.join(extra)})" if extra else ""))
    if run.get("score") is not None:
        lines.append(f"  overall: {run['score']:.4f} ({percent(run['score'])} of cases passed)")
    return lines


def failing_lines(failing: dict, run_page: str) -> list[str]:
    """The failing cases as `id: reason`, the first FAILING_SHOWN, then how many more and where."""
    cases, count = failing.get("results") or [], failing.get("count", 0)
    lines = [f"  {case['id']}: {case.get('reason') or 'failed'}" for case in cases[:FAILING_SHOWN]]
    if count > len(lines):
        lines.append(f"  and {count - len(lines)} more: {run_page}")
    return lines


class Progress:
    """Cases done so far: a tqdm bar on a terminal, else a stamped line whenever the count or the
    status moves (CI logs keep every line a bar would redraw)."""

    def __init__(self, run: dict) -> None:
        self.bar = None
        self.last: tuple | None = None
        if sys.stderr.isatty():
            self.bar = tqdm(total=self._total(run), unit="case", desc=f"eval run {run['id']}", file=sys.stderr,
                            dynamic_ncols=True)
        self.update(run)

    @staticmethod
    def _total(run: dict) -> int:
        return (run.get("progress") or {}).get("total") or 0

    def update(self, run: dict) -> None:
        done = (run.get("progress") or {}).get("done") or 0
        if self.bar is not None:
            self.bar.total = self._total(run) or self.bar.total
            self.bar.n = done
            self.bar.set_postfix_str(run["status"], refresh=False)
            self.bar.refresh()
            return
        state = (run["status"], done)
        if state != self.last:
            self.last = state
            say(f"eval run {run['id']}: {run['status']}, {done}/{self._total(run)} cases", sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Api:
    """The few calls `inferops eval` makes; each answers the response or an exit code, said in words."""

    def __init__(self, client: httpx.Client, base: str) -> None:
        self.client, self.base = client, base

    def runs_url(self, run_id: int | None = None) -> str:
        return f"{self.base}/api/v1/evals/runs/" + (f"{run_id}/" if run_id is not None else "")

    def run_page(self, run_id: int) -> str:
        return f"{self.base}/evals/runs/{run_id}/"

    def refused(self, response: httpx.Response, not_found: str) -> int:
        say_refused(response, self.base, not_found=not_found)
        return EXIT_ERROR

    def request(self, method: str, url: str, **kwargs) -> httpx.Response | int:
        try:
            return self.client.request(method, url, **kwargs)
        except httpx.HTTPError as exc:
            say_unreachable(self.base, exc)
            return EXIT_ERROR


def wait(api: Api, run: dict, *, timeout: float, poll_interval: float) -> dict | int:
    """Polls the run until it finishes; the last document, or an exit code."""
    deadline = time.monotonic() + timeout
    poller = Poller(api.client, api.runs_url(run["id"]))
    progress = Progress(run)
    try:
        while run["status"] not in FINISHED:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                progress.close()
                say(f"timed out after {timeout:g}s waiting for eval run {run['id']}, which is still {run['status']} "
                    "and keeps going on the server: follow it at " + api.run_page(run["id"]) + ", cancel it with "
                    f"POST {api.runs_url(run['id'])}cancel/, or wait longer with --timeout.", sys.stderr)
                return EXIT_FAILED
            time.sleep(min(poll_interval, remaining))
            if (response := poller.get()) is None:
                continue
            if response.status_code != 200:
                progress.close()
                return api.refused(response, "The run is gone; check INFEROPS_URL.")
            run = response.json()
            progress.update(run)
    finally:
        progress.close()
    return run


def failing_cases(api: Api, run: dict) -> dict | int:
    """The first failing cases and their count (the API's page: {count, results})."""
    response = api.request("GET", f"{api.runs_url(run['id'])}cases/", params={"passed": "false",
                                                                               "limit": FAILING_SHOWN})
    if isinstance(response, int):
        return response
    if response.status_code != 200:
        return api.refused(response, "Check INFEROPS_URL.")
    return response.json()


def verdict(run: dict, min_score: float | None) -> tuple[int, str]:
    """The exit code and the line that explains it."""
    name = f"eval run {run['id']}"
    if run["status"] == "failed":
        return EXIT_FAILED, f"{name} failed: {run.get('error') or 'no reason given'}"
    if run["status"] == "cancelled":
        return EXIT_FAILED, f"{name} was cancelled before it finished"
    score = run.get("score")
    if min_score is not None and (score is None or score < min_score):
        shown = "no score" if score is None else f"score {score:.4f}"
        return EXIT_FAILED, f"{name}: {shown} is under the floor {min_score:g}"
    floor = f", at or above the floor {min_score:g}" if min_score is not None else ""
    return EXIT_PASSED, f"{name} passed: score {score:.4f}{floor}" if score is not None else f"{name} succeeded"


def report(api: Api, run: dict, args) -> int:
    failing = {"count": 0, "results": []}
    if run["status"] in ("succeeded", "cancelled"):  # a cancelled run keeps the cases it scored
        failing = failing_cases(api, run)
        if isinstance(failing, int):
            return failing
    code, line = verdict(run, args.min_score)
    if args.json:
        print(json.dumps({**run, "url": api.run_page(run["id"]), "failing_cases": failing.get("results", []),
                          "failing_count": failing.get("count", 0), "passed": code == EXIT_PASSED}, indent=2))
        return code
    say(f"{describe(run)}: {run['status']}")
    for text in score_lines(run):
        print(text)
    if failing.get("count"):
        print(f"  failing cases ({failing['count']}):")
        for text in failing_lines(failing, api.run_page(run["id"])):
            print("  " + text)
    say(line, sys.stdout if code == EXIT_PASSED else sys.stderr)
    return code


def run_eval(api: Api, args) -> int:
    try:
        body = build_body(args)
        timeout = parse_duration(args.timeout, "--timeout")
    except ValueError as exc:
        say(f"error: {exc}", sys.stderr)
        return EXIT_ERROR
    response = api.request("POST", api.runs_url(), json=body)
    if isinstance(response, int):
        return response
    if response.status_code not in (201, 202):
        return api.refused(response, "Check --set, the target and INFEROPS_URL.")
    run = response.json()
    if not args.wait:
        if args.json:
            print(json.dumps({**run, "url": api.run_page(run["id"])}, indent=2))
        else:
            say(f"{describe(run)} {run['status']}: {api.run_page(run['id'])}")
        return EXIT_PASSED
    if not args.json:
        say(f"{describe(run)} started: {api.run_page(run['id'])}")
    try:
        run = wait(api, run, timeout=timeout, poll_interval=args.poll_interval)
    except KeyboardInterrupt:
        say(f"interrupted: eval run {run['id']} keeps going on the server: {api.run_page(run['id'])}", sys.stderr)
        return EXIT_FAILED
    return run if isinstance(run, int) else report(api, run, args)


def list_sets(api: Api) -> int:
    response = api.request("GET", f"{api.base}/api/v1/evalsets/", params={"limit": 1000})
    if isinstance(response, int):
        return response
    if response.status_code != 200:
        return api.refused(response, "Check INFEROPS_URL.")
    body = response.json()
    sets = body.get("results", []) if isinstance(body, dict) else body
    if not sets:
        print("No eval sets. Create one with POST /api/v1/evalsets/ or on the console's Evals page.")
        return EXIT_PASSED
    rows = [("NAME", "SCORER", "LATEST", "DEFAULT FOR", "DESCRIPTION")]
    for item in sets:
        latest = item.get("latest_version")
        description = (item.get("description") or "").strip()
        rows.append((item["name"], item.get("scorer", ""), f"v{latest}" if latest else "—",
                     ", ".join(item.get("default_for") or []) or "—", description.splitlines()[0][:60] if description
                     else ""))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)) + "  " + row[-1])
    return EXIT_PASSED


def upload(api: Api, args) -> int:
    try:
        content = args.file.read_bytes()
    except OSError as exc:
        say(f"error: cannot read {args.file}: {exc.strerror or exc}", sys.stderr)
        return EXIT_ERROR
    response = api.request("POST", f"{api.base}/api/v1/evalsets/{args.eval_set}/versions/", content=content,
                           headers={"Content-Type": "application/x-ndjson"})
    if isinstance(response, int):
        return response
    if response.status_code != 201:
        errors = _line_errors(response)
        if not errors:
            return api.refused(response, "Check --set (create the set first) and INFEROPS_URL.")
        say(f"refused: {args.file} has {len(errors)} bad line{'s' if len(errors) != 1 else ''}; nothing was stored:",
            sys.stderr)
        for error in errors:
            print(f"  {args.file}:{error.get('line', '?')}: {error.get('error')}", file=sys.stderr)
        return EXIT_ERROR
    version = response.json()
    say(f"eval set {args.eval_set} v{version['version']}: {version['cases']} cases, sha256 {version['sha256']}")
    return EXIT_PASSED


def _line_errors(response: httpx.Response) -> list[dict]:
    """A refused file's `{"errors": [{line, error}]}`, or [] for any other refusal."""
    if response.status_code != 400:
        return []
    try:
        errors = response.json().get("errors")
    except (ValueError, AttributeError):
        return []
    return errors if isinstance(errors, list) and all(isinstance(e, dict) for e in errors) else []


def main(args) -> int:
    with api_client() as client:
        api = Api(client, base_url())
        if args.action == "sets":
            return list_sets(api)
        if args.action == "upload":
            return upload(api, args)
        return run_eval(api, args)
