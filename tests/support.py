"""Helpers shared by the test modules."""

import time


def wait_for(predicate, timeout: float = 30.0, what: str = "condition", every: float = 0.05):
    """Poll ``predicate`` until it returns something truthy (returned) or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(every)
