# %% [markdown]
# # gyreflow from your own Dask client
#
# Start a cluster with the Dask command line (see the README, "Any Dask cluster"), then run these
# cells in a notebook, or the whole file as a script:
#
#     python examples/client/notebook.py tcp://127.0.0.1:8786 --set rl.steps=4
#
# A run is plain Dask futures: watch them on the dashboard's task stream and on its gyreflow page.

# %%
import argparse
import sys
import time
from pathlib import Path

from distributed import Client

from gyreflow.cluster.dashboard import dashboard_link
from gyreflow.config import load_config
from gyreflow.recipes import grpo, replay
from gyreflow.storage import ArchiveReader

parser = argparse.ArgumentParser()
parser.add_argument("scheduler", nargs="?", default="tcp://127.0.0.1:8786")
parser.add_argument("--out", default=time.strftime("storage/runs/client-%Y%m%d-%H%M%S"))
parser.add_argument("--set", dest="overrides", action="append", default=[])
args = parser.parse_args(sys.argv[1:] if __name__ == "__main__" else [])

# %% Connect, and see where to watch.
client = Client(args.scheduler)
print("dashboard:", client.dashboard_link)
print("gyreflow page (cells by role, executions, moves):", dashboard_link(client))

# %% Submit a run: the cluster's cells and execution workers do the work; this process only waits.
cfg = load_config(None, ["cluster.rollout_workers=2", "cluster.trainer_workers=1", *args.overrides])
run_dir = Path(args.out)
report = grpo.run(client, cfg, run_dir)
print(f"held-out pass rate {report['initial_heldout_pass_rate']:.3f} -> {report['steps'][-1]['heldout_pass_rate']:.3f}")

# %% What the archive holds, step by step (the trajectories every later experiment can reuse).
reader = ArchiveReader(report["archive"])
for step in reader.committed_steps:
    info = reader.step_info(step)
    print(f"step {step}: {info['n_executions']} executions, {info['n_calls']} calls, "
          f"{info['n_completion_tokens']} generated tokens, mean reward {info['summary']['mean_reward']:.3f}")

# %% Train again from those trajectories with another J_max: no rollout, trainer cells only.
other = replay.replay_config(reader, ["rl.j_max=1"])
replayed = replay.run(client, other, report["archive"], run_dir.with_name(run_dir.name + "-jmax1"))
print(f"replayed {len(replayed['steps'])} steps at J_max 1: {replayed['trained_tokens']} trained tokens; "
      f"weights in {replayed['final']}")
client.close()
