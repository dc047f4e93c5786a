"""``gyreflow run | serve | inspect | bench``: the command line."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
import time
from pathlib import Path

import click
from rich.console import Console

console = Console(highlight=False, soft_wrap=True)
REPO_PIPELINES = Path(__file__).resolve().parent.parent / "pipelines"


def _quiet() -> None:
    # Worker processes inherit these: no hub access, no progress bars from transformers.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "error")
    import dask

    dask.config.set({"logging.distributed": "error"})
    for name in ("distributed", "bokeh", "tornado"):
        logging.getLogger(name).setLevel(logging.ERROR)


RECIPES = {"grpo": "gyreflow.recipes.grpo"}
"""Pipelines by name that ship with the package."""


def find_pipeline(name: str):
    """A pipeline module by name (a recipe of the package, ``pipelines/<name>.py`` of the checkout,
    or of ``$GYREFLOW_PIPELINES``) or by path to a ``.py`` file. It must define
    ``run(client, cfg, run_dir, log=...)``."""
    if name in RECIPES:
        return importlib.import_module(RECIPES[name])
    if name.endswith(".py"):
        path = Path(name)
    else:
        dirs = [Path(d) for d in os.environ.get("GYREFLOW_PIPELINES", "").split(os.pathsep) if d] + [REPO_PIPELINES]
        path = next((d / f"{name}.py" for d in dirs if (d / f"{name}.py").is_file()), None)
        if path is None:
            known = sorted({*RECIPES, *(p.stem for d in dirs if d.is_dir() for p in d.glob("*.py")
                                       if not p.stem.startswith("_"))})
            raise click.UsageError(f"unknown pipeline {name!r}; available: {', '.join(known)}")
    if not path.is_file():
        raise click.UsageError(f"pipeline file {path} does not exist")
    spec = importlib.util.spec_from_file_location(f"gyreflow_pipeline_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses in the pipeline look their module up here
    spec.loader.exec_module(module)
    if not callable(getattr(module, "run", None)):
        raise click.UsageError(f"pipeline {path} defines no run(client, cfg, run_dir) function")
    return module


@click.group()
@click.version_option(package_name="gyreflow")
def main() -> None:
    """gyreflow: elastic reinforcement learning on Dask for long-horizon LLM agents."""


def scheduler_options(command):
    """``--scheduler`` and ``--connect-timeout``, for the commands that can run on any Dask cluster."""
    command = click.option("--connect-timeout", type=click.FloatRange(min=0.1), default=10.0, show_default=True,
                           help="Seconds to wait for the scheduler at --scheduler to answer.")(command)
    return click.option("--scheduler", help="Address of a running Dask scheduler (default: start an embedded "
                                            "cluster).")(command)


@main.command()
@click.option("--pipeline", "pipeline_name", default="grpo", show_default=True, help="Pipeline name or .py file.")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="JSON config file.")
@click.option("--set", "overrides", multiple=True, metavar="SECTION.FIELD=VALUE", help="Override a config field.")
@click.option("--out", type=click.Path(file_okay=False), help="Run directory (default: storage/runs/<time>).")
@click.option("--resume", "resume_dir", type=click.Path(file_okay=False),
              help="Continue this interrupted run directory from its last committed step (its config; --set may "
                   "raise rl.steps).")
@scheduler_options
@click.option("--sft-cache", type=click.Path(file_okay=False), default="storage/sft-cache", show_default=True,
              help="Reuse SFT warm starts with identical settings from here ('' disables).")
def run(pipeline_name, config_path, overrides, out, resume_dir, scheduler, connect_timeout, sft_cache) -> None:
    """Run a training pipeline; writes archive, checkpoints and report.json into the run directory."""
    from gyreflow.config import ConfigError, load_config

    _quiet()
    pipeline = find_pipeline(pipeline_name)
    if resume_dir:
        if config_path or out:
            raise click.UsageError("--resume takes the run directory's own config and place: drop --config/--out")
        run_dir = Path(resume_dir)
        _check_resumable(run_dir)
        config_path = run_dir / "config.json"
    else:
        run_dir = Path(out) if out else Path("storage", "runs", time.strftime("run-%Y%m%d-%H%M%S"))
        if run_dir.exists() and any(run_dir.iterdir()):
            raise click.UsageError(f"run directory {run_dir} already exists and is not empty; choose another --out "
                                   f"(or continue it with --resume {run_dir})")
    try:
        cfg = load_config(config_path, list(overrides))
    except ConfigError as err:
        raise click.UsageError(f"invalid config: {err}") from None
    if resume_dir:
        _check_steps_left(run_dir, cfg.rl.steps)

    from gyreflow.cluster.local import ClusterError, PoolSpec
    from gyreflow.train.checkpoint import CheckpointError

    client, cluster = _connect(scheduler, connect_timeout, PoolSpec(rollout=cfg.cluster.rollout_workers,
                                                   trainer=cfg.cluster.trainer_workers,
                                                   execution_slots=cfg.cluster.execution_slots,
                                                   dashboard_address=cfg.cluster.dashboard_address))
    run_dir.mkdir(parents=True, exist_ok=True)
    from gyreflow.cluster.dashboard import dashboard_link

    console.print(f"dashboard: {client.dashboard_link}  (pools: {dashboard_link(client) or 'no dashboard'})")
    console.print(f"run directory: {run_dir}")
    code = 0
    try:
        kwargs = {"resume": True} if resume_dir else {}
        report = pipeline.run(client, cfg, run_dir, log=console.print, cache_dir=Path(sft_cache) if sft_cache else None,
                              **kwargs)
        last = report["steps"][-1] if report["steps"] else {}
        console.print(f"held-out pass rate: {report['initial_heldout_pass_rate']:.3f} -> "
                      f"{last.get('heldout_pass_rate', float('nan')):.3f}; report: {run_dir / 'report.json'}")
    except KeyboardInterrupt:
        # The interrupted gather's task ends with the cancelled futures; that is expected here.
        logging.getLogger("asyncio").setLevel(logging.CRITICAL)
        console.print(f"[yellow]interrupted[/yellow]: committed steps stay readable in the archive; continue with "
                      f"gyreflow run --resume {run_dir}")
        _mark_interrupted(run_dir)
        code = 130
        # Committed steps are on disk: if shutting the cluster down hangs, the interrupt still ends the run.
        import threading

        watchdog = threading.Timer(30.0, os._exit, args=(130,))
        watchdog.daemon = True
        watchdog.start()
    except (ClusterError, CheckpointError) as err:
        console.print(f"[red]error:[/red] {err}")
        code = 2
    finally:
        try:
            client.cancel(list(client.futures), force=True) if client.futures else None
            client.close()
            if cluster is not None:
                cluster.close()
        except Exception:
            pass
    sys.exit(code)


def _connect(scheduler: str | None, timeout: float, spec):
    """A client of the cluster at ``scheduler`` (waiting up to ``timeout`` s for it to answer), or of
    an embedded cluster of ``spec`` (then also the cluster); exits 2 naming what is wrong when there
    is none."""
    from distributed import Client

    from gyreflow.cluster.local import ClusterError, connect, local_cluster

    try:
        if scheduler:
            return connect(scheduler, timeout=timeout), None
        console.print("starting the embedded cluster ...")
        cluster = local_cluster(spec)
        return Client(cluster), cluster
    except ClusterError as err:
        console.print(f"[red]error:[/red] {err}")
        sys.exit(2)


def _check_resumable(run_dir: Path) -> None:
    """Refuse, naming why, a directory that is not a gyreflow run that can be continued."""
    if not run_dir.is_dir():
        raise click.UsageError(f"cannot resume {run_dir}: no such directory")
    missing = [name for name in ("config.json", "report.json") if not (run_dir / name).exists()]
    if missing:
        raise click.UsageError(f"cannot resume {run_dir}: it is not a gyreflow run directory ({', '.join(missing)} "
                               f"missing)")
    from gyreflow.recipes.replay import archive_of
    from gyreflow.storage import ArchiveReader

    try:
        ArchiveReader(archive_of(run_dir))
    except (ValueError, FileNotFoundError) as err:
        raise click.UsageError(f"cannot resume {run_dir}: {err}") from None


def _check_steps_left(run_dir: Path, steps: int) -> None:
    from gyreflow.recipes.replay import archive_of
    from gyreflow.storage import ArchiveReader

    committed = ArchiveReader(archive_of(run_dir)).committed_steps
    if committed and max(committed) + 1 >= steps:
        raise click.UsageError(f"run {run_dir} has committed all its {steps} steps; raise rl.steps with --set to "
                               f"train on")


def _mark_interrupted(run_dir: Path) -> None:
    import json

    path = run_dir / "report.json"
    if path.is_file():
        data = json.loads(path.read_text())
        data["interrupted"] = True
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, path)


@main.command()
@click.option("--checkpoint", required=True, type=click.Path(file_okay=False), help="Checkpoint directory to serve.")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Run directory for the archive (default storage/serve/serve-<time>).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to bind (loopback by default).")
@click.option("--port", type=int, default=0, show_default=True, help="Port (0 picks a free one).")
@click.option("--sessions", type=click.IntRange(0, 1000), default=1, show_default=True,
              help="Sessions to open at start (more through the admin route).")
@click.option("--model-name", default="gyreflow-policy", show_default=True, help="Model name clients ask for.")
@click.option("--max-calls", type=click.IntRange(1), default=1000, show_default=True, help="Model calls per session.")
@click.option("--token-budget", type=click.IntRange(1), default=1 << 20, show_default=True,
              help="Generated tokens per session.")
@click.option("--max-tokens-per-call", type=click.IntRange(1), default=512, show_default=True,
              help="Completion length when a request names none (and the most it may name).")
@click.option("--time-limit", type=click.FloatRange(min=1.0), default=24 * 3600.0, show_default=True,
              help="Seconds a session may live.")
@click.option("--max-context", type=click.IntRange(2), default=None,
              help="Longest prompt + completion the engine takes (default: the model's positions).")
def serve(checkpoint, out, host, port, sessions, model_name, max_calls, token_budget, max_tokens_per_call,
          time_limit, max_context) -> None:
    """Serve a checkpoint through the OpenAI-compatible proxy; record each session as an execution.

    Stop with Ctrl-C: open sessions are written and the archive is committed.
    """
    import signal
    import threading

    _quiet()
    from gyreflow.proxy.serve import Serve
    from gyreflow.proxy.sessions import Budget

    run_dir = Path(out) if out else Path("storage") / "serve" / time.strftime("serve-%Y%m%d-%H%M%S")
    if (run_dir / "archive.zarr").exists():
        console.print(f"[red]error:[/red] {run_dir / 'archive.zarr'} already exists; choose another --out")
        sys.exit(2)
    try:
        budget = Budget(max_calls=max_calls, token_budget=token_budget, max_tokens_per_call=max_tokens_per_call,
                        time_limit_s=time_limit)
        server = Serve(checkpoint, run_dir, host=host, port=port, model_name=model_name, budget=budget,
                       max_context=max_context)
    except (ValueError, OSError) as err:  # not a checkpoint, a port in use, an address not here
        console.print(f"[red]error:[/red] {err}")
        sys.exit(2)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    console.print(f"gyreflow serve: model {model_name!r}, context {server.max_context:,} tokens, at {server.proxy.url}")
    console.print(f"admin key: {server.admin_key}  (POST/DELETE {server.proxy.url}/gyreflow/sessions)")
    for _ in range(sessions):
        s = server.open_session()
        console.print(f"session {s.execution_id}: OPENAI_BASE_URL={server.proxy.server.base_url(s)} "
                      f"OPENAI_API_KEY={s.secret}")
    console.print(f"archive: {server.archive}  (Ctrl-C to stop)")
    while not stop.wait(0.5):
        pass
    summary = server.stop()
    console.print(f"stopped: {summary['executions']} executions committed to {server.archive}")


@main.command()
@click.argument("path", type=click.Path(file_okay=False))
@click.option("--verify", is_flag=True, help="Check every committed step; exit 1 naming the first damage.")
@click.option("--plots", "plots_dir", type=click.Path(file_okay=False),
              help="Write reward.png, pass_rate.png and tokens.png here.")
def inspect(path, verify, plots_dir) -> None:
    """Summarise an archive (or a run directory): per committed step, executions, tokens, rewards,
    end reasons, dedup ratio."""
    from gyreflow.recipes.replay import archive_of
    from gyreflow.storage import ArchiveReader
    from gyreflow.storage.summary import plot, step_rows
    from gyreflow.storage.verify import ArchiveDamaged, verify as verify_archive

    from gyreflow.storage.stores import is_url

    archive = archive_of(path)
    if not is_url(path) and not Path(path).exists():
        raise click.UsageError(f"{path} does not exist")
    if verify:
        try:
            v = verify_archive(archive)
        except ArchiveDamaged as err:
            console.print(f"[red]damaged:[/red] {err}")
            sys.exit(1)
        console.print(f"ok: {archive} (schema {v.schema_version}): {len(v.steps)} committed steps, {v.executions} "
                      f"executions, {v.calls} calls, {v.tokens} tokens, {v.files} files, no pickles")
        return
    try:
        reader = ArchiveReader(archive)
    except (ValueError, FileNotFoundError) as err:
        console.print(f"[red]error:[/red] {err}")
        sys.exit(2)
    rows = step_rows(reader)
    console.print(f"{archive}: schema {reader.schema_version}, {len(rows)} committed steps")
    console.print("step  train  held-out  calls   tokens  stored  dedup  reward  pass  held-out pass  end reasons")
    def fmt(x, spec: str) -> str:
        width = int(spec.split(".")[0])
        return "-".rjust(width) if x is None else format(x, spec)

    for r in rows:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(r["end_reasons"].items()))
        console.print(f"{r['step']:>4}  {r['train_executions']:>5}  {r['heldout_executions']:>8}  {r['calls']:>5}  "
                      f"{r['tokens']:>7}  {r['stored_tokens']:>6}  {fmt(r['dedup_ratio'], '5.2f')}  "
                      f"{fmt(r['train_reward'], '6.3f')}  {fmt(r['train_pass_rate'], '4.2f')}  "
                      f"{fmt(r['heldout_pass_rate'], '13.3f')}  {reasons}")
    if plots_dir:
        for written in plot(rows, Path(plots_dir)):
            console.print(f"plot: {written}")


@main.command()
@click.argument("archive", type=click.Path(file_okay=False))
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Run directory of the replay.")
@click.option("--set", "overrides", multiple=True, metavar="SECTION.FIELD=VALUE",
              help="Override a field of the config the archive's run stored.")
@click.option("--init", "init_dir", type=click.Path(file_okay=False),
              help="Policy to start from (default: the one the run started its RL steps from).")
@click.option("--evaluate", is_flag=True, help="Then run the held-out tasks with the replayed policy (on a rollout cell).")
@scheduler_options
def replay(archive, out, overrides, init_dir, evaluate, scheduler, connect_timeout) -> None:
    """Train again from a trajectory archive (no engine, no rollout); writes OUT/report.json and
    OUT/checkpoints/final."""
    from gyreflow.config import ConfigError
    from gyreflow.recipes import replay as recipe
    from gyreflow.storage import ArchiveReader

    _quiet()
    out_dir = Path(out)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise click.UsageError(f"{out_dir} already exists and is not empty; choose another --out")
    path = recipe.archive_of(archive)
    try:
        reader = ArchiveReader(path)
        cfg = recipe.replay_config(reader, list(overrides))
    except (FileNotFoundError, ValueError) as err:  # ConfigError is a ValueError
        kind = "invalid config" if isinstance(err, ConfigError) else "not a replayable archive"
        raise click.UsageError(f"{kind}: {err}") from None
    if not reader.committed_steps:
        raise click.UsageError(f"archive {path} has no committed step to replay")

    from gyreflow.cluster.local import ClusterError, PoolSpec

    client, cluster = _connect(scheduler, connect_timeout, PoolSpec(rollout=int(evaluate), trainer=cfg.cluster.trainer_workers or 1,
                                                   execution_slots=cfg.cluster.execution_slots if evaluate else 8,
                                                   dashboard_address=cfg.cluster.dashboard_address))
    out_dir.mkdir(parents=True, exist_ok=True)
    code = 0
    try:
        console.print(f"dashboard: {client.dashboard_link}")
        report = recipe.run(client, cfg, path, out_dir, init=init_dir, log=console.print, evaluate=evaluate)
        console.print(f"replayed {len(report['steps'])} steps: {report['trained_tokens']} trained tokens, "
                      f"{report['trained_tokens_per_s']:.0f} tokens/s; weights: {report['final']}")
    except (FileNotFoundError, ValueError, ClusterError) as err:
        console.print(f"[red]error:[/red] {err}")
        code = 2
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
    sys.exit(code)


@main.group()
def bench() -> None:
    """Benchmarks that print ratios against baselines measured in the same invocation."""


def _split(text: str) -> tuple[int, int]:
    try:
        r, t = (int(x) for x in text.split(":"))
    except ValueError:
        raise click.BadParameter(f"split {text!r} must look like ROLLOUT:TRAINER, e.g. 6:2") from None
    return r, t


@bench.command("placement")
@click.option("--workload", "workload_name", default="xlong-tail", show_default=True,
              help="Shipped workload name (xlong-tail, flat, grow, join, onpolicy) or a workload JSON file.")
@click.option("--modes", default="colocated,async,lend,elastic", show_default=True,
              help="Comma-separated arms: colocated, async (= async_user and async_oracle), async_user, "
                   "async_oracle, lend, elastic.")
@click.option("--repeats", type=click.IntRange(1), default=1, show_default=True,
              help="Rounds of every arm, interleaved.")
@click.option("--split", "splits", multiple=True, metavar="R:T", help="async split the oracle tries (repeatable).")
@click.option("--steps", type=int, help="Override the workload's number of steps.")
@click.option("--time-scale", type=float, help="Override emulated seconds per wall second.")
@click.option("--execution-workers", type=click.IntRange(1), default=2, show_default=True,
              help="Worker processes the executions are spread over (one event loop each).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write the figures as JSON here.")
def bench_placement(workload_name, modes, repeats, splits, steps, time_scale, execution_workers, json_path) -> None:
    """Every placement mode on one workload, with the emulated cost model (see README)."""
    import dataclasses
    import json

    from gyreflow.bench.placement import ARMS, run_bench
    from gyreflow.bench.report import format_placement
    from gyreflow.bench.workload import WorkloadError
    from gyreflow.bench.workload_file import TIME_SCALES, load_workload

    _quiet()
    try:
        workload = load_workload(workload_name)
    except WorkloadError as err:
        raise click.UsageError(str(err)) from None
    chosen = []
    for m in (m.strip() for m in modes.split(",") if m.strip()):
        chosen += ["async_user", "async_oracle"] if m == "async" else [m]
    unknown = [m for m in chosen if m not in ARMS]
    if unknown or not chosen:
        raise click.UsageError(f"unknown mode(s) {', '.join(map(repr, unknown)) or '(none)'}; allowed: async, "
                               f"{', '.join(ARMS)}")
    parsed = [_split(s) for s in splits]
    for r, t in parsed:
        if r < 1 or t < 1 or r + t != workload.cells:
            raise click.UsageError(f"split {r}:{t} must have at least one cell in each pool and sum to the "
                                   f"workload's {workload.cells} cells")
    if steps is not None:
        if steps < 1:
            raise click.UsageError("--steps must be >= 1")
        if any(c.from_step >= steps for c in workload.schedule):
            workload = dataclasses.replace(workload, schedule=tuple(c for c in workload.schedule if c.from_step < steps))
        workload = dataclasses.replace(workload, steps=steps)
    if time_scale is not None:
        lo, hi = TIME_SCALES
        if not lo <= time_scale <= hi:  # NaN fails too
            raise click.UsageError(f"--time-scale must be between {lo:g} and {hi:g}, got {time_scale:g}")
        workload = dataclasses.replace(workload, time_scale=time_scale)
    console.print(f"workload {workload.name}: {workload.cells} cells, {workload.steps} steps, "
                  f"{workload.executions_per_step} executions per step, time scale x{workload.time_scale:g} (emulated)")
    try:
        out = run_bench(workload, repeats, tuple(dict.fromkeys(chosen)), parsed or None, log=console.print,
                        execution_workers=execution_workers)
    except WorkloadError as err:
        raise click.UsageError(str(err)) from None
    console.print(format_placement(out))
    if json_path:
        Path(json_path).write_text(json.dumps(out, indent=2) + "\n")
        console.print(f"figures written to {json_path}")


@bench.command("trajectories")
@click.option("--repeats", type=click.IntRange(1), default=5, show_default=True, help="Rounds of each timing.")
@click.option("--executions", type=click.IntRange(1), default=4, show_default=True, help="Executions per timing.")
@click.option("--path-tokens", type=click.IntRange(16), default=640, show_default=True, help="Tokens of each path.")
@click.option("--archive-executions", type=click.IntRange(1), default=32, show_default=True,
              help="Agent executions written to and read from the archive.")
@click.option("--archive-calls", type=click.IntRange(1), default=40, show_default=True,
              help="Main-agent calls of each of them.")
@click.option("--reduce-groups", type=click.IntRange(1), default=32, show_default=True,
              help="Groups of the step whose gradient reduction is measured.")
@click.option("--reduce-shares", type=click.IntRange(1), default=8, show_default=True, help="Shares per group.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write the figures as JSON here.")
def bench_trajectories(repeats, executions, path_tokens, archive_executions, archive_calls, reduce_groups,
                       reduce_shares, json_path) -> None:
    """Tree-shared vs per-path training, forward-backward at J_max 1 and 5 vs uncapped, stored
    tokens and archive throughput vs numpy, gradient-reduction memory."""
    from gyreflow.bench import trajectories

    out = trajectories.run(executions=executions, path_tokens=path_tokens, repeats=repeats,
                           archive_executions=archive_executions, archive_calls=archive_calls,
                           reduce_groups=reduce_groups, reduce_shares=reduce_shares)
    click.echo(trajectories.summary(out))
    if json_path:
        trajectories.write_json(out, json_path)
        click.echo(f"figures written to {json_path}")


@bench.command("placement-tables")
@click.argument("json_paths", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--update", "readme", type=click.Path(exists=True, dir_okay=False),
              help="Write the tables into this file, between <!-- placement-tables:start/end --> markers.")
def bench_placement_tables(json_paths, readme) -> None:
    """The README's placement tables, from `gyreflow bench placement --json` files."""
    import json

    from gyreflow.bench.report import markdown_tables, update_readme

    outs = []
    for p in json_paths:
        try:
            outs.append(json.loads(Path(p).read_text(encoding="utf-8")))
            markdown_tables([outs[-1]])  # each file on its own, so that the error can name it
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError, IndexError) as err:
            raise click.UsageError(f"{p}: not a placement benchmark JSON: {type(err).__name__}: {err}") from None
    text = markdown_tables(outs)
    if readme:
        try:
            update_readme(Path(readme), text)
        except ValueError as err:
            raise click.UsageError(str(err)) from None
        console.print(f"tables written to {readme}")
    else:
        console.print(text)


