"""Call records, trajectory trees, partial scoring and bounded path sampling."""

from gyreflow.trajectory.records import CallRecord, ExecutionResult

__all__ = ["CallRecord", "ExecutionResult"]
