"""The zarr trajectory archive: round trips, commit visibility, concurrency, errors, no pickles."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import zarr

from gyreflow.storage import (
    ArchiveReader,
    ArchiveWriter,
    archive_path,
    commit_step,
    create_archive,
    execution_arrays,
    write_executions,
    open_datatree,
    write_execution,
)
from gyreflow.storage import schema
from gyreflow.trajectory.records import CallRecord, ExecutionResult


def make_execution(
    eid: str, step: int, n_calls: int = 4, seed: int = 0, split: str = "train"
) -> ExecutionResult:
    """A synthetic execution with ragged calls, including an empty completion."""
    rng = np.random.default_rng(seed)
    calls = []
    for i in range(n_calls):
        p = int(rng.integers(1, 300))
        c = 0 if i == 1 else int(rng.integers(1, 200))  # one call sampled nothing
        logprobs = -rng.exponential(2.0, c).astype(np.float32)
        if c:
            logprobs[0] = 0.0  # exact zero must not turn into a fill value / NaN
        calls.append(
            CallRecord(
                execution_id=eid,
                call_index=i,
                call_id=f"{eid}-call{i}",
                role="policy" if i % 3 else "summarizer",
                prompt_ids=rng.integers(0, 150_000, p),
                completion_ids=rng.integers(0, 150_000, c),
                logprobs=logprobs,
                versions=np.full(c, step - (i % 2), dtype=np.int32),
                finish_reason="length" if i == n_calls - 1 else "stop",
                engine=f"tcp://127.0.0.1:{9000 + i}",
                t_start=1.5 * i,
                t_end=1.5 * i + 0.25,
                temperature=(0.0, 0.7, 1.0)[i % 3],
                top_p=0.9 if i == 2 else 1.0,
            )
        )
    return ExecutionResult(
        execution_id=eid,
        task_id=f"task-{seed % 5}",
        step=step,
        sample=seed,
        split=split,
        calls=calls,
        reward=float(rng.random()),
        passed=bool(seed % 2),
        end_reason="time_limit" if seed % 3 == 0 else "done",
        metrics={"tool_calls": int(seed), "score_parts": [0.5, 0.25], "note": "ünïcode"},
        worker="tcp://10.0.0.1:4000",
    )


def assert_same(a: ExecutionResult, b: ExecutionResult) -> None:
    """Token-exact and bit-exact equality of two executions."""
    assert a.meta() == b.meta()
    assert len(a.calls) == len(b.calls)
    for x, y in zip(a.calls, b.calls):
        assert x.meta() == y.meta()
        for name in ("prompt_ids", "completion_ids", "versions"):
            u, v = getattr(x, name), getattr(y, name)
            assert u.dtype == v.dtype and np.array_equal(u, v), name
        assert y.logprobs.dtype == np.float32
        assert np.array_equal(x.logprobs.view(np.int32), y.logprobs.view(np.int32))


@pytest.fixture
def archive(tmp_path: Path) -> str:
    path = archive_path(tmp_path / "run")
    create_archive(path, {"config": {"lr": 1e-5, "j_max": 5}, "model": "tiny"})
    return str(path)


def test_round_trip_through_reader(archive: str) -> None:
    written = [make_execution(f"e{i}", 0, n_calls=i, seed=i) for i in range(4)]  # e0: no calls
    summaries = [write_execution(archive, r) for r in written]
    assert summaries[3]["n_calls"] == 3
    assert summaries[3]["n_completion_tokens"] == written[3].tokens_generated
    info = commit_step(archive, 0, {"loss": 0.125, "mean_reward": 0.5})
    assert info["n_executions"] == 4

    reader = ArchiveReader(archive)
    assert reader.committed_steps == [0]
    assert reader.executions(0) == ["e0", "e1", "e2", "e3"]
    assert reader.summary(0) == {"loss": 0.125, "mean_reward": 0.5}
    assert reader.run == {"config": {"lr": 1e-5, "j_max": 5}, "model": "tiny"}
    for r in written:
        assert_same(r, reader.load_execution(0, r.execution_id))
    assert [r.execution_id for r in reader.iter_executions()] == ["e0", "e1", "e2", "e3"]


def agent_execution(eid: str, step: int, n_calls: int = 12, seed: int = 0) -> ExecutionResult:
    """An agent's calls as they really come: each prompt is the previous call's prompt, its
    completion and a tool reply; a compaction restarts from the task; a retry repeats a prompt; a
    sub-agent starts from the task with its own instructions."""
    rng = np.random.default_rng(seed)
    task = rng.integers(0, 150_000, 60)
    context, calls = task, []

    def call(i, prompt, role="main", temperature=1.0):
        c = int(rng.integers(1, 40))
        calls.append(CallRecord(eid, i, f"{eid}/{i}", role, prompt, rng.integers(0, 150_000, c),
                                -rng.exponential(1.0, c).astype(np.float32), np.full(c, step, np.int32),
                                temperature=temperature))
        return np.concatenate([prompt, calls[-1].completion_ids])

    for i in range(n_calls):
        if i == n_calls // 2:  # compaction: the task and the latest tool reply only
            context = np.concatenate([task, rng.integers(0, 150_000, 10)])
        seq = call(i, context, temperature=0.0 if i == 3 else 1.0)
        if i == 2:  # the proxy folded a retry: the same prompt again
            call(100, context)
        context = np.concatenate([seq, rng.integers(0, 150_000, int(rng.integers(5, 30)))])
    call(200, np.concatenate([task, rng.integers(0, 150_000, 15)]), role="sub-agent")
    return ExecutionResult(eid, "task", step, seed, "train", calls, 0.5, False, "done")


def part(g, entry) -> dict[str, np.ndarray]:
    """One execution's arrays from a segment with plain zarr: its slice of each."""
    return {name: g[name][a:b] for name, (a, b) in entry["slices"].items()}