@bench.command("pieces")
@click.option("--tokens", type=click.IntRange(2), default=4096, show_default=True, help="Tokens of the path.")
@click.option("--piece", type=click.IntRange(1), default=512, show_default=True, help="Tokens of each piece.")
@click.option("--repeats", type=click.IntRange(1), default=3, show_default=True, help="Rounds of each arm.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write the figures as JSON here.")
def bench_pieces(tokens, piece, repeats, json_path) -> None:
    """Peak memory and time of one long path's gradient, whole vs in pieces (default policy)."""
    import json

    from gyreflow.bench import pieces

    if piece >= tokens:
        raise click.UsageError(f"--piece {piece} must be shorter than --tokens {tokens}: the path would train whole")
    out = pieces.run(tokens=tokens, piece=piece, repeats=repeats)
    click.echo(pieces.summary(out))
    if json_path:
        Path(json_path).write_text(json.dumps(out, indent=2) + "\n")
        click.echo(f"figures written to {json_path}")


@bench.command("proxy")
@click.option("--calls", type=click.IntRange(1), default=2000, show_default=True, help="Timed calls of each path.")
@click.option("--warmup", type=click.IntRange(0), default=200, show_default=True, help="Untimed calls of each path first.")
@click.option("--messages", type=click.IntRange(2), default=8, show_default=True, help="Messages of the request.")
@click.option("--concurrency", type=click.IntRange(1), default=1, show_default=True,
              help="Above 1, also this many client threads at once.")
