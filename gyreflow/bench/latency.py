"""`gyreflow bench move-latency`: from a move decision to a trainer task executing on the moved cell.

A real local cluster with the real plugins; trainer tasks queue on the one trainer cell (Dask
sends resource-restricted tasks to a worker at once), then the plugin moves a rollout cell to the
trainer pool, which must wake and steal queued work onto it. Each round measures the time from
the decision to the start of the first trainer task on that cell (both stamped with the same
clock on one machine), then moves the cell back. The baseline printed beside it is the time the
same kind of task takes from submission to start on an idle trainer cell.
"""

from __future__ import annotations

import statistics
import time

from distributed import Client, get_worker, wait

from gyreflow.cluster.local import PoolSpec, cells_of, install, local_cluster
from gyreflow.cluster.pools import ROLLOUT, TRAINER


def _share(seconds: float) -> dict:
    start = time.time()
    time.sleep(seconds)
    return {"worker": get_worker().address, "start": start}


def run_latency_bench(rounds: int = 10, queued: int = 4, task_s: float = 0.2, log=print) -> dict:
    """Median decision -> first-task latency over ``rounds`` moves."""
    spec = PoolSpec(rollout=2, trainer=1, execution_slots=1)
    latencies, baseline = [], []
    with local_cluster(spec) as cluster, Client(cluster) as client:
        install(client, 1, {}, "async")
        pools = cells_of(client)
        mover, trainer = pools[ROLLOUT][0], pools[TRAINER][0]
        for r in range(rounds):
            # Baseline: an idle trainer cell, a task submitted now.
            t0 = time.time()
            f = client.submit(_share, 0.0, key=f"baseline-{r}", resources={TRAINER: 1})
            baseline.append(f.result()["start"] - t0)
            futures = [client.submit(_share, task_s, key=f"share-{r}-{i}", resources={TRAINER: 1}) for i in range(queued)]
            deadline = time.time() + 10
            while time.time() < deadline and not any(f.status == "finished" for f in futures):
                # wait until they are all assigned (to the one trainer cell) and one is running
                info = client.run_on_scheduler(lambda dask_scheduler: sum(
                    1 for ts in dask_scheduler.tasks.values() if ts.processing_on is not None and str(ts.key).startswith("share-")))
                if info >= queued:
                    break
                time.sleep(0.005)
            entry = client.sync(client.scheduler.gyreflow_move, cell=mover, to=TRAINER, reason="benchmark")
            wait(futures)
            results = [f.result() for f in futures]
            on_moved = [x["start"] for x in results if x["worker"] == mover and x["start"] >= entry["decided_wall"]]
            if on_moved:
                latencies.append(min(on_moved) - entry["decided_wall"])
            client.sync(client.scheduler.gyreflow_move, cell=mover, to=ROLLOUT, reason="benchmark")
            log(f"  round {r}: {'-' if not on_moved else f'{latencies[-1] * 1000:.1f} ms'}")
    return {
        "rounds": rounds,
        "measured": len(latencies),
        "move_to_task_median_s": statistics.median(latencies) if latencies else None,
        "move_to_task_max_s": max(latencies) if latencies else None,
        "submit_to_start_median_s": statistics.median(baseline),
        "trainer_cell": trainer,
    }
