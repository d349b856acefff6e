"""The suite's one way to wait: wait_until returns the first truthy value or fails saying what and
what it last saw."""

from __future__ import annotations

import pytest

from tests.waiting import wait_until


def test_returns_the_first_truthy_value():
    answers = iter([None, 0, [], ["ready"]])
    assert wait_until(lambda: next(answers), "an answer", timeout=5, interval=0) == ["ready"]


def test_a_timeout_names_what_was_awaited_and_the_last_value():
    finished: list[str] = []
    with pytest.raises(AssertionError, match=r"timed out after 0\.2 s waiting for a finished job \(last value \[\]\)"):
        wait_until(lambda: finished, "a finished job", timeout=0.2, interval=0.01)


def test_a_description_given_as_a_callable_is_read_only_on_failure():
    reads = []

    def what() -> str:
        reads.append(1)
        return "the log tail"

    assert wait_until(lambda: True, what, timeout=1) is True
    assert reads == []
    with pytest.raises(AssertionError, match="waiting for the log tail"):
        wait_until(lambda: False, what, timeout=0.05, interval=0.01)
    assert reads == [1]


def test_listed_errors_count_as_not_yet_and_others_fail_at_once():
    attempts = iter([ConnectionError("refused"), ConnectionError("refused"), "up"])

    def probe():
        result = next(attempts)
        if isinstance(result, Exception):
            raise result
        return result

    assert wait_until(probe, "the server", timeout=5, interval=0, ignore=(ConnectionError,)) == "up"
    with pytest.raises(AssertionError, match=r"last error ConnectionError\('refused'\)"):
        wait_until(lambda: (_ for _ in ()).throw(ConnectionError("refused")), "the server", timeout=0.05,
                   interval=0.01, ignore=(ConnectionError,))
    with pytest.raises(KeyError):
        wait_until(lambda: {}["missing"], "a key", timeout=5, ignore=(ConnectionError,))