@click.option("--client", "client_kind", type=click.Choice(["http", "openai"]), default="http", show_default=True,
              help="http: http.client on one keep-alive connection; openai: the official SDK.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write the figures as JSON here.")
def bench_proxy(calls, warmup, messages, concurrency, client_kind, json_path) -> None:
    """Latency the OpenAI-compatible proxy adds per call over a direct engine call (zero-cost engine)."""
    import json

    from gyreflow.bench.proxy import format_proxy, run_bench

    _quiet()
    out = run_bench(calls=calls, warmup=warmup, prompt_messages=messages, concurrency=concurrency, client=client_kind)
    console.print(format_proxy(out))
    if json_path:
        Path(json_path).write_text(json.dumps(out, indent=2) + "\n")
        console.print(f"figures written to {json_path}")


def _compare_runs(arms: dict[str, list[str]], config_path, overrides, out, cells) -> dict:
    """The grpo pipeline once per arm (its extra overrides), on an embedded cluster of its own, with
    the same seeds and the SFT cache shared; figures per arm."""
    import shutil

    from distributed import Client

    from gyreflow.cluster.local import PoolSpec, local_cluster
    from gyreflow.cluster.modes import PLACEMENTS
    from gyreflow.config import ConfigError, load_config

    pipeline = find_pipeline("grpo")
    figures = {}
    for arm, extra in arms.items():
        try:
            cfg = load_config(config_path, [*overrides, *extra])
        except ConfigError as err:
            raise click.UsageError(f"invalid config ({arm}): {err}") from None
        mode = PLACEMENTS.get(cfg.cluster.placement)
        rollout, trainer = (mode.start_split(cells - 1, 1) if cells else
                            (cfg.cluster.rollout_workers, cfg.cluster.trainer_workers))
        run_dir = Path(out, arm)
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        console.print(f"{arm}: {rollout} rollout + {trainer} trainer cells ...")
        spec = PoolSpec(rollout=rollout, trainer=trainer, execution_slots=cfg.cluster.execution_slots)
        with local_cluster(spec) as cluster, Client(cluster) as client:
            report = pipeline.run(client, cfg, run_dir, log=lambda *_: None, cache_dir=Path("storage/sft-cache"))
        placement = report.get("placement", {})
        steps = report["steps"]
        figures[arm] = {"overrides": extra, "wall_s": report["total_wall_s"], "rl_wall_s": sum(s["wall_s"] for s in steps),
                        "train_s": sum(s.get("train", {}).get("train_s", 0.0) for s in steps),
                        "trained_tokens": sum(s.get("train", {}).get("trained_tokens", 0) for s in steps),
                        "moves": placement.get("moves", 0), "migrations": placement.get("migrations", 0),
                        "heldout_pass_rate": [report["initial_heldout_pass_rate"]] + [s["heldout_pass_rate"] for s in steps
                                                                                       if s["heldout_pass_rate"] is not None],
                        "max_staleness": max(s["max_staleness"] for s in steps)}
        f = figures[arm]
        console.print(f"  {arm}: RL steps {f['rl_wall_s']:.1f}s  training {f['train_s']:.1f}s  trained tokens "
                      f"{f['trained_tokens']:,}  moves {f['moves']}  migrations {f['migrations']}  held-out pass "
                      f"{f['heldout_pass_rate'][0]:.3f} -> {f['heldout_pass_rate'][-1]:.3f}")
    return figures


