"""What the recipes share: engine settings, the cells that get weights, held-out evaluation."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from distributed import Client, Future, wait

from gyreflow.cluster.local import cells_of, workers_info
from gyreflow.cluster.modes import mode as placement_mode
from gyreflow.cluster.pools import ROLLOUT, is_cell
from gyreflow.config import RunConfig
from gyreflow.model.tokenizer import VOCAB_SIZE
from gyreflow.stages import run_execution
from gyreflow.stepgraph import SLOT
from gyreflow.storage import write_executions
from gyreflow.trajectory.records import END_REASONS, RETRIED


KV_BLOCK = 64
"""Positions per KV block of the engines a run sizes by ``cluster.engine_kv_tokens``."""


def engine_options(cfg: RunConfig) -> dict:
    # Room for the longest prompt the agent builds plus its reply, within the model's positions.
    ctx = min(cfg.agent.max_context_tokens + cfg.agent.max_tokens_per_call + 64, cfg.model.max_position_embeddings)
    options = {"max_batch": cfg.cluster.engine_max_batch, "max_seq_len": ctx,
               "retain_sessions": 2 * cfg.cluster.engine_max_batch}
    if cfg.cluster.engine_kv_tokens:
        options.update(kv_block_size=KV_BLOCK, kv_blocks=-(-cfg.cluster.engine_kv_tokens // KV_BLOCK))
    return options


def engine_cells(client: Client, cfg: RunConfig) -> list[str]:
    """Cells whose engines get each weights version: those that may roll out in this mode (where
    trainer cells may, every cell, those between pools in a move too)."""
    if placement_mode(cfg.cluster.placement).trainers_roll_out:
        return sorted(a for a, w in workers_info(client).items() if is_cell(w.get("resources", {})))
    return cells_of(client)[ROLLOUT]


def step_args(cfg: RunConfig) -> dict:
    """The arguments of a step's tasks under ``cfg``, as keywords of
    :func:`~gyreflow.stepgraph.submit_step`."""
    loss_kwargs = {"clip_eps": cfg.rl.clip_eps, "clip_eps_high": cfg.rl.clip_eps_high or None,
                   "clip_ratio_c": cfg.rl.clip_ratio_c or None}
    staleness = placement_mode(cfg.cluster.placement).staleness(cfg.rl.staleness)
    probe = cfg.rl.kl_probe_tokens if cfg.rl.max_update_kl > 0 else 0
    return {"advantage_args": (cfg.rl.advantage, cfg.rl.j_max, cfg.rl.aggregation, cfg.rl.seed, cfg.rl.tree_training),
            "gradient_args": (cfg.rl.loss, loss_kwargs, staleness, cfg.rl.is_cap, probe),
            "update_args": (cfg.rl.max_update_kl, probe),
            "tree_args": (VOCAB_SIZE, cfg.model.max_position_embeddings),
            "shares_per_group": cfg.rl.shares_per_group}


def end_reasons(executions) -> dict[str, int]:
    """How many executions (results, or archive summaries) ended with each reason (every reason
    listed, zeros included)."""
    ends = [e["end_reason"] if isinstance(e, dict) else e.end_reason for e in executions]
    return {reason: ends.count(reason) for reason in END_REASONS}


def rates(executions) -> dict:
    """Pass rate, mean reward and end reasons of executions (results, or archive summaries). Those
    the system failed are no verdict on the policy: rates are over the others."""
    rows = [e if isinstance(e, dict) else {"end_reason": e.end_reason, "passed": e.passed, "reward": e.reward}
            for e in executions]
    judged = [r for r in rows if r["end_reason"] not in RETRIED] or rows
    return {"pass_rate": float(np.mean([r["passed"] for r in judged])),
            "mean_reward": float(np.mean([r["reward"] for r in judged])), "end_reasons": end_reasons(rows)}


@dataclass
class Evaluation:
    """Held-out executions of one weights version, running; their archive write into ``step``."""

    version: int
    step: int
    executions: list[Future]
    writes: list[Future]

    def done(self) -> bool:
        return all(f.done() for f in self.executions + self.writes)

    def wait(self) -> None:
        """Until every held-out execution has ended (the engines may then take another version)."""
        wait(self.executions)

    def summary(self, client: Client) -> dict:
        """Pass rate, mean reward and end reasons (blocks until the executions end): of the
        executions as archived, where they are."""
        if self.writes:
            return rates([s for group in client.gather(self.writes) for s in group])
        return rates(client.gather(self.executions))


def evaluate(client: Client, heldout, source, cfg: RunConfig, version: int, archive: str | Path | None,
             step: int) -> Evaluation:
    """Submit the held-out executions of the weights now on the engines (``version``), and their
    archive write (split ``heldout``) into the archive's ``step``; returns at once."""
    futures = [client.submit(run_execution, task, source.agent(), f"eval-v{version}-{i}", step, 0, cfg.rl.seed,
                             cfg.rl.retries, key=f"eval-v{version}-{i}", resources=SLOT)
               for i, task in enumerate(heldout)]
    writes = [] if archive is None else [
        client.submit(write_executions, str(archive), futures, f"eval-v{version}", key=f"archive-eval-v{version}",
                      keep_existing=True, resources=SLOT)]
    return Evaluation(version, step, futures, writes)