def decode_calls(g) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each call's (prompt, completion) from one execution's arrays (``part``) with plain numpy, as
    a reader without gyreflow would: walk the call's node up to the root, join the runs, cut at
    its lengths."""
    tokens, offsets, parent = g["tokens"], g["node_offsets"], g["node_parent"]
    out = []
    for raw in g["call_meta"]:
        m = json.loads(str(raw))
        node, runs = m["node"], []
        while node != -1:
            runs.insert(0, tokens[offsets[node] : offsets[node + 1]])
            node = parent[node]
        seq = np.concatenate(runs) if runs else np.zeros(0, np.int32)
        out.append((seq[: m["n_prompt"]], seq[m["n_prompt"] : m["n_prompt"] + m["n_completion"]]))
    return out


def test_round_trip_through_plain_zarr(archive: str) -> None:
    runs = [agent_execution("exec-a", 3, seed=7), agent_execution("exec-b", 3, seed=8)]
    write_executions(archive, runs, segment="group-a")
    commit_step(archive, 3, {"k": 1})

    root = zarr.open_group(archive, mode="r")
    assert root.attrs["gyreflow_archive"] == 3
    assert root.attrs["committed_steps"] == [3]
    g = root["steps/000003/segments/group-a"]
    assert g.attrs["gyreflow_segment"] == 3
    entries = g.attrs["executions"]
    assert [e["execution_id"] for e in entries] == ["exec-a", "exec-b"]
    # The segment's arrays are its executions' one after the other.
    for name in schema.TREE_ARRAYS:
        assert entries[0]["slices"][name][0] == 0 and entries[0]["slices"][name][1] == entries[1]["slices"][name][0]
        assert entries[1]["slices"][name][1] == g[name].shape[0]
    for r, entry in zip(runs, entries):
        mine = part(g, entry)
        calls = decode_calls(mine)
        metas = [json.loads(s) for s in mine["call_meta"]]
        at = 0
        for (prompt, completion), call, meta in zip(calls, r.calls, metas):
            assert np.array_equal(prompt, call.prompt_ids) and np.array_equal(completion, call.completion_ids)
            n = len(call.completion_ids)
            assert np.array_equal(mine["logprobs"][at : at + n], call.logprobs)
            assert np.array_equal(mine["versions"][at : at + n], call.versions)
            at += n
            assert {k: v for k, v in meta.items() if k not in ("node", "n_prompt", "n_completion")} == call.meta()
        assert at == len(mine["logprobs"]) and len(calls) == len(r.calls)
        assert entry["reward"] == r.reward and entry["metrics"] == r.metrics
        # Every token is stored once per place in the tree, not once per call that saw it.
        logical = sum(len(c.prompt_ids) + len(c.completion_ids) for c in r.calls)
        stored = len(mine["tokens"])
        assert entry["n_stored_tokens"] == stored and 3 * stored < logical, (stored, logical)
        assert entry["n_prompt_tokens"] + entry["n_completion_tokens"] == logical
    for name, (dtype, dim, _) in schema.TREE_ARRAYS.items():
        assert g[name].metadata.dimension_names == (dim,)


def test_schema_1_archives_still_open(tmp_path: Path) -> None:
    """``tests/data/archive-v1.zarr`` was written by the schema-1 writer (whole prompts per call)
    from ``make_execution`` with the seeds below; it reads token-exact, and a resumed run adds
    schema-2 groups beside the old ones."""
    import shutil

    path = tmp_path / "v1.zarr"
    shutil.copytree(Path(__file__).parent / "data" / "archive-v1.zarr", path)
    reader = ArchiveReader(path)
    assert reader.schema_version == 1 and reader.committed_steps == [0, 1]
    for step in (0, 1):
        for k in range(2):
            want = make_execution(f"execution-{step}-{k}", step, n_calls=3, seed=10 * step + k)
            assert_same(want, reader.load_execution(step, want.execution_id))
    with pytest.raises(ValueError, match="schema version 1; open it with ArchiveWriter"):
        write_execution(path, agent_execution("new", 2))
    writer = ArchiveWriter(path, {"resumed": True})
    new = agent_execution("new", 2)
    writer.write_execution(new)
    writer.commit_step(2)
    reader = ArchiveReader(path)
    assert reader.schema_version == 3 and reader.attrs["resumes"][-1]["upgraded_from"] == 1
    assert_same(new, reader.load_execution(2, "new"))
    assert_same(make_execution("execution-1-1", 1, n_calls=3, seed=11), reader.load_execution(1, "execution-1-1"))


def test_schema_2_archives_still_open(tmp_path: Path) -> None:
    """``tests/data/archive-v2.zarr`` was written by the schema-2 writer (one group per execution,
    its call tree) from the executions below; it reads token-exact, and a resumed run adds
    segments beside the old groups, all in one xarray view."""
    import shutil

    path = tmp_path / "v2.zarr"
    shutil.copytree(Path(__file__).parent / "data" / "archive-v2.zarr", path)
    reader = ArchiveReader(path)
    assert reader.schema_version == 2 and reader.committed_steps == [0, 1]

    def want(step: int) -> list[ExecutionResult]:
        return [*(make_execution(f"execution-{step}-{k}", step, n_calls=3, seed=10 * step + k) for k in range(2)),
                agent_execution(f"agent-{step}", step)]

    for step in (0, 1):
        for r in want(step):
            assert_same(r, reader.load_execution(step, r.execution_id))
    writer = ArchiveWriter(path, {"resumed": True})
    new = [agent_execution("new-a", 2, seed=1), agent_execution("new-b", 2, seed=2)]
    writer.write_executions(new, segment="group")
    writer.commit_step(2)
    reader = ArchiveReader(path)
    assert reader.schema_version == 3 and reader.attrs["resumes"][-1]["upgraded_from"] == 2
    for r in [*want(1), *new]:
        assert_same(r, reader.load_execution(r.step, r.execution_id))
    tree = reader.to_xarray()
    assert sorted(tree["steps/000001/executions"].children) == ["agent-1", "execution-1-0", "execution-1-1"]
    assert list(tree["steps/000002/segments"].children) == ["group"]


def test_bad_segment_writes_are_refused(archive: str) -> None:
    with pytest.raises(ValueError, match="no executions"):
        write_executions(archive, [])
    with pytest.raises(ValueError, match="steps \\[0, 1\\]"):
        write_executions(archive, [make_execution("a", 0), make_execution("b", 1)])
    with pytest.raises(ValueError, match="repeat: \\['a'\\]"):
        write_executions(archive, [make_execution("a", 0), make_execution("a", 0, seed=2)])
    with pytest.raises(ValueError, match="cannot be used as a zarr group name"):
        write_executions(archive, [make_execution("a", 0)], segment="x/y")
    # One execution in two segments: the step cannot be committed until one goes.
    write_executions(archive, [make_execution("a", 0), make_execution("b", 0)], segment="first")
    write_execution(archive, make_execution("a", 0, seed=5))
    with pytest.raises(ValueError, match="execution 'a' is written twice"):
        commit_step(archive, 0)


def test_trees_built_for_training_are_stored_as_they_are(archive: str) -> None:
    """Given the trajectory trees the pipeline built, a segment stores the same arrays as one that
    builds them; a tree of other calls is not used."""
    from dataclasses import replace

    from gyreflow.trajectory.tree import build_tree

    runs = [agent_execution(f"t{i}", 0, seed=i) for i in range(3)]
    write_executions(archive, runs, segment="given", trees=[build_tree(r) for r in runs])
    write_executions(archive, [replace(r, step=1) for r in runs], segment="built")
    other = replace(agent_execution("t0", 2, seed=9), step=2)
    write_executions(archive, [other], trees=[build_tree(runs[0])])  # same id, other calls
    for step in (0, 1, 2):
        commit_step(archive, step)
    root = zarr.open_group(archive, mode="r")
    for name in schema.TREE_ARRAYS:
        given, built = root[f"steps/000000/segments/given/{name}"][:], root[f"steps/000001/segments/built/{name}"][:]
        assert [str(x) for x in given] == [str(x) for x in built], name
    reader = ArchiveReader(archive)
    for r in runs:
        assert_same(r, reader.load_execution(0, r.execution_id))
    assert_same(other, reader.load_execution(2, "t0"))
    with pytest.raises(ValueError, match="2 trees for 3 executions"):
        write_executions(archive, [replace(r, step=3) for r in runs], trees=[build_tree(r) for r in runs[:2]])


def test_a_damaged_tree_is_named_not_misread(archive: str) -> None:
    write_execution(archive, agent_execution("d", 0))
    commit_step(archive, 0)
    g = zarr.open_group(archive, mode="r+")["steps/000000/segments/d"]
    parent = g["node_parent"][:]
    parent[-1] = len(parent) + 5  # a node pointing outside the tree
    g["node_parent"][:] = parent
    with pytest.raises(ValueError, match="execution group .*d.* is corrupt"):
        ArchiveReader(archive).load_execution(0, "d")


def test_arrays_of_several_chunks_round_trip(archive: str, monkeypatch) -> None:
    """An execution longer than a chunk (edge chunks padded, as the regular grid stores them) reads
    back exactly, through the reader and through plain zarr."""
    monkeypatch.setattr(schema, "CHUNK_ELEMENTS", 7)
    r = agent_execution("long", 0)
    write_execution(archive, r)
    commit_step(archive, 0)
    assert_same(ArchiveReader(archive).load_execution(0, "long"), r)
    g = zarr.open_group(archive, mode="r")["steps/000000/segments/long"]
    assert g["tokens"].nchunks > 2 and len(g["tokens"][:]) % 7 != 0
    stored = execution_arrays(r)
    for name in schema.TREE_ARRAYS:
        assert [str(x) for x in g[name][:]] == [str(x) for x in stored[name]], name


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_damaged_chunk_is_named(archive: str, damage: str) -> None:
    write_execution(archive, agent_execution("d", 0))
    commit_step(archive, 0)
    chunk = Path(archive) / "steps/000000/segments/d/logprobs/0"
    if damage == "missing":
        chunk.unlink()
    else:
        chunk.write_bytes(chunk.read_bytes()[:20])
    with pytest.raises(ValueError, match="logprobs/0"):
        ArchiveReader(archive).load_execution(0, "d")


def test_readable_without_gyreflow(archive: str) -> None:
    """A fresh interpreter reads the archive with zarr and xarray only; gyreflow never loads."""
    r = make_execution("e1", 0, n_calls=5, seed=3)
    write_execution(archive, r)
    commit_step(archive, 0)
    script = textwrap.dedent(
        f"""
        import json, sys
        import numpy as np, xarray as xr, zarr
        root = zarr.open_group({archive!r}, mode="r")
        g = root["steps/000000/segments/e1"]
        (entry,) = g.attrs["executions"]
        part = {{name: g[name][a:b] for name, (a, b) in entry["slices"].items()}}
        tokens, offsets, parent = part["tokens"], part["node_offsets"], part["node_parent"]
        calls = []
        for raw in part["call_meta"]:
            m = json.loads(str(raw))
            node, seq = m["node"], []
            while node != -1:
                seq = tokens[offsets[node]:offsets[node + 1]].tolist() + seq
                node = int(parent[node])
            calls.append(seq[m["n_prompt"]:m["n_prompt"] + m["n_completion"]])
        tree = xr.open_datatree({archive!r}, engine="zarr", consolidated=False)
        ds = tree["steps/000000/segments/e1"].to_dataset()
        assert np.array_equal(ds["tokens"].values, g["tokens"][:])
        assert ds["logprobs"].dtype == np.float32
        assert "gyreflow" not in sys.modules
        print(json.dumps({{"calls": calls, "lp0": float(ds["logprobs"].values[0]),
                          "committed": root.attrs["committed_steps"]}}))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd="/"
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["calls"] == [c.completion_ids.tolist() for c in r.calls]
    assert got["lp0"] == 0.0
    assert got["committed"] == [0]