@bench.command("modes")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="JSON config file.")
@click.option("--set", "overrides", multiple=True, metavar="SECTION.FIELD=VALUE", help="Override a config field.")
@click.option("--cells", type=int, default=3, show_default=True, help="Cells of the embedded cluster.")
@click.option("--out", type=click.Path(file_okay=False), default="storage/bench-modes", show_default=True,
              help="Parent directory of the runs.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write the figures as JSON here.")
def bench_modes(config_path, overrides, cells, out, json_path) -> None:
    """The grpo pipeline with real compute (torch engine) in every placement mode, side by side."""
    import json

    from gyreflow.cluster.modes import PLACEMENTS

    _quiet()
    if cells < 2:
        raise click.UsageError("--cells must be >= 2 (one rollout and one trainer cell at least)")
    arms = {m: [*(["rl.staleness=0"] if PLACEMENTS.get(m).on_policy else []), f"cluster.placement={m}",
                f"cluster.rollout_workers={PLACEMENTS.get(m).start_split(cells - 1, 1)[0]}",
                f"cluster.trainer_workers={PLACEMENTS.get(m).start_split(cells - 1, 1)[1]}"]
            for m in PLACEMENTS.names()}
    figures = _compare_runs(arms, config_path, overrides, out, cells)
    if json_path:
        Path(json_path).write_text(json.dumps(figures, indent=2) + "\n")


