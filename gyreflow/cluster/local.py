"""The embedded local cluster, and connecting to (and checking) any other Dask cluster."""

from __future__ import annotations

import asyncio
import signal
import threading
from dataclasses import dataclass

from distributed import Client, Nanny, Scheduler, SpecCluster

from gyreflow.cluster.plugin import PoolsPlugin
from gyreflow.cluster.pools import EXECUTION, ROLLOUT, TRAINER, workers_by_pool
from gyreflow.engine.service import EngineService
from gyreflow.train.service import TrainerService


class ClusterError(RuntimeError):
    """The cluster cannot run a gyreflow pipeline; the message says why."""


@dataclass(frozen=True)
class PoolSpec:
    """Cells of the embedded cluster."""

    rollout: int = 1
    trainer: int = 1
    execution_slots: int = 64
    dashboard_address: str = "127.0.0.1:0"


def local_cluster(spec: PoolSpec) -> SpecCluster:
    """A cluster of worker processes with per-worker resources: one per rollout and trainer cell,
    and one execution worker whose threads are the execution slots."""
    workers = {}
    for i in range(spec.rollout):
        workers[f"rollout-{i}"] = {"cls": Nanny, "options": {"nthreads": 2, "resources": {ROLLOUT: 1}, "name": f"rollout-{i}"}}
    for i in range(spec.trainer):
        workers[f"trainer-{i}"] = {"cls": Nanny, "options": {"nthreads": 1, "resources": {TRAINER: 1}, "name": f"trainer-{i}"}}
    workers["execution-0"] = {
        "cls": Nanny,
        "options": {"nthreads": spec.execution_slots, "resources": {EXECUTION: spec.execution_slots}, "name": "execution-0"},
    }
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": spec.dashboard_address, "host": "127.0.0.1"}}
    # Ctrl-C in a terminal reaches the whole process group; worker processes inherit an ignored
    # SIGINT so that only the driver handles it and shuts the cluster down in order.
    if threading.current_thread() is not threading.main_thread():
        return SpecCluster(workers=workers, scheduler=scheduler, name="gyreflow")
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return SpecCluster(workers=workers, scheduler=scheduler, name="gyreflow")
    finally:
        signal.signal(signal.SIGINT, previous)


def connect(address: str, timeout: float = 10.0) -> Client:
    """A client of the cluster at ``address``; a clear error if nothing answers there."""
    try:
        return Client(address, timeout=timeout)
    except (OSError, asyncio.TimeoutError, TimeoutError) as err:
        raise ClusterError(f"no Dask scheduler answered at {address} within {timeout:.0f}s ({type(err).__name__})") from None


def check_pools(client: Client) -> dict[str, list[str]]:
    """The workers of each pool; refuses a cluster that lacks a pool."""
    info = client.scheduler_info(n_workers=-1)
    resources = {addr: w.get("resources", {}) for addr, w in info["workers"].items()}
    pools = workers_by_pool(resources)
    missing = [p for p in (ROLLOUT, TRAINER, EXECUTION) if not pools[p]]
    if missing:
        raise ClusterError(
            f"the cluster has no worker with resource {', '.join(repr(m) for m in missing)}; gyreflow needs at least "
            f"one '{ROLLOUT}', one '{TRAINER}' and one '{EXECUTION}' worker (start workers with --resources)"
        )
    return pools


def _registered(dask_scheduler=None) -> list[str]:
    return [*dask_scheduler.plugins, *dask_scheduler.worker_plugins]


def install(client: Client, torch_threads: int | None, engine_options: dict) -> None:
    """Register gyreflow's scheduler and worker plugins, unless the cluster already has them (a
    second pipeline on the same cluster keeps the engines and trainer cells it finds)."""
    present = set(client.run_on_scheduler(_registered))
    for plugin in (PoolsPlugin(), EngineService(engine_options, torch_threads), TrainerService(torch_threads)):
        if plugin.name not in present:
            client.register_plugin(plugin)
