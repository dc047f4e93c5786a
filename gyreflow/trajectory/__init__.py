"""Call records, trajectory trees, partial scoring and bounded path sampling."""

from gyreflow.trajectory.records import CallRecord, ExecutionResult
from gyreflow.trajectory.tree import TrajectoryTree, TreePath, build_tree

__all__ = ["CallRecord", "ExecutionResult", "TrajectoryTree", "TreePath", "build_tree"]
