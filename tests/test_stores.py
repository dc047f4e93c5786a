"""Archives on stores that are not the local filesystem: fsspec's in-memory filesystem, and an S3
object store (a moto server on loopback, reached through s3fs) that a whole run writes to."""

from __future__ import annotations

import logging
import os
import uuid

import numpy as np
import pytest
import zarr
from distributed import Client
from test_archive import assert_same, make_execution
from test_cli import invoke

from gyreflow.cluster.local import PoolSpec, local_cluster
from gyreflow.config import load_config
from gyreflow.recipes import grpo, replay
from gyreflow.storage import ArchiveReader, ArchiveWriter, commit_step, create_archive, write_executions
from gyreflow.storage.verify import ArchiveDamaged, verify


@pytest.fixture(scope="module")
def s3():
    """A local S3 server; the AWS variables point every process started from here (the cluster's
    workers too) at it."""
    pytest.importorskip("s3fs")
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://{host}:{port}"}
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    s3fs.S3FileSystem().mkdir("gyreflow")
    yield "s3://gyreflow"
    for k, v in before.items():
        os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    server.stop()


@pytest.fixture(params=["memory", "s3"])
def base(request):
    if request.param == "memory":
        return f"memory://gyreflow-{uuid.uuid4().hex[:8]}"
    return request.getfixturevalue("s3")


def test_write_commit_recover_read_verify(base):
    url = f"{base}/run-{uuid.uuid4().hex[:6]}/archive.zarr"
    create_archive(url, {"config": {"rl": {"j_max": 5}}})
    written = [make_execution(f"ex-{i}", 0, n_calls=3, seed=i) for i in range(3)]
    write_executions(url, written[:2], "group-0000")
    write_executions(url, written[2:], "group-0001")
    commit_step(url, 0, {"mean_reward": 0.5})
    write_executions(url, [make_execution("late", 1)], "group-0000")  # step 1 never committed
    with pytest.raises(FileExistsError):
        create_archive(url)
    writer = ArchiveWriter.open(url)
    assert writer.recovered == {"rolled_forward": [], "discarded": [1]} and writer.committed_steps == [0]
    reader = ArchiveReader(url)
    assert reader.committed_steps == [0] and reader.run["config"]["rl"]["j_max"] == 5
    for ex in written:
        assert_same(ex, reader.load_execution(0, ex.execution_id))
    v = verify(url)
    assert v.steps == [0] and v.executions == 3
    assert invoke("inspect", "--verify", url).returncode == 0
    if base.startswith("s3://"):  # plain zarr reads the same hierarchy from the object store
        root = zarr.open_group(url, mode="r")
        assert list(root.attrs["committed_steps"]) == [0]
        seg = root["steps/000000/segments/group-0000"]
        entry = next(e for e in seg.attrs["executions"] if e["execution_id"] == "ex-1")
        a, b = entry["slices"]["logprobs"]
        assert np.array_equal(seg["logprobs"][a:b], np.concatenate([c.logprobs for c in written[1].calls]))


def test_damage_on_an_object_store_is_named(s3):
    import s3fs

    url = f"{s3}/damaged-{uuid.uuid4().hex[:6]}/archive.zarr"
    create_archive(url)
    write_executions(url, [make_execution("a", 0)], "group-0000")
    commit_step(url, 0)
    s3fs.S3FileSystem().rm(f"{url.removeprefix('s3://')}/steps/000000/segments/group-0000/tokens/0")
    with pytest.raises(ArchiveDamaged, match="tokens/0 is missing"):
        verify(url)


def test_a_run_writes_its_archive_to_an_object_store_and_replays_from_it(s3, tmp_path, tiny_overrides):
    cfg = load_config(None, tiny_overrides + [f"storage.archive={s3}/{{run}}/archive.zarr"])
    run_dir = tmp_path / "objrun"
    with local_cluster(PoolSpec(rollout=1, trainer=1, execution_slots=8)) as cluster, Client(cluster) as client:
        report = grpo.run(client, cfg, run_dir, log=lambda *_: None)
        again = replay.run(client, cfg, run_dir, tmp_path / "replay", log=lambda *_: None)
    url = f"{s3}/objrun/archive.zarr"
    assert report["archive"] == url and not (run_dir / "archive.zarr").exists()
    reader = ArchiveReader(url)
    assert reader.committed_steps == [0, 1]
    n = cfg.rl.tasks_per_step * cfg.rl.samples_per_task
    assert all(sum(e.startswith("execution-") for e in reader.executions(s)) == n for s in (0, 1))
    assert invoke("inspect", "--verify", str(run_dir)).returncode == 0  # the run directory names its archive
    assert [s["step"] for s in again["steps"]] == [0, 1] and again["archive"] == url
