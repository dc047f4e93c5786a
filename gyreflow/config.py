"""Typed, validated configuration of a gyreflow run.

Every field has a docstring; :func:`load_config` builds a :class:`RunConfig` from defaults, a JSON
file and ``section.field=value`` overrides, and :func:`validate` refuses anything that cannot work
with a one-line :class:`ConfigError` naming the field and what is allowed.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, get_type_hints

from gyreflow.agents.demos import DemoNoise
from gyreflow.agents.external import ExternalAgent
from gyreflow.agents.loop import AgentConfig
from gyreflow.model.config import ModelConfig
from gyreflow.train.config import OptimConfig


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the field."""


@dataclass(frozen=True)
class TaskConfig:
    """The vault task suite."""

    horizon: int = 4
    """Rooms per task (each costs at least two tool calls)."""
    spare_calls: int = 4
    """Tool calls allowed beyond the two per room a perfect agent needs."""
    reply_padding: int = 0
    """Characters of inscription every tool reply starts with (long tool outputs; see
    :mod:`gyreflow.agents.tasks`)."""
    heldout_tasks: int = 200
    """Held-out tasks evaluated after SFT and every ``rl.eval_every`` steps (a suite's held-out
    tasks, at most this many)."""
    suite: str = ""
    """A task-suite directory (see ``examples/repo_tasks/README.md``): its tasks are run by the
    agent program of ``external``. Empty: the vault tasks, run by the native agent."""


@dataclass(frozen=True)
class SFTConfig:
    """The supervised warm start on synthetic demonstrations."""

    demos: int = 3000
    """Demonstrations generated (one per training task)."""
    steps: int = 150
    """Optimizer steps."""
    horizon: int = 0
    """Rooms of each demonstration (0: ``task.horizon``): long tasks warm-start on short ones."""
    batch_size: int = 8
    """Sequences per step."""
    lr: float = 2e-3
    """Peak learning rate (linear warm-up over the first 30 steps)."""
    noise: DemoNoise = field(default_factory=DemoNoise)
    """How often the demonstrator errs."""


@dataclass(frozen=True)
class RLConfig:
    """The reinforcement-learning loop."""

    steps: int = 32
    """Policy updates."""
    tasks_per_step: int = 12
    """Training tasks per step (a group each)."""
    samples_per_task: int = 8
    """Executions per task: the group size of the advantage estimator."""
    advantage: str = "grpo"
    """Advantage estimator (registry ``gyreflow.algo.ADVANTAGES``)."""
    loss: str = "ppo_clip"
    """Policy loss (registry ``gyreflow.algo.LOSSES``)."""
    clip_eps: float = 0.2
    """PPO clip range."""
    clip_eps_high: float = 0.0
    """Upper PPO clip range ("clip higher"); 0: ``clip_eps``."""
    clip_ratio_c: float = 0.0
    """Dual clip for negative advantages (> 1; 0: off): bounds what a stale token with a large
    ratio can do. Off by default (see the README: with ``is_cap`` 2 it collapsed before the trust region)."""
    is_cap: float = 0.0
    """Truncated importance weight (0: off): a sample drawn by the weights being trained is scored
    on the trainer's own log-prob, weighted by min(trainer / engine probability, ``is_cap``)."""
    max_update_kl: float = 0.05
    """Trust region of an update (0: off): the optimizer step is halved until it moves the policy at
    most this far (mean per-token KL over ``kl_probe_tokens`` of the step's trained samples). One
    Adam step on a small policy can move it by a nat per token, into a policy that never earns a
    reward again."""
    kl_probe_tokens: int = 8192
    """Tokens forwarded to measure an update's KL (taken from every gradient share in turn)."""
    staleness: int = 1
    """Most versions a trained token may lag the weights being updated; 0 is on-policy."""
    shares_per_group: int = 1
    """Gradient tasks per group (token-balanced parts of its paths), which trainer cells share."""
    seed: int = 0
    """Seed of task choice and sampling."""
    eval_every: int = 8
    """Evaluate the held-out tasks after every this many steps, and after the last."""
    retries: int = 2
    """Re-runs of an execution the system failed (an infrastructure or grader failure) before it is
    dropped as a zero-reward placeholder."""
    j_max: int = 5
    """Paths trained per execution at most, chosen by role priority (0: every path)."""
    tree_training: bool = True
    """Train each execution's chosen paths as one tree (every shared node forwarded once) rather
    than path by path; the gradient is the same."""
    aggregation: str = "execution_mean"
    """How the step's loss averages samples (registry ``gyreflow.algo.AGGREGATIONS``): the paper's
    two-level mean (tokens within an execution, then executions), or ``token_mean``."""
    checkpoint_every: int = 1
    """Write an RL checkpoint (policy, optimizer, RL state) after every this many committed steps;
    ``gyreflow run --resume`` continues from the last one (committed steps after it are trained
    again from the archive)."""
    keep_checkpoints: int = 2
    """Step checkpoints kept (the newest; 0: all)."""


