"""Waiting in tests: poll for the condition with a deadline, never a fixed sleep before an assert.

Django-free, so the gateway and engine suites (no database) use it too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], what: str | Callable[[], str], timeout: float = 10.0,
               interval: float = 0.05, *, ignore: tuple[type[BaseException], ...] = ()) -> T:
    """Call `condition` until it returns something truthy and return that.

    After `timeout` seconds raise AssertionError naming `what` (a callable is called then, for a
    log tail) and the last value. An exception of a type in `ignore` counts as "not yet" (a server
    still starting refuses connections); the last one is named in the failure.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = condition()
            error = None
        except ignore as exc:
            value, error = None, exc
        if value:
            return value
        if time.monotonic() >= deadline:
            described = what() if callable(what) else what
            last = f"last value {value!r}" + (f", last error {error!r}" if error is not None else "")
            raise AssertionError(f"timed out after {timeout} s waiting for {described} ({last})")
        time.sleep(interval)
