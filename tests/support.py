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


def wait_for_steps(proc, report, steps: int, timeout: float = 240.0, every: float = 0.2) -> None:
    """Wait until the run ``proc`` has written ``steps`` steps into ``report`` (report.json); fail
    with its output if it ends first."""
    import json

    def written() -> bool:
        assert proc.poll() is None, proc.stdout.read()
        return report.is_file() and len(json.loads(report.read_text())["steps"]) >= steps

    wait_for(written, timeout=timeout, what=f"{steps} committed step(s) in {report}", every=every)