@dataclass(frozen=True)
class ClusterConfig:
    """Cells, pools and placement. The embedded cluster starts ``rollout_workers +
    trainer_workers`` cells; a cluster named by ``--scheduler`` must have at least that many."""

    placement: str = "elastic"
    """How cells are shared between rollout and training (``gyreflow.cluster.modes``):
    ``colocated`` (all roll out, then all train), ``async`` (a fixed split), ``lend`` (trainer cells
    roll out while they have no training work) or ``elastic`` (cells move by predicted need)."""
    rollout_workers: int = 2
    """Cells that start in the rollout pool (one engine each)."""
    trainer_workers: int = 1
    """Cells that start in the trainer pool (``colocated`` may start with 0)."""
    consolidate_batch: int = 8
    """``elastic``: live executions one rollout cell keeps when cells are taken for training."""
    dwell_s: float = 2.0
    """Seconds a cell keeps a new role at least (modes that move cells)."""
    idle_s: float = 2.0
    """Seconds a trainer cell without work waits before it may roll out (``elastic``, ``lend``)."""
    drain_s: float = 1.0
    """``elastic``: seconds of ready training a cell taken for training should have at least."""
    stall_s: float = 300.0
    """Seconds without progress after which an execution is reported as stalled (with what it
    waits on)."""
    execution_slots: int = 128
    """Concurrent executions (threads of the execution worker)."""
    torch_threads: int = 1
    """Intra-op torch threads per cell; keep cells x threads <= cores."""
    engine_max_batch: int = 64
    """Live generations per engine."""
    engine_kv_tokens: int = 0
    """Positions of each engine's paged KV pool, live requests and retained sessions together
    (0: room for every live and retained request at up to 4,096 tokens each). Long executions
    need room for their whole contexts, or every call prefills its context again."""
    dashboard_address: str = "127.0.0.1:0"
    """Where the Dask dashboard listens (loopback by default; port 0 picks a free one)."""


@dataclass(frozen=True)
class StorageConfig:
    """Where a run keeps what it writes."""

    archive: str = ""
    """The trajectory archive: empty, ``<run dir>/archive.zarr``; a URL (``s3://bucket/{run}/archive.zarr``)
    puts it on that fsspec store (credentials and endpoint from the store's own configuration,
    e.g. ``AWS_*`` variables); ``{run}`` is the run directory's name."""


@dataclass(frozen=True)
class RunConfig:
    """Everything a run needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    external: ExternalAgent = field(default_factory=ExternalAgent)
    storage: StorageConfig = field(default_factory=StorageConfig)
    """The agent program of suite tasks (``task.suite``)."""

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def placement_options(cfg: RunConfig) -> dict:
    """Options of the configured placement mode's policy that the ``cluster`` section sets."""
    from gyreflow.cluster.modes import mode

    return mode(cfg.cluster.placement).options_from(cfg.cluster)