def test_xarray_datatree(archive: str) -> None:
    runs = [make_execution(f"e{i}", 1, n_calls=3, seed=i) for i in range(3)]
    write_executions(archive, runs[:2], segment="first-two")
    write_execution(archive, runs[2])
    commit_step(archive, 1, {"loss": 2.0})
    tree = ArchiveReader(archive).to_xarray(chunks={})
    assert tree.attrs["committed_steps"] == [1]
    assert tree["steps/000001"].attrs["summary"] == {"loss": 2.0}
    assert sorted(tree["steps/000001/segments"].children) == ["e2", "first-two"]
    for seg, held in (("first-two", runs[:2]), ("e2", runs[2:])):
        ds = tree[f"steps/000001/segments/{seg}"].to_dataset()
        lp = ds["logprobs"].values  # computed from lazy dask arrays
        for r, entry in zip(held, ds.attrs["executions"]):
            assert entry["execution_id"] == r.execution_id and entry["reward"] == r.reward
            a, b = entry["slices"]["logprobs"]
            assert np.array_equal(lp[a:b], np.concatenate([c.logprobs for c in r.calls]))
        assert ds.sizes["call"] == 3 * len(held) and ds.sizes["node_boundary"] == ds.sizes["node"] + len(held)


def test_uncommitted_steps_are_invisible(archive: str) -> None:
    write_execution(archive, make_execution("a", 0, seed=1))
    commit_step(archive, 0)
    write_execution(archive, make_execution("b", 1, seed=2))  # step 1: written, not committed
    # A killed writer leaves a group not marked complete inside a step that does get committed.
    write_execution(archive, make_execution("c", 2, seed=3))
    zarr.open_group(archive, mode="r+").create_group(
        "steps/000002/segments/killed", attributes={"gyreflow_segment": 3, "complete": False}
    )
    commit_step(archive, 2)

    reader = ArchiveReader(archive)
    assert reader.committed_steps == [0, 2]
    assert reader.executions(2) == ["c"]
    with pytest.raises(ValueError, match=r"step 1 .*not committed"):
        reader.executions(1)
    with pytest.raises(ValueError, match="step 1"):
        reader.load_execution(1, "b")
    with pytest.raises(ValueError, match="killed"):
        reader.load_execution(2, "killed")
    assert [r.execution_id for r in reader.iter_executions()] == ["a", "c"]
    tree = open_datatree(archive)
    assert sorted(tree["steps"].children) == ["000000", "000002"]
    assert list(tree["steps/000002/segments"].children) == ["c"]


