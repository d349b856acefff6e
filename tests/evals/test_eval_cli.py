"""`inferops eval` as CI runs it: over real HTTP against a live server, with a token from the env.

No worker and no replica here: the CLI starts a real run through the API, and a thread plays the
runner on the run's row (progress, case results, the outcome), as the rollout CLI's tests play the
operator. The runner itself is tested in tests/evals/test_runs_*.py.
"""

from __future__ import annotations

import json
import threading

import pytest
from django.contrib.auth.models import Group, User
from django.db import connection
from django.utils import timezone
from rest_framework.authtoken.models import Token

from evals.choices import RunStatus
from evals.models import EvalCaseResult, EvalRun, EvalSet
from project import cli, eval_cli
from registry.models import RegisteredModel
from tests.conftest import free_port
from tests.deployments.conftest import make_version
from tests.evals.runs_world import eval_set_with
from tests.waiting import wait_until

CASES = [{"id": f"case-{i:02d}", "prompt": f"{i}+1=", "expected": str(i + 1)} for i in range(14)]


@pytest.fixture
def ci(live_server, transactional_db, monkeypatch):
    """Model `tiny` v1 and v2, eval set `qa` (14 exact cases); an operator's token in INFEROPS_TOKEN."""
    user = User.objects.create_user("ci-bot")
    user.groups.add(Group.objects.get(name="operator"))
    model = RegisteredModel.objects.create(name="tiny", task="generate")
    make_version(model, 1), make_version(model, 2)
    eval_set_with(CASES, name="qa")
    monkeypatch.setenv("INFEROPS_URL", live_server.url)
    monkeypatch.setenv("INFEROPS_TOKEN", Token.objects.create(user=user).key)
    return live_server.url


def evaluate(*options: str) -> int:
    return cli.main(["eval", "run", "--set", "qa", *options])


@pytest.fixture
def seen(monkeypatch) -> list[tuple[str, int]]:
    """(status, done) of each run document the CLI has shown progress for, in order."""
    shown: list[tuple[str, int]] = []
    update = eval_cli.Progress.update

    def record(self, run):
        shown.append((run["status"], run["progress"]["done"]))
        update(self, run)

    monkeypatch.setattr(eval_cli.Progress, "update", record)
    return shown


def play_runner(seen: list, *, failing: int, status: str = RunStatus.SUCCEEDED, error: str = "") -> threading.Thread:
    """Once the CLI shows its queued run: running with half the cases done, then (once the CLI has
    shown that) every case scored, `failing` of them wrong, and the outcome, as the runner writes them."""

    def run():
        try:
            wait_until(lambda: ("queued", 0) in seen, "the CLI to start a run and show it", 30)
            queued = EvalRun.objects.get(status=RunStatus.QUEUED)
            EvalRun.objects.filter(pk=queued.pk).update(status=RunStatus.RUNNING, started_at=timezone.now(), done=7)
            wait_until(lambda: ("running", 7) in seen, "the CLI to show the progress", 30)
            finish(queued, failing=failing, status=status, error=error)
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def finish(run: EvalRun, *, failing: int, status: str, error: str) -> None:
    if status == RunStatus.FAILED:
        EvalRun.objects.filter(pk=run.pk).update(status=status, error=error, finished_at=timezone.now())
        return
    results = [EvalCaseResult(run=run, index=i, case_id=case["id"], scorer="exact", output="?" if i < failing else
                              case["expected"], score=0.0 if i < failing else 1.0, passed=i >= failing,
                              reason=f"expected {case['expected']!r}, got '?'" if i < failing else "")
               for i, case in enumerate(CASES)]
    EvalCaseResult.objects.bulk_create(results)
    passed = len(CASES) - failing
    EvalRun.objects.filter(pk=run.pk).update(
        status=status, done=len(CASES), finished_at=timezone.now(), score=passed / len(CASES),
        scores={"exact": {"cases": len(CASES), "passed": passed, "score": passed / len(CASES)}})


