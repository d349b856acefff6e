"""`inferops rollout`: start a progressive rollout from CI through the REST API, and wait for it.

    INFEROPS_URL=https://inferops.example INFEROPS_TOKEN=... \\
        inferops rollout --deployment chat --version 7 --engine-arg max_num_seqs=64 --wait

With --wait it follows the rollout to its end and then through its watch after success (default
10 minutes, `--watch`), during which the platform rolls it back by itself if the new version burns
an SLO the previous one did not; `--no-wait-watch` returns at success instead.

Exit codes: 0 succeeded (and passed its watch, when waited through; or created, without --wait);
1 aborted, or rolled back by the platform during its watch; 2 refused by the API (bad request,
unknown deployment, no permission, another rollout active, error budget exhausted, rollouts frozen
by a degradation level); 3 timed out or the server could not be reached.

Only httpx (project.cli_client): no Django, so it runs from any CI image with the package installed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import UTC, datetime

import httpx

from project.cli_client import Poller, api_client, base_url, say, say_refused, say_unreachable

EXIT_SUCCEEDED, EXIT_ABORTED, EXIT_REFUSED, EXIT_UNREACHABLE = 0, 1, 2, 3
FINAL = ("succeeded", "aborted", "rolled_back")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--deployment", required=True, help="deployment (route) name")
    candidate = parser.add_mutually_exclusive_group()
    candidate.add_argument("--version", type=int, help="candidate model version number")
    candidate.add_argument("--alias", help="candidate version by alias (e.g. champion)")
    parser.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="candidate engine argument (repeatable), set over the deployment's current "
                             "engine args; values parse as JSON when they can (64 -> int, true -> bool), "
                             "else as text")
    parser.add_argument("--strategy", choices=["canary", "blue-green"], default="canary")
    parser.add_argument("--steps", metavar="JSON",
                        help='canary steps, e.g. \'[{"set_weight": 20}, {"analysis": "2m"}]\'')
    parser.add_argument("--scale-down-delay", metavar="DURATION", help="blue-green: keep the old set warm (10m)")
    parser.add_argument("--preview", metavar="DURATION",
                        help="blue-green: time on the preview route first ('{}' = until promoted)")
    parser.add_argument("--analysis", metavar="DURATION|JSON", help="blue-green: analysis after the switch (1m)")
    parser.add_argument("--quality", metavar="JSON",
                        help='blue-green: score the candidate on an eval set before the switch, e.g. '
                             '\'{"eval_set": "tiny-facts", "max_drop": 0.05, "min_score": 0.8}\' (a canary lists '
                             'it as a step: {"quality": {...}})')
    parser.add_argument("--promote-alias", help="alias moved to the candidate on success (default champion; '' none)")
    parser.add_argument("--rollback", action="store_true", help="this is a rollback (allowed with no error budget)")
    parser.add_argument("--override-reason", metavar="TEXT",
                        help="go ahead although an error budget is exhausted (audited)")
    parser.add_argument("--watch", metavar="DURATION",
                        help="after success, how long the platform watches the new version and rolls it back by "
                             "itself if it burns an SLO the previous version did not (default 10m; 0 = no watch)")
    parser.add_argument("--holdback", type=int, metavar="PERCENT",
                        help="during the watch, percent of traffic kept on the previous version to compare the new "
                             "one with at the same time (default: the server's, 5; 0 = none)")
    parser.add_argument("--no-auto-rollback", action="store_true",
                        help="watch without rolling back by itself (the watch's looks are still recorded)")
    parser.add_argument("--wait", action="store_true",
                        help="follow the rollout until it succeeds and passes its watch, aborts or is rolled back")
    parser.add_argument("--no-wait-watch", action="store_true",
                        help="with --wait, return as soon as the rollout succeeds instead of waiting through its watch")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds to wait with --wait (default 3600)")
    parser.add_argument("--poll-interval", type=float, default=2, help="seconds between polls (default 2)")


def parse_value(text: str):
    """JSON when it parses (64, 0.9, true, {"a": 1}), else the text itself ("10m", "fp8")."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def build_body(args, current_engine_args: dict | None = None) -> dict:
    """The POST body; ValueError with a message for a malformed option.

    `--engine-arg`s are set over the deployment's current engine args: changing one option keeps
    the others (the API itself takes the candidate's complete engine args).
    """
    body: dict = {"strategy": args.strategy}
    if args.version is not None:
        body["version"] = args.version
    if args.alias:
        body["alias"] = args.alias
    if args.engine_arg:
        engine_args = dict(current_engine_args or {})
        for item in args.engine_arg:
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise ValueError(f"--engine-arg {item!r}: expected KEY=VALUE, e.g. max_num_seqs=64")
            engine_args[key.strip()] = parse_value(value)
        body["engine_args"] = engine_args
    if args.steps is not None:
        try:
            body["steps"] = json.loads(args.steps)
        except ValueError as exc:
            raise ValueError(f"--steps is not valid JSON ({exc}); e.g. '[{{\"set_weight\": 20}}]'") from None
    for field in ("scale_down_delay", "preview", "analysis"):
        if (value := getattr(args, field)) is not None:
            body[field] = parse_value(value)
    if args.quality is not None:
        try:
            body["quality"] = json.loads(args.quality)
        except ValueError as exc:
            raise ValueError(f"--quality is not valid JSON ({exc}); e.g. '{{\"eval_set\": \"tiny-facts\", "
                             "\"max_drop\": 0.05}'") from None
    if args.promote_alias is not None:
        body["promote_alias"] = args.promote_alias
    if args.rollback:
        body["rollback"] = True
    if args.override_reason:
        body["override_reason"] = args.override_reason
    if args.watch is not None:
        body["watch"] = parse_value(args.watch)
    if args.holdback is not None:
        body["holdback"] = args.holdback
    if args.no_auto_rollback:
        body["auto_rollback"] = False
    return body