def test_reopen_discards_partial_step_and_rolls_forward(archive: str) -> None:
    write_execution(archive, make_execution("a", 0, seed=1))
    commit_step(archive, 0)
    write_execution(archive, make_execution("stale", 1, seed=2))  # crash mid-step 1

    writer = ArchiveWriter.open(archive)
    assert writer.recovered == {"rolled_forward": [], "discarded": [1]}
    assert "000001" not in zarr.open_group(archive, mode="r")["steps"]
    fresh = make_execution("fresh", 1, seed=5)
    writer.write_execution(fresh)
    writer.commit_step(1, {"resumed": True}, expected=["fresh"])
    reader = ArchiveReader(archive)
    assert reader.committed_steps == [0, 1] and reader.executions(1) == ["fresh"]
    assert_same(fresh, reader.load_execution(1, "fresh"))
    assert_same(make_execution("a", 0, seed=1), reader.load_execution(0, "a"))

    # Crash between the step's attributes and the root commit marker: complete, so rolled forward.
    write_execution(archive, make_execution("x", 2, seed=6))
    zarr.open_group(archive, mode="r+")["steps/000002"].attrs.update(
        {"committed": True, "executions": {"x": {"split": "train"}}}
    )
    assert ArchiveReader(archive).committed_steps == [0, 1]
    assert ArchiveWriter(archive, {"note": "resumed"}).recovered["rolled_forward"] == [2]
    reader = ArchiveReader(archive)
    assert reader.committed_steps == [0, 1, 2]
    assert reader.attrs["resumes"][-1]["run"] == {"note": "resumed"}