def test_waits_with_progress_then_reports_scores_and_the_failing_cases(ci, capsys, seen):
    runner = play_runner(seen, failing=12)
    code = evaluate("--model", "tiny", "--version", "2", "--wait", "--poll-interval", "0.1", "--min-score", "0.1")
    runner.join()
    out, err = capsys.readouterr()
    run = EvalRun.objects.get()
    assert code == 0, out + err
    assert (run.target_kind, run.model_version.number, run.created_by.username) == ("version", 2, "ci-bot")
    assert f"eval run {run.pk}: running, 7/14 cases" in err, out + err  # plain lines: stderr is no terminal
    assert "  exact: 2/14 passed" in out and "  overall: 0.1429 (14.3 % of cases passed)" in out
    assert "  failing cases (12):" in out
    assert "    case-00: expected '1', got '?'" in out and "    case-09: expected '10', got '?'" in out
    assert "case-10" not in out
    assert f"    and 2 more: {ci}/evals/runs/{run.pk}/" in out
    assert f"eval run {run.pk} passed: score 0.1429, at or above the floor 0.1" in out


def test_a_missed_floor_or_a_failed_run_exits_1(ci, capsys, seen):
    runner = play_runner(seen, failing=2)
    code = evaluate("--model", "tiny", "--version", "1", "--wait",
                    "--poll-interval", "0.1", "--min-score", "0.9")
    runner.join()
    out, err = capsys.readouterr()
    assert code == 1, out + err
    run = EvalRun.objects.get()
    assert f"eval run {run.pk}: score 0.8571 is under the floor 0.9" in err
    assert "    case-01: expected '2', got '?'" in out and "more:" not in out

    seen.clear()
    runner = play_runner(seen, failing=0, status=RunStatus.FAILED, error="No replica of tiny v1 became ready in 120 s.")
    code = evaluate("--model", "tiny", "--version", "1", "--wait", "--poll-interval", "0.1")
    runner.join()
    out, err = capsys.readouterr()
    assert code == 1, out + err
    assert "failed: No replica of tiny v1 became ready in 120 s." in err

    assert evaluate("--model", "tiny", "--version", "1", "--wait", "--poll-interval", "0.1", "--timeout", "0.3") == 1
    assert "timed out after 0.3s waiting for eval run" in capsys.readouterr().err


def test_without_wait_it_prints_the_run_and_its_url_and_json_on_request(ci, capsys, seen):
    assert evaluate("--model", "tiny", "--version", "2", "--priority", "-5", "--concurrency", "2") == 0
    run = EvalRun.objects.get()
    assert (run.priority, run.concurrency, run.status) == (-5, 2, RunStatus.QUEUED)
    assert f"eval run {run.pk} of qa v1 on tiny v2 queued: {ci}/evals/runs/{run.pk}/" in capsys.readouterr().out

    EvalRun.objects.update(status=RunStatus.CANCELLED)
    runner = play_runner(seen, failing=1)
    code = evaluate("--model", "tiny", "--version", "2", "--wait", "--poll-interval", "0.1", "--json")
    runner.join()
    out, _ = capsys.readouterr()
    assert code == 0
    document = json.loads(out)
    assert document["status"] == "succeeded" and document["passed"] is True
    assert document["failing_count"] == 1 and document["failing_cases"][0]["id"] == "case-00"
    assert document["url"].endswith(f"/evals/runs/{document['id']}/")