@bench.command("jmax")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="JSON config file.")
@click.option("--set", "overrides", multiple=True, metavar="SECTION.FIELD=VALUE", help="Override a config field.")
@click.option("--values", default="1,5,0", show_default=True, help="Comma-separated rl.j_max values (0 = all paths).")
@click.option("--out", type=click.Path(file_okay=False), default="storage/bench-jmax", show_default=True,
              help="Parent directory of the runs.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write the figures as JSON here.")
def bench_jmax(config_path, overrides, values, out, json_path) -> None:
    """The grpo pipeline (the main job unless --config/--set say otherwise) once per rl.j_max, same
    seeds: held-out pass rate, training time and trained tokens side by side."""
    import json

    _quiet()
    try:
        js = [int(v) for v in values.split(",") if v.strip()]
    except ValueError:
        raise click.UsageError(f"--values must be comma-separated integers, got {values!r}") from None
    if not js or min(js) < 0:
        raise click.UsageError(f"--values must be integers >= 0, got {values!r}")
    figures = _compare_runs({f"j_max={j}": [f"rl.j_max={j}"] for j in js}, config_path, overrides, out, 0)
    if json_path:
        Path(json_path).write_text(json.dumps(figures, indent=2) + "\n")
        console.print(f"figures written to {json_path}")