def test_retry_replaces_and_committed_steps_are_immutable(archive: str) -> None:
    write_execution(archive, make_execution("e", 0, n_calls=9, seed=1))
    second = make_execution("e", 0, n_calls=2, seed=2)  # a retried task writes again
    write_execution(archive, second)
    with pytest.raises(ValueError, match=r"\['missing'\]"):
        commit_step(archive, 0, expected=["e", "missing"])
    commit_step(archive, 0, expected=["e"])
    assert_same(second, ArchiveReader(archive).load_execution(0, "e"))
    with pytest.raises(ValueError, match="already committed"):
        commit_step(archive, 0)
    with pytest.raises(ValueError, match="step 0 .* is committed"):
        write_execution(archive, make_execution("late", 0, seed=3))

    # A retry with fewer tokens leaves no chunk of the earlier attempt behind.
    write_execution(archive, make_execution("z", 1, n_calls=5, seed=4))
    empty = make_execution("z", 1, n_calls=0, seed=4)
    write_execution(archive, empty)
    group_dir = Path(archive) / "steps/000001/segments/z"
    chunks = {f.relative_to(group_dir).as_posix() for f in group_dir.rglob("*") if f.name != "zarr.json" and f.is_file()}
    assert chunks == {"node_offsets/0"}  # offsets == [0]
    commit_step(archive, 1)
    assert_same(empty, ArchiveReader(archive).load_execution(1, "z"))