def _steps(count: int) -> str:
    return f"{count} step" if count == 1 else f"{count} steps"


def _describe_step(step) -> str:
    if not step:
        return "all steps done"
    (kind, value), = step.items()
    if kind == "set_weight":
        return f"set_weight {value}%"
    if kind == "pause":
        return "pause until promoted" if value is None else f"pause {value:g}s"
    if kind == "quality":
        return quality_text(value)
    return f"analysis {value['duration']:g}s" if isinstance(value, dict) else f"analysis {value}"


def quality_text(config: dict) -> str:
    """"quality tiny-facts: max drop 0.05, min 0.80"."""
    limits = []
    if config.get("max_drop") is not None:
        limits.append(f"max drop {config['max_drop']:.2f}")
    if config.get("min_score") is not None:
        limits.append(f"min {config['min_score']:.2f}")
    return f"quality {config['eval_set']}: {', '.join(limits)}"


def failing_cases(rollout: dict) -> list[str]:
    """Links to the failing cases of the quality steps that failed in the rollout's latest attempt."""
    looks = rollout.get("quality") or []
    latest = max((look["attempt"] for look in looks), default=None)
    return [look["link"] for look in looks
            if look["attempt"] == latest and look.get("verdict") == "fail" and look.get("link")]


def describe(rollout: dict) -> str:
    if rollout.get("watching"):
        return (f"rollout {rollout['id']}: succeeded, watching v{rollout['candidate']['version']} until "
                f"{_clock(rollout['watch_until'])} UTC for an automatic rollback")
    current = rollout.get("current_step") or {}
    index, total = current.get("index", 0), len(rollout.get("steps") or [])
    line = (f"rollout {rollout['id']}: {rollout['status']}, step {min(index + 1, total)}/{total} "
            f"({_describe_step(current.get('step'))}), weight {rollout['weight']}%")
    return f"{line}: {rollout['message']}" if rollout.get("message") else line


def _clock(iso: str) -> str:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).astimezone(UTC).strftime("%H:%M:%S")


def _state(rollout: dict) -> tuple:
    return (rollout["status"], (rollout.get("current_step") or {}).get("index"), rollout["weight"],
            rollout.get("message"), rollout.get("watching"))


def _done(rollout: dict, *, through_watch: bool) -> bool:
    return rollout["status"] in FINAL and not (through_watch and rollout.get("watching"))