def test_usage_and_api_errors_exit_2_in_words(ci, capsys, monkeypatch):
    assert evaluate("--model", "tiny") == 2
    assert "--model needs --version" in capsys.readouterr().err
    assert evaluate("--model", "tiny", "--version", "2", "--min-score", "0.5") == 2
    assert "--min-score is checked at the end of the run: add --wait" in capsys.readouterr().err
    assert evaluate("--model", "tiny", "--version", "2", "--wait", "--min-score", "90") == 2
    assert "expected a fraction of cases passed, from 0 to 1" in capsys.readouterr().err
    assert evaluate("--model", "tiny", "--version", "2", "--wait", "--timeout", "soon") == 2
    assert "--timeout: expected a duration" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:  # argparse: no target
        evaluate()
    assert usage.value.code == 2

    assert evaluate("--model", "tiny", "--version", "7") == 2
    assert "refused (HTTP 400): target: Model 'tiny' has no version 7." in capsys.readouterr().err
    assert cli.main(["eval", "run", "--set", "nope", "--model", "tiny", "--version", "1"]) == 2
    assert "nope" in capsys.readouterr().err
    assert not EvalRun.objects.exists()

    monkeypatch.setenv("INFEROPS_TOKEN", "not-a-token")
    assert evaluate("--model", "tiny", "--version", "2") == 2
    assert "HTTP 401" in (err := capsys.readouterr().err) and "Check INFEROPS_TOKEN" in err
    monkeypatch.setenv("INFEROPS_URL", f"http://127.0.0.1:{free_port()}")
    assert evaluate("--model", "tiny", "--version", "2") == 2
    assert "cannot reach inferops" in capsys.readouterr().err


def test_sets_lists_and_upload_names_every_bad_line(ci, capsys, tmp_path):
    EvalSet.objects.create(name="empty", scorer="choice", description="multiple choice\nsecond line")
    EvalSet.objects.get(name="qa").default_for.add(RegisteredModel.objects.get(name="tiny"))
    assert cli.main(["eval", "sets"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["NAME", "SCORER", "LATEST", "DEFAULT", "FOR", "DESCRIPTION"]
    assert [line.split() for line in out.splitlines()[1:]] == [["empty", "choice", "—", "—", "multiple", "choice"],
                                                               ["qa", "exact", "v1", "tiny"]]

    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps(case) + "\n" for case in CASES[:3]))
    assert cli.main(["eval", "upload", "--set", "qa", str(good)]) == 0
    assert "eval set qa v2: 3 cases, sha256 " in capsys.readouterr().out

    bad = tmp_path / "bad.jsonl"
    line = '{"id": "a", "prompt": "x", "expected": "y"}\n'
    bad.write_text(line + "{not json\n" + line)  # line 3 repeats line 1's id
    assert cli.main(["eval", "upload", "--set", "qa", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "has 2 bad lines; nothing was stored" in err
    assert f"  {bad}:2: " in err and f"  {bad}:3: " in err
    assert cli.main(["eval", "upload", "--set", "qa", str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert EvalSet.objects.get(name="qa").versions.count() == 2


def test_failing_cases_past_the_first_ten_are_counted_and_linked():
    cases = [{"id": f"c{i}", "reason": f"reason {i}"} for i in range(10)]
    lines = eval_cli.failing_lines({"count": 25, "results": cases}, "http://x/evals/runs/3/")
    assert lines[0] == "  c0: reason 0" and len(lines) == 11
    assert lines[-1] == "  and 15 more: http://x/evals/runs/3/"
    assert eval_cli.failing_lines({"count": 2, "results": cases[:2]}, "u") == ["  c0: reason 0", "  c1: reason 1"]


def test_progress_is_a_bar_on_a_terminal(capsys, monkeypatch):
    monkeypatch.setattr(eval_cli.sys.stderr, "isatty", lambda: True)
    progress = eval_cli.Progress({"id": 4, "status": "queued", "progress": {"done": 0, "total": 14}})
    progress.update({"id": 4, "status": "running", "progress": {"done": 7, "total": 14}})
    progress.close()
    err = capsys.readouterr().err
    assert "eval run 4:  50%" in err and "7/14" in err and "running" in err
    assert "running, 7/14 cases" not in err  # no plain lines beside the bar