def test_concurrent_thread_writes_lose_nothing(archive: str) -> None:
    runs = [make_execution(f"t{i:03d}", 4, n_calls=5, seed=i) for i in range(48)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        summaries = list(pool.map(lambda r: write_execution(archive, r), runs))
    assert len({s["execution_id"] for s in summaries}) == 48
    info = commit_step(archive, 4, expected=[r.execution_id for r in runs])
    assert info["n_completion_tokens"] == sum(r.tokens_generated for r in runs)
    reader = ArchiveReader(archive)
    assert len(reader.executions(4)) == 48
    for r in runs:
        assert_same(r, reader.load_execution(4, r.execution_id))


def test_dask_worker_processes_write_one_step(archive: str) -> None:
    distributed = pytest.importorskip("distributed")
    runs = [make_execution(f"d{i:02d}", 0, n_calls=4, seed=i) for i in range(20)]
    with distributed.LocalCluster(
        n_workers=2, threads_per_worker=2, processes=True, dashboard_address=None
    ) as cluster, distributed.Client(cluster) as client:
        futures = [client.submit(write_execution, archive, r, pure=False) for r in runs]
        summaries = client.gather(futures)
    assert sorted(s["execution_id"] for s in summaries) == [r.execution_id for r in runs]
    commit_step(archive, 0, {"n": 20}, expected=[s["execution_id"] for s in summaries])
    reader = ArchiveReader(archive)
    assert reader.executions(0) == [r.execution_id for r in runs]
    for r in runs:
        assert_same(r, reader.load_execution(0, r.execution_id))


def test_clear_errors(tmp_path: Path, archive: str) -> None:
    missing = tmp_path / "nope.zarr"
    with pytest.raises(FileNotFoundError, match="nope.zarr"):
        ArchiveReader(missing)
    with pytest.raises(FileNotFoundError, match="nope.zarr"):
        ArchiveWriter.open(missing)
    with pytest.raises(FileNotFoundError, match="nope.zarr"):
        write_execution(missing, make_execution("e", 0))

    plain = tmp_path / "plain.zarr"
    zarr.open_group(plain, mode="w")
    with pytest.raises(ValueError, match="plain.zarr.*not a gyreflow archive"):
        ArchiveReader(plain)
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "file.txt").write_text("hello")
    with pytest.raises(ValueError, match="junk"):
        ArchiveReader(junk)
    with pytest.raises(ValueError, match="junk"):
        ArchiveWriter(junk)

    newer = tmp_path / "newer.zarr"
    zarr.open_group(newer, mode="w", attributes={"gyreflow_archive": 99})
    with pytest.raises(ValueError, match="newer.zarr.*version 99"):
        ArchiveReader(newer)

    with pytest.raises(FileExistsError, match="archive.zarr"):
        create_archive(archive, {})
    reader = ArchiveReader(archive)
    with pytest.raises(ValueError, match=r"step 7 .*does not exist"):
        reader.load_execution(7, "e")
    with pytest.raises(ValueError, match="group name"):
        write_execution(archive, make_execution("a/b", 0))
    with pytest.raises(ValueError, match="non-negative"):
        write_execution(archive, make_execution("a", -1))


