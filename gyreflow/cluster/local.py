"""The embedded local cluster, and connecting to (and checking) any other Dask cluster."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import signal
import threading
from dataclasses import dataclass

import dask

from distributed import Client, Nanny, Scheduler, SpecCluster

from gyreflow.cluster.cell import CellService
from gyreflow.cluster.clock import WALL, Clock
from gyreflow.cluster.control import Timing
from gyreflow.cluster.modes import mode as placement_mode
from gyreflow.cluster.moves import Deadlines
from gyreflow.cluster.plugin import PoolsPlugin
from gyreflow.cluster.routing import RoutingOptions
from gyreflow.cluster.pools import EXECUTION, ROLLOUT, TRAINER, is_cell, workers_by_pool
from gyreflow.engine.service import PLUGIN_NAME as ENGINE_PLUGIN
from gyreflow.engine.service import EngineService
from gyreflow.train.service import TrainerService


class ClusterError(RuntimeError):
    """The cluster cannot run a gyreflow pipeline; the message says why."""


@dataclass(frozen=True)
class PoolSpec:
    """Cells of the embedded cluster: ``rollout`` start in the rollout pool, ``trainer`` in the
    trainer pool; every cell can take either role later."""

    rollout: int = 1
    trainer: int = 1
    execution_slots: int = 64
    """Executions at once, over all execution workers."""
    execution_workers: int = 1
    """Worker processes for the executions (each an event loop of its own; the slots are shared
    out evenly)."""
    dashboard_address: str = "127.0.0.1:0"
    cell_threads: int = 2
    """Task threads per cell: one for a trainer task, one for weight publication and the like."""
    held: int = 0
    """Cells started outside both pools, to join them later (``gyreflow_join``)."""
    profile: bool = False
    """Dask's statistical profiler in the workers (the dashboard's profile pages). It samples every
    thread of every worker each 10 ms: on a 2-core machine an idle cluster of 10 workers spent a
    quarter of the CPU on it."""


def worker_config(spec: PoolSpec) -> dict:
    """Dask settings of the embedded cluster's workers: light monitoring, so that the cells and
    executions get the cores (an idle cluster of 10 workers: 0.56 cores with Dask's defaults,
    0.11 with these)."""
    return {
        "distributed.worker.profile.enabled": spec.profile,
        "distributed.admin.system-monitor.interval": "2s",
        "distributed.worker.memory.monitor-interval": "1s",
        "distributed.admin.tick.interval": "200ms",
    }


def local_cluster(spec: PoolSpec) -> SpecCluster:
    """A cluster of worker processes with per-worker resources: one per rollout, trainer and held
    cell (``cell-0``, ``cell-1``, ... in that order), and execution workers whose threads are the
    execution slots."""
    workers = {}
    config = worker_config(spec)
    for i in range(spec.rollout + spec.trainer + spec.held):
        role = ROLLOUT if i < spec.rollout else TRAINER if i < spec.rollout + spec.trainer else None
        # Both keys on every cell: a role change sets one to 1 and the other to 0.
        res = {ROLLOUT: float(role == ROLLOUT), TRAINER: float(role == TRAINER)}
        workers[f"cell-{i}"] = {"cls": Nanny, "options": {"nthreads": spec.cell_threads, "resources": res, "name": f"cell-{i}",
                                                           "config": config}}
    for k in range(spec.execution_workers):
        slots = spec.execution_slots // spec.execution_workers + (k < spec.execution_slots % spec.execution_workers)
        workers[f"execution-{k}"] = {"cls": Nanny, "options": {"nthreads": slots, "resources": {EXECUTION: slots},
                                                              "name": f"execution-{k}", "config": config}}
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": spec.dashboard_address, "host": "127.0.0.1"}}
    # Ctrl-C in a terminal reaches the whole process group; worker processes inherit an ignored
    # SIGINT so that only the driver handles it and shuts the cluster down in order.
    # The nannies and the scheduler run in this process: they read the same settings as they start.
    with dask.config.set(config):
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
        raise ClusterError(f"no Dask scheduler answered at {address} within {timeout:g}s ({type(err).__name__})") from None


def workers_info(client: Client) -> dict[str, dict]:
    """Address -> the scheduler's record of every worker, asked for now.

    (Not ``Client.scheduler_info``: the client's periodic refresh may replace the answer, between
    the fetch and the return, with a cached identity that lists no worker.)
    """
    return client.sync(client.scheduler.identity, n_workers=-1)["workers"]


def cells_of(client: Client) -> dict[str, list[str]]:
    """The workers of each pool (``rollout``, ``trainer``, ``execution``)."""
    return workers_by_pool({addr: w.get("resources", {}) for addr, w in workers_info(client).items()})


def check_pools(client: Client, rollout: int = 1, trainer: int = 1, mode: str = "async",
                options: dict | None = None) -> dict[str, list[str]]:
    """The workers of each pool; refuses a cluster that cannot run ``mode`` (with its ``options``)
    with at least ``rollout`` + ``trainer`` cells."""
    pools = cells_of(client)
    if not pools[EXECUTION]:
        raise ClusterError(f"the cluster has no worker with resource '{EXECUTION}'; start one with --resources {EXECUTION}=N")
    have = len(pools[ROLLOUT]) + len(pools[TRAINER])
    if have < rollout + trainer:
        raise ClusterError(
            f"the configuration asks for {rollout + trainer} cells ({rollout} rollout + {trainer} trainer) but the cluster "
            f"has {have} worker(s) with a '{ROLLOUT}' or '{TRAINER}' resource"
        )
    if not pools[ROLLOUT]:
        raise ClusterError(f"the cluster has no worker with resource '{ROLLOUT}': executions would have no engine")
    chosen = placement_mode(mode)
    if len(pools[TRAINER]) < chosen.min_trainer_cells:
        raise ClusterError(f"the cluster has no worker with resource '{TRAINER}', which placement {mode!r} needs")
    why = chosen.check(len(pools[ROLLOUT]), len(pools[TRAINER]), **(options or {}))
    if why:
        raise ClusterError(f"this cluster has {len(pools[ROLLOUT])} rollout and {len(pools[TRAINER])} trainer cells: {why}")
    return pools


def _registered(dask_scheduler=None) -> list[str]:
    return [*dask_scheduler.plugins, *dask_scheduler.worker_plugins]


def _check_engine_context(client: Client, engine_options: dict) -> None:
    """Engines stay as the first pipeline on a cluster configured them: refuse a run whose prompts
    they could not hold, rather than let its calls fail one by one."""
    want = engine_options.get("max_seq_len")
    if want is None:
        return

    def held(dask_worker) -> int | None:
        plugin = dask_worker.plugins.get(ENGINE_PLUGIN)
        return None if plugin is None else plugin.engine_options.get("max_seq_len")

    have = {addr: n for addr, n in client.run(held).items() if n is not None}
    short = {addr: n for addr, n in have.items() if n < want}
    if short:
        raise ClusterError(f"the engines on this cluster hold {min(short.values())} tokens of context, this run needs "
                           f"{want}: run it on a fresh cluster")


def install(client: Client, torch_threads: int | None, engine_options: dict, mode: str = "async",
            placement_options: dict | None = None, engine_factory=None, clock: Clock = WALL,
            timing: Timing | None = None, routing: RoutingOptions | None = None,
            deadlines: Deadlines | None = None) -> None:
    """Register gyreflow's scheduler and worker plugins, unless the cluster already has them (a
    second pipeline on the same cluster keeps the engines and trainer replicas it finds), and
    set the placement mode. ``clock`` applies to a scheduler plugin installed now; ``timing``,
    ``routing`` and ``deadlines`` to the one found too."""
    present = set(client.run_on_scheduler(_registered))
    engine = EngineService(engine_options, torch_threads) if engine_factory is None else \
        EngineService(engine_options, torch_threads, factory=engine_factory)
    from gyreflow.proxy.plugin import ProxyPlugin

    if engine.name in present:
        _check_engine_context(client, engine_options)
    pools = PoolsPlugin(mode, placement_options, clock, timing, routing=routing, deadlines=deadlines)
    for plugin in (CellService(), engine, TrainerService(torch_threads), pools, ProxyPlugin()):
        if plugin.name not in present:
            client.register_plugin(plugin)
    out = client.sync(client.scheduler.gyreflow_placement, mode=mode, options=placement_options or {},
                      timing=dataclasses.asdict(timing) if timing else None,
                      routing=dataclasses.asdict(routing) if routing else None,
                      deadlines=dataclasses.asdict(deadlines) if deadlines else None)
    if "error" in out:
        raise ClusterError(f"placement {mode!r}: {out['error']}")


STAGE_MODULES = ("gyreflow.stages", "gyreflow.model.policy", "gyreflow.train.trainer", "gyreflow.engine.torch_engine")
"""What the stages of a torch-engine run import on a worker (torch and transformers among them);
an execution worker needs them too, for the checkpoints it writes."""


def _import_now() -> None:
    for name in STAGE_MODULES:
        importlib.import_module(name)


async def _import_stage_modules() -> None:
    # In a thread: the worker's event loop keeps answering heartbeats and the scheduler meanwhile.
    await asyncio.to_thread(_import_now)


def warm_up(client: Client) -> None:
    """Every gyreflow worker (one with a ``rollout``, ``trainer`` or ``execution`` resource, held
    cells included) imports what its stages need, all at once. Left to the first task, each pool
    would import in turn (SFT on a trainer cell, then its weights on a rollout cell, then the first
    executions), seconds of CPU each on a small machine. Other workers of a shared cluster, which
    may not have gyreflow installed, are left alone."""
    ours = [a for a, w in workers_info(client).items()
            if is_cell(w.get("resources", {})) or EXECUTION in w.get("resources", {})]
    if ours:
        client.run(_import_stage_modules, workers=ours)


def install_trainers(client: Client, torch_threads: int | None) -> None:
    """Register only the trainer service (what a replay needs: no engine, no routing)."""
    if TrainerService.name not in set(client.run_on_scheduler(_registered)):
        client.register_plugin(TrainerService(torch_threads))
