"""One RL step as Dask futures: executions -> trees -> group advantages -> gradient shares ->
update, and the publication of a weights version to the cells.

    execution-<step>-<task>-<sample>   execution slot   an agent run; its calls go through the router
    tree-<execution>                   execution slot   calls merged into a prefix-sharing tree
    advantages-<step>-<task>           execution slot   group-relative advantages of one task
    grad-<step>-<task>-<j>             trainer cell     share j of a group's part of the step's gradient
    update-<step>                      trainer cell     the optimizer step -> the next RL state
    weights-v<version>                 anywhere         the state's weights, without optimizer state
    publish-v<version>-<cell>          that cell        the cell's engine installs the weights

Training streams: a group's gradient share runs as soon as the group is complete (and the weights
it is computed at exist), while the step's stragglers still run; every share is a separate task
on the ``trainer`` resource, so a cell that joins the trainer pool mid-step takes shares of the step
under way. The stage functions are parameters, so the placement benchmark runs this very graph
with emulated compute.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from distributed import Client, Future, wait

from gyreflow.cluster.pools import EXECUTION, TRAINER

SLOT = {EXECUTION: 1}
TRAIN = {TRAINER: 1}


@dataclass(frozen=True)
class Stages:
    """The functions a step's tasks run (see the module docstring for where each runs)."""

    execute: Callable[..., Any]
    """``execute(*args) -> result`` of one execution."""
    tree: Callable[[Any], Any]
    """``tree(result, *tree_args) -> tree``."""
    advantages: Callable[..., dict]
    """``advantages(trees, *advantage_args) -> group``."""
    gradient: Callable[..., dict]
    """``gradient(group, published, j, shares, *gradient_args) -> share``: the gradient of the
    ``j``-th of ``shares`` token-balanced parts of the group."""
    update: Callable[..., dict]
    """``update(step, shares, state, *update_args) -> state``."""
    weights: Callable[[dict], dict]
    """``weights(state) -> published``."""
    publish: Callable[[dict], dict]
    """``publish(published) -> info``, run on one cell."""
    archive: Callable[..., list] | None = None
    """``archive(archive_path, results, segment, trees) -> summaries``: a group's executions into
    the archive, before its training; ``None``: nothing archived."""
    archived: Callable[..., list] | None = None
    """``archived(trees, summaries, archive_path, segment, *tree_args) -> trees``: the trees as
    archived (what the group trains when ``archive`` is set)."""


@dataclass(frozen=True)
class Group:
    """The executions of one task in one step: ``(execution_id, execute args)`` each."""

    task_id: str
    executions: Sequence[tuple[str, tuple]]


@dataclass
class StepFutures:
    step: int
    executions: list[Future]
    trees: list[Future]
    groups: list[Future]
    shares: list[Future]
    update: Future
    """The RL state after this step's update."""
    published: Future
    """Its weights, for engines and the next step's gradient shares."""
    writes: list[Future] = field(default_factory=list)
    """Each group's archive write (its executions' summaries), when the stages archive."""
    started: float = field(default_factory=time.time)


def submit_step(client: Client, step: int, groups: Sequence[Group], stages: Stages, state: Future,
                published: Future, advantage_args: tuple = (), gradient_args: tuple = (),
                shares_per_group: int = 1, tree_args: tuple = (), archive: str | None = None,
                tag: str = "", update_args: tuple = ()) -> StepFutures:
    """Submit one step's tasks; ``state``/``published``: the RL state the step updates and its
    weights (the futures of the previous step, or of the warm start). Each group's gradient work
    is cut into ``shares_per_group`` tasks, so the group of the step's last execution is trained
    by several cells at once. With ``archive`` (and the archive stages), each group is written as
    segment ``group-<k>`` before it trains, and trains what was written. ``tag`` ends every key, so
    graphs of the same steps (replays of one archive) can run side by side on one cluster."""
    executions, trees, group_futs, shares, writes = [], [], [], [], []
    for k, g in enumerate(groups):
        group_ex, group_trees = [], []
        for eid, args in g.executions:
            ex = client.submit(stages.execute, *args, key=f"{eid}{tag}", resources=SLOT)
            group_ex.append(ex)
            group_trees.append(client.submit(stages.tree, ex, *tree_args, key=f"tree-{eid}{tag}", resources=SLOT))
        executions.extend(group_ex)
        trees.extend(group_trees)
        trained = group_trees
        if archive is not None and stages.archive is not None:
            segment = f"group-{k:04d}"  # task ids may not be path-safe
            written = client.submit(stages.archive, archive, group_ex, segment, group_trees,
                                    key=f"archive-{step}-{g.task_id}{tag}", resources=SLOT)
            writes.append(written)
            trained = client.submit(stages.archived, group_trees, written, archive, segment, *tree_args,
                                    key=f"archived-{step}-{g.task_id}{tag}", resources=SLOT)
        adv = client.submit(stages.advantages, trained, *advantage_args, key=f"advantages-{step}-{g.task_id}{tag}",
                            resources=SLOT)
        group_futs.append(adv)
        shares.extend(client.submit(stages.gradient, adv, published, j, shares_per_group, *gradient_args,
                                    key=f"grad-{step}-{g.task_id}-{j}{tag}", resources=TRAIN)
                      for j in range(shares_per_group))
    update = client.submit(stages.update, step, shares, state, *update_args, key=f"update-{step}{tag}", resources=TRAIN)
    nxt = client.submit(stages.weights, update, key=f"weights-v{step + 1}{tag}")
    return StepFutures(step, executions, trees, group_futs, shares, update, nxt, writes)


def publish(client: Client, stages: Stages, published: Future, cells: Sequence[str], version: int) -> list[dict]:
    """Install a weights version on every cell in ``cells`` and wait until all have it; a cell
    that leaves the cluster meanwhile is skipped (its task would wait for it for ever)."""
    done = {
        addr: client.submit(stages.publish, published, key=f"publish-v{version}-{addr.split('//')[-1]}",
                            workers=[addr], allow_other_workers=False, pure=False)
        for addr in cells
    }
    while pending := [f for f in done.values() if not f.done()]:
        try:
            wait(pending, timeout=1.0)
        except TimeoutError:
            present = set(client.scheduler_info(n_workers=-1)["workers"])
            for addr in [a for a, f in done.items() if not f.done() and a not in present]:
                done.pop(addr).cancel()
    return [f.result() for f in done.values()]