def test_nan_reward_and_numpy_metrics_round_trip(archive: str) -> None:
    r = make_execution("n", 0, seed=2)
    r.reward = math.nan
    r.metrics = {"np_float": np.float32(0.5), "np_int": np.int64(3), "arr": np.arange(3)}
    write_execution(archive, r)
    commit_step(archive, 0, {"mean": np.float64(1.0)})
    got = ArchiveReader(archive).load_execution(0, "n")
    assert math.isnan(got.reward)
    assert got.metrics == {"np_float": 0.5, "np_int": 3, "arr": [0, 1, 2]}


def test_nothing_but_arrays_and_json(archive: str) -> None:
    """No object dtypes, no pickle codec, only zarr.json metadata and chunk files on disk."""
    for i in range(3):
        write_execution(archive, make_execution(f"e{i}", 0, seed=i))
    commit_step(archive, 0, {"ok": True})
    root = zarr.open_group(archive, mode="r")
    allowed = {"int32", "int64", "float32"}
    n_arrays = 0
    stack = [root]
    while stack:
        g = stack.pop()
        json.dumps(dict(g.attrs), allow_nan=True)  # attributes are plain JSON
        for _, a in g.arrays():
            n_arrays += 1
            data = a[:]
            assert data.dtype.kind != "O"
            assert str(a.dtype) in allowed or isinstance(a.dtype, np.dtypes.StringDType)
            json.dumps(dict(a.attrs))
        stack.extend(child for _, child in g.groups())
    assert n_arrays == 3 * len(schema.TREE_ARRAYS)
    codecs: set[str] = set()
    for f in Path(archive).rglob("*"):
        if f.is_file():
            assert f.name == "zarr.json" or (f.name.isdigit() and f.parent.name in schema.TREE_ARRAYS), f
            if f.name == "zarr.json":
                meta = json.loads(f.read_text())
                codecs |= {c["name"] for c in meta.get("codecs", [])}
    assert "pickle" not in " ".join(codecs).lower()
    assert codecs <= {"bytes", "blosc", "vlen-utf8", "zstd"}, codecs


