"""Emulated compute for the placement benchmark.

The placement benchmark runs the real cluster, plugin, router, migration and pipeline code; only
the compute inside engines and trainers is replaced by the explicit cost model of a
:class:`~gyreflow.bench.workload.Workload` (it waits the modelled time and moves the modelled
bytes). Everything measured with it is labelled *emulated*.
"""

from gyreflow.bench.bounds import batched_bound, lower_bound
from gyreflow.bench.emulated_engine import EmulatedEngine, emulated_engine_factory
from gyreflow.bench.workload import (
    CellEvent,
    Cost,
    Distribution,
    ExecutionSpec,
    StepChange,
    Workload,
    WorkloadError,
    emulated_tokens_bytes,
)
from gyreflow.bench.workload_file import available_workloads, load_workload

__all__ = [
    "CellEvent",
    "Cost",
    "Distribution",
    "EmulatedEngine",
    "ExecutionSpec",
    "StepChange",
    "Workload",
    "WorkloadError",
    "available_workloads",
    "batched_bound",
    "emulated_engine_factory",
    "emulated_tokens_bytes",
    "load_workload",
    "lower_bound",
]