def _positive(name: str, value, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def validate(cfg: RunConfig) -> RunConfig:
    """Refuse a configuration that cannot work; returns ``cfg`` unchanged when it can."""
    from gyreflow.algo import ADVANTAGES, AGGREGATIONS, LOSSES

    if cfg.rl.advantage not in ADVANTAGES:
        raise ConfigError(f"rl.advantage: unknown {cfg.rl.advantage!r}; allowed: {', '.join(ADVANTAGES.names())}")
    if cfg.rl.loss not in LOSSES:
        raise ConfigError(f"rl.loss: unknown {cfg.rl.loss!r}; allowed: {', '.join(LOSSES.names())}")
    if cfg.rl.aggregation not in AGGREGATIONS:
        raise ConfigError(f"rl.aggregation: unknown {cfg.rl.aggregation!r}; allowed: "
                          f"{', '.join(AGGREGATIONS.names())}")
    _positive("rl.j_max", cfg.rl.j_max, allow_zero=True)
    _positive("rl.retries", cfg.rl.retries, allow_zero=True)
    for name in ("steps", "tasks_per_step"):
        _positive(f"rl.{name}", getattr(cfg.rl, name))
    if cfg.rl.samples_per_task < 2:
        raise ConfigError(f"rl.samples_per_task must be >= 2 (group-relative advantages), got {cfg.rl.samples_per_task}")
    _positive("rl.staleness", cfg.rl.staleness, allow_zero=True)
    _positive("rl.shares_per_group", cfg.rl.shares_per_group)
    _positive("rl.eval_every", cfg.rl.eval_every)
    _positive("rl.checkpoint_every", cfg.rl.checkpoint_every)
    _positive("rl.keep_checkpoints", cfg.rl.keep_checkpoints, allow_zero=True)
    _positive("rl.clip_eps", cfg.rl.clip_eps)
    _positive("rl.clip_eps_high", cfg.rl.clip_eps_high, allow_zero=True)
    _positive("rl.is_cap", cfg.rl.is_cap, allow_zero=True)
    _positive("rl.max_update_kl", cfg.rl.max_update_kl, allow_zero=True)
    _positive("rl.kl_probe_tokens", cfg.rl.kl_probe_tokens)
    if cfg.rl.clip_ratio_c and cfg.rl.clip_ratio_c <= 1:
        raise ConfigError(f"rl.clip_ratio_c must be > 1 (or 0: off), got {cfg.rl.clip_ratio_c}")
    if getattr(LOSSES.get(cfg.rl.loss), "on_policy_only", False) and cfg.rl.staleness > 0:
        raise ConfigError(f"rl.loss {cfg.rl.loss!r} is correct only on-policy: set rl.staleness=0, or use a loss "
                          f"with an importance ratio (ppo_clip)")
    _positive("task.horizon", cfg.task.horizon)
    _positive("task.spare_calls", cfg.task.spare_calls, allow_zero=True)
    _positive("task.reply_padding", cfg.task.reply_padding, allow_zero=True)
    _positive("sft.horizon", cfg.sft.horizon, allow_zero=True)
    _positive("task.heldout_tasks", cfg.task.heldout_tasks)
    _positive("sft.steps", cfg.sft.steps, allow_zero=True)
    _positive("sft.demos", cfg.sft.demos)
    _positive("sft.batch_size", cfg.sft.batch_size)
    _positive("optim.lr", cfg.optim.lr)
    _positive("optim.warmup_steps", cfg.optim.warmup_steps, allow_zero=True)
    _positive("optim.micro_batch_tokens", cfg.optim.micro_batch_tokens)
    if not 0 < cfg.agent.temperature <= 2:
        raise ConfigError(f"agent.temperature must be in (0, 2], got {cfg.agent.temperature}: a greedy call is not a "
                          "sample and trains nothing")
    if cfg.agent.top_p != 1:
        raise ConfigError(f"agent.top_p must be 1, got {cfg.agent.top_p}: behaviour log-probs are those of the "
                          "untruncated distribution, so a nucleus-sampled call trains nothing")
    _positive("agent.max_tokens_per_call", cfg.agent.max_tokens_per_call)
    _positive("agent.max_context_tokens", cfg.agent.max_context_tokens)
    longest = cfg.agent.max_context_tokens + cfg.agent.max_tokens_per_call
    if longest > cfg.model.max_position_embeddings:
        raise ConfigError(f"agent.max_context_tokens {cfg.agent.max_context_tokens} + agent.max_tokens_per_call "
                          f"{cfg.agent.max_tokens_per_call} = {longest} exceeds model.max_position_embeddings "
                          f"{cfg.model.max_position_embeddings}")
    from gyreflow.cluster.modes import PLACEMENTS

    if cfg.cluster.placement not in PLACEMENTS:
        raise ConfigError(f"cluster.placement: unknown mode {cfg.cluster.placement!r}; allowed: {', '.join(PLACEMENTS.names())}")
    if cfg.cluster.rollout_workers < 1:
        raise ConfigError(f"cluster.rollout_workers must be >= 1 (executions need an engine), got {cfg.cluster.rollout_workers}")
    _positive("cluster.trainer_workers", cfg.cluster.trainer_workers, allow_zero=True)
    _positive("cluster.consolidate_batch", cfg.cluster.consolidate_batch)
    for name in ("dwell_s", "idle_s", "drain_s", "stall_s"):
        _positive(f"cluster.{name}", getattr(cfg.cluster, name), allow_zero=name != "stall_s")
    if PLACEMENTS.get(cfg.cluster.placement).on_policy and cfg.rl.staleness > 0:
        raise ConfigError(f"cluster.placement {cfg.cluster.placement!r} trains on-policy (every cell rolls out, then every "
                          f"cell trains), so rl.staleness={cfg.rl.staleness} cannot hold: set rl.staleness=0")
    why = PLACEMENTS.get(cfg.cluster.placement).check(cfg.cluster.rollout_workers, cfg.cluster.trainer_workers,
                                                        **placement_options(cfg))
    if why:
        raise ConfigError(f"cluster: {why}")
    _positive("cluster.execution_slots", cfg.cluster.execution_slots)
    _positive("cluster.torch_threads", cfg.cluster.torch_threads)
    _positive("cluster.engine_max_batch", cfg.cluster.engine_max_batch)
    _positive("cluster.engine_kv_tokens", cfg.cluster.engine_kv_tokens, allow_zero=True)
    if 0 < cfg.cluster.engine_kv_tokens < (need := min(longest + 64, cfg.model.max_position_embeddings)):
        raise ConfigError(f"cluster.engine_kv_tokens {cfg.cluster.engine_kv_tokens} cannot hold one request of "
                          f"{need} tokens (agent.max_context_tokens + agent.max_tokens_per_call + 64)")
    if cfg.storage.archive:
        from gyreflow.storage.stores import is_url

        if is_url(cfg.storage.archive):
            import fsspec

            scheme = cfg.storage.archive.split("://", 1)[0]
            try:
                fsspec.get_filesystem_class(scheme)
            except (ValueError, ImportError) as err:
                raise ConfigError(f"storage.archive: no fsspec filesystem for {scheme!r}: {err}") from None
    if cfg.task.suite:
        from gyreflow.agents.sources import SuiteSource

        try:
            SuiteSource(cfg)
        except ValueError as err:
            raise ConfigError(f"task.suite: {err}") from None
    if cfg.model.hidden_size % cfg.model.num_heads:
        raise ConfigError(
            f"model.hidden_size ({cfg.model.hidden_size}) must be a multiple of model.num_heads ({cfg.model.num_heads})"
        )
    if cfg.model.num_heads % cfg.model.num_kv_heads:
        raise ConfigError(
            f"model.num_heads ({cfg.model.num_heads}) must be a multiple of model.num_kv_heads ({cfg.model.num_kv_heads})"
        )
    return cfg


def _coerce(name: str, typ, value):
    """Turn JSON/CLI ``value`` into ``typ`` (a dataclass, int, float, bool or str)."""
    if is_dataclass(typ):
        if isinstance(value, typ):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{name} must be a table of fields, got {value!r}")
        return _build(name, typ, value)
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    if typ in (int, float):
        kind = "an integer" if typ is int else "a number"
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigError(f"{name} must be {kind}, got {value!r}")
        try:
            number = float(value)
        except ValueError:
            raise ConfigError(f"{name} must be {kind}, got {value!r}") from None
        if typ is int:
            if not number.is_integer():
                raise ConfigError(f"{name} must be {kind}, got {value!r}")
            return int(number)
        return number
    if typ is str:
        if not isinstance(value, str):
            raise ConfigError(f"{name} must be a string, got {value!r}")
        return value
    origin = getattr(typ, "__origin__", None)
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{name} must be a list of strings, got {value!r}")
        return tuple(value)
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise ConfigError(f"{name} must be a table of strings, got {value!r}")
        return dict(value)
    return value


def _build(prefix: str, cls, values: dict):
    hints = get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    unknown = set(values) - known
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(f"unknown field {where}{sorted(unknown)[0]}; allowed: {', '.join(sorted(known))}")
    kwargs = {k: _coerce(f"{prefix}.{k}" if prefix else k, hints[k], v) for k, v in values.items()}
    try:
        return cls(**kwargs)
    except ValueError as err:  # a dataclass's own validation
        raise ConfigError(f"{prefix or cls.__name__}: {err}") from None


def _merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for k, v in override.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def parse_overrides(items: list[str]) -> dict:
    """``["rl.steps=3", "task.horizon=20"]`` -> nested dict (values parsed as JSON when they can be)."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.field=value")
        key, raw = item.split("=", 1)
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        node = out
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Defaults, then the JSON file at ``path``, then ``overrides``; validated."""
    values: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            values = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ConfigError(f"config file {path} is not valid JSON: {err}") from None
        if not isinstance(values, dict):
            raise ConfigError(f"config file {path} must hold a JSON object")
    return config_from(values, overrides)


def config_from(values: dict, overrides: list[str] | None = None) -> RunConfig:
    """A config from JSON ``values`` (e.g. the ``config`` a run stored), then ``overrides``; validated."""
    values = _merge(values, parse_overrides(overrides or []))
    return validate(_build("", RunConfig, values))