def test_chunks_are_the_bytes_zarr_writes(archive: str) -> None:
    """The writer encodes chunks itself: zarr, re-writing each array's data through its own
    codec pipeline (from the stored metadata), produces the same bytes."""
    write_execution(archive, agent_execution("b", 0))
    group_dir = Path(archive) / "steps/000000/segments/b"
    ours = {f.relative_to(group_dir).as_posix(): f.read_bytes() for f in group_dir.rglob("*")
            if f.is_file() and f.name != "zarr.json"}
    assert {k.split("/")[0] for k in ours} == set(schema.TREE_ARRAYS)
    g = zarr.open_group(archive, mode="r+")["steps/000000/segments/b"]
    for name in schema.TREE_ARRAYS:
        g[name][:] = g[name][:]
    theirs = {f.relative_to(group_dir).as_posix(): f.read_bytes() for f in group_dir.rglob("*")
              if f.is_file() and f.name != "zarr.json"}
    assert ours == theirs


def test_call_documents_are_the_json_of_the_call_s_meta() -> None:
    """The field-by-field call document parses to what the generic JSON of ``CallRecord.meta``
    holds (a second implementation), for awkward strings and non-finite floats too."""
    odd = ['plain', 'quote " and \\ backslash', "new\nline\ttab", "ünïcödé ✓", "\x00\x1f", "},{"]
    for i, text in enumerate(odd):
        c = CallRecord(text, i, f"id-{text}", text, np.array([1, 2]), np.array([3]), np.array([-0.5], np.float32),
                       np.array([1], np.int32), finish_reason=text, engine=text, t_start=float("nan") if i == 1 else 1.5e9 + i,
                       t_end=float("inf") if i == 2 else 1e-7, temperature=0.7, top_p=1.0)
        got = json.loads(schema.call_document(c, i - 1, 2, 1))
        want = json.loads(schema.dumps(c.meta() | {"node": i - 1, "n_prompt": 2, "n_completion": 1}))
        assert got.keys() == want.keys()
        for k in want:
            assert got[k] == want[k] or (isinstance(want[k], float) and math.isnan(want[k]) and math.isnan(got[k])), k