def _unreachable(base: str, exc: Exception) -> int:
    say_unreachable(base, exc)
    return EXIT_UNREACHABLE


def _refused(response: httpx.Response, base: str) -> int:
    server_failed = say_refused(response, base, not_found="Check --deployment and INFEROPS_URL.")
    return EXIT_UNREACHABLE if server_failed else EXIT_REFUSED


def wait(client: httpx.Client, url: str, rollout: dict, *, timeout: float, poll_interval: float, base: str,
         through_watch: bool = True) -> int:
    deadline = time.monotonic() + timeout
    last = _state(rollout)
    poller = Poller(client, url)
    watched = False
    while not _done(rollout, through_watch=through_watch):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            if rollout.get("watching"):
                say(f"timed out after {timeout:g}s: rollout {rollout['id']} succeeded and is still watched until "
                    f"{_clock(rollout['watch_until'])} UTC; wait longer with --timeout, or use --no-wait-watch.",
                    sys.stderr)
            else:
                say(f"timed out after {timeout:g}s waiting for rollout {rollout['id']}, which is still "
                    f"{rollout['status']} at {rollout['weight']}% and keeps going on the server: promote or abort "
                    f"it ({url}promote/ or abort/), or wait longer with --timeout.", sys.stderr)
            return EXIT_UNREACHABLE
        time.sleep(min(poll_interval, remaining))
        if (response := poller.get()) is None:
            continue
        if response.status_code != 200:
            return _refused(response, base)
        rollout = response.json()
        watched = watched or bool(rollout.get("watching"))
        if _state(rollout) != last:
            last = _state(rollout)
            say(describe(rollout))
    if rollout["status"] == "succeeded":
        version, deployment = rollout["candidate"]["version"], rollout["deployment"]
        line = f"rollout {rollout['id']} succeeded: v{version} serves all traffic on {deployment}"
        if rollout.get("watching"):  # --no-wait-watch
            line += f"; the platform watches it until {_clock(rollout['watch_until'])} UTC and may still roll it back"
        elif watched:
            line += " and passed its watch"
        say(line + ".")
        return EXIT_SUCCEEDED
    if rollout["status"] == "rolled_back":
        say(f"rollout {rollout['id']}: {rollout.get('message') or 'rolled back by the platform'}. Rollout "
            f"{rollout.get('rolled_back_by')} puts v{rollout['stable']['version']} back on {rollout['deployment']}.",
            sys.stderr)
        return EXIT_ABORTED
    say(f"rollout {rollout['id']} aborted, traffic back on v{rollout['stable']['version']}: "
        f"{rollout.get('message') or 'no reason given'}", sys.stderr)
    for link in failing_cases(rollout):
        say(f"failing cases: {link}", sys.stderr)
    return EXIT_ABORTED


def main(args) -> int:
    base = base_url()
    try:
        build_body(args)  # a malformed option fails before any request
    except ValueError as exc:
        say(f"error: {exc}", sys.stderr)
        return EXIT_REFUSED
    deployment_url = f"{base}/api/v1/deployments/{args.deployment}/"
    collection = f"{deployment_url}rollouts/"
    with api_client() as client:
        try:
            current = None
            if args.engine_arg:
                response = client.get(deployment_url)
                if response.status_code != 200:
                    return _refused(response, base)
                current = response.json().get("engine_args") or {}
            response = client.post(collection, json=build_body(args, current))
        except httpx.HTTPError as exc:
            return _unreachable(base, exc)
        if response.status_code != 201:
            return _refused(response, base)
        rollout = response.json()
        stable, candidate = rollout["stable"], rollout["candidate"]
        say(f"rollout {rollout['id']} of {rollout['deployment']} created: v{stable['version']} → "
            f"v{candidate['version']} ({rollout['strategy']}, {_steps(len(rollout['steps']))})")
        if rollout["steps"]:
            say("steps: " + "; ".join(_describe_step(step) for step in rollout["steps"]))
        say(describe(rollout))
        if not args.wait:
            return EXIT_SUCCEEDED
        return wait(client, f"{collection}{rollout['id']}/", rollout, timeout=args.timeout,
                    poll_interval=args.poll_interval, base=base, through_watch=not args.no_wait_watch)