@bench.command("replay")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="JSON config file.")
@click.option("--set", "overrides", multiple=True, metavar="SECTION.FIELD=VALUE", help="Override a config field.")
@click.option("--repeats", type=click.IntRange(1), default=3, show_default=True, help="Replays of the run.")
@click.option("--out", type=click.Path(file_okay=False), default="storage/bench-replay", show_default=True,
              help="Parent directory of the run and its replays (emptied first).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write the figures as JSON here.")
def bench_replay(config_path, overrides, repeats, out, json_path) -> None:
    """Replay training tokens/s against training inside the online run (the main job unless
    --config/--set say otherwise), one cluster, one invocation."""
    import json
    import shutil

    from gyreflow.bench.replay import format_replay, run_bench
    from gyreflow.config import ConfigError, load_config

    _quiet()
    try:
        cfg = load_config(config_path, list(overrides))
    except ConfigError as err:
        raise click.UsageError(f"invalid config: {err}") from None
    shutil.rmtree(out, ignore_errors=True)
    result = run_bench(cfg, Path(out), repeats, cache_dir=Path("storage/sft-cache"), log=console.print)
    console.print(format_replay(result))
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2) + "\n")
        console.print(f"figures written to {json_path}")


@bench.command("migration")
@click.option("--context", type=int, default=2000, show_default=True, help="Tokens of the live generation moved.")
@click.option("--repeats", type=int, default=5, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write the figures as JSON here.")
def bench_migration(context, repeats, json_path) -> None:
    """Resuming a migrated live generation vs re-prefilling it on the destination (torch engine)."""
    from gyreflow.bench.migration import main as migration_main

    _quiet()
    if context < 64 or repeats < 1:
        raise click.UsageError("--context must be >= 64 and --repeats >= 1")
    migration_main(["--context", str(context), "--repeats", str(repeats), "--larger", "0",
                    *(["--json", json_path] if json_path else [])])


@bench.command("engine")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True, help="Interleaved rounds of every arm.")
@click.option("--executions", type=click.IntRange(min=1), default=96, show_default=True,
              help="Agent executions per round of the memory and tokens/s arms.")
