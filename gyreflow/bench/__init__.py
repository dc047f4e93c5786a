"""Emulated compute for the placement benchmark.

The placement benchmark runs the real cluster, plugin, router, migration and pipeline code; only
the compute inside engines and trainers is replaced by the explicit cost model of a
:class:`~gyreflow.bench.workload.Workload` (it waits the modelled time and moves the modelled
bytes). Everything measured with it is labelled *emulated*.
"""

from gyreflow.bench.workload import (
    Cost,
    Distribution,
    ExecutionSpec,
    Workload,
    WorkloadError,
    available_workloads,
    emulated_tokens_bytes,
    load_workload,
    lower_bound,
)
from gyreflow.bench.emulated_engine import EmulatedEngine, emulated_engine_factory

__all__ = [
    "Cost",
    "Distribution",
    "EmulatedEngine",
    "ExecutionSpec",
    "Workload",
    "WorkloadError",
    "available_workloads",
    "emulated_engine_factory",
    "emulated_tokens_bytes",
    "load_workload",
    "lower_bound",
]
