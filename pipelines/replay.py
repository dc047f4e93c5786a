"""Train again from a run's trajectory archive, with another algorithm config, from your own Dask
client (trainer cells and an execution worker; no engine is used).

    python pipelines/replay.py tcp://127.0.0.1:8786 storage/runs/run-X --out storage/replays/r1 --set rl.j_max=1

``gyreflow replay`` runs the same recipe (``gyreflow.recipes.replay``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from distributed import Client

from gyreflow.recipes import replay
from gyreflow.storage import ArchiveReader


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scheduler", help="address of a running Dask scheduler")
    parser.add_argument("archive", help="an archive.zarr, or the run directory holding it")
    parser.add_argument("--out", required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    args = parser.parse_args()
    archive = replay.archive_of(args.archive)
    cfg = replay.replay_config(ArchiveReader(archive), args.overrides)
    with Client(args.scheduler) as client:
        report = replay.run(client, cfg, archive, Path(args.out))
    print(f"replayed {len(report['steps'])} steps, {report['trained_tokens']} trained tokens; "
          f"weights: {report['final']}")


if __name__ == "__main__":
    main()