@click.option("--long-tokens", type=click.IntRange(min=4096, max=131000), default=100_000, show_default=True,
              help="Prompt being prefilled while a short request waits for its first token.")
@click.option("--threads", type=click.IntRange(min=0), default=1, show_default=True,
              help="Torch intra-op threads (0: torch's default).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write the figures as JSON here.")
def bench_engine(repeats, executions, long_tokens, threads, json_path) -> None:
    """Paged KV cache vs one slot per request: memory, tokens/s, first token beside a long prefill, migration."""
    import json

    import torch

    from gyreflow.bench.engine import format_engine, run_engine_bench

    if threads:
        torch.set_num_threads(threads)
    out = run_engine_bench(repeats=repeats, executions=executions, long_tokens=long_tokens, log=console.print)
    console.print(format_engine(out))
    if json_path:
        Path(json_path).write_text(json.dumps(out, indent=1))
        console.print(f"figures written to {json_path}")


@bench.command("move-latency")
@click.option("--rounds", type=int, default=10, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write the figures as JSON here.")
def bench_move_latency(rounds, json_path) -> None:
    """From a move decision to a trainer task executing on the moved cell."""
    import json

    from gyreflow.bench.latency import run_latency_bench

    _quiet()
    if rounds < 1:
        raise click.UsageError("--rounds must be >= 1")
    out = run_latency_bench(rounds=rounds, log=console.print)
    med = out["move_to_task_median_s"]
    console.print(f"move decision -> trainer task executing on the moved cell: median "
                  f"{'-' if med is None else f'{med * 1000:.1f} ms'} over {out['measured']} moves "
                  f"(max {(out['move_to_task_max_s'] or 0) * 1000:.1f} ms); submit -> start on an idle trainer cell: "
                  f"{out['submit_to_start_median_s'] * 1000:.1f} ms")
    if json_path:
        Path(json_path).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
