"""GRPO on the vault tasks (or a task suite), submitted from your own Dask client.

    python pipelines/grpo.py tcp://127.0.0.1:8786 --set rl.steps=4

``gyreflow run`` runs the same recipe (``gyreflow.recipes.grpo``) on an embedded cluster or on
``--scheduler``; copy this file to change what a run does around it.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from distributed import Client

from gyreflow.config import load_config
from gyreflow.recipes import grpo

run = grpo.run  # what ``gyreflow run --pipeline grpo`` calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scheduler", help="address of a running Dask scheduler")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    parser.add_argument("--out", default=time.strftime("storage/runs/run-%Y%m%d-%H%M%S"))
    args = parser.parse_args()
    cfg = load_config(None, args.overrides)
    run_dir = Path(args.out)
    run_dir.mkdir(parents=True, exist_ok=False)
    with Client(args.scheduler) as client:
        print(f"dashboard: {client.dashboard_link}")
        report = grpo.run(client, cfg, run_dir)
    print(f"held-out pass rate {report['initial_heldout_pass_rate']:.3f} -> "
          f"{report['steps'][-1]['heldout_pass_rate']:.3f}; report: {run_dir / 'report.json'}")


if __name__ == "__main__":
    main()
