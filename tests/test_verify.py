"""``gyreflow inspect`` and ``inspect --verify`` on sound and damaged archives; checkpoints hold no pickle."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
from test_archive import make_execution
from test_cli import invoke

from gyreflow.storage import ArchiveReader, commit_step, create_archive, write_executions
from gyreflow.storage.verify import ArchiveDamaged, verify


@pytest.fixture
def archive(tmp_path: Path) -> Path:
    path = tmp_path / "run" / "archive.zarr"
    create_archive(path, {"config": {}})
    for step in (0, 1):
        train = [make_execution(f"ex-{step}-{i}", step, n_calls=3 + i, seed=i) for i in range(4)]
        write_executions(path, train[:2], "group-0000")
        write_executions(path, train[2:], "group-0001")
        write_executions(path, [make_execution(f"eval-{step}", step, seed=7, split="heldout")], "eval")
        commit_step(path, step, {"mean_reward": 0.5})
    return path


def segment(archive: Path, step: int = 1, name: str = "group-0001") -> Path:
    return archive / "steps" / f"{step:06d}" / "segments" / name


def test_a_sound_archive_verifies_with_its_counts(archive):
    v = verify(archive)
    reader = ArchiveReader(archive)
    calls = sum(len(reader.load_execution(s, e).calls) for s in (0, 1) for e in reader.executions(s))
    assert v.steps == [0, 1] and v.executions == 10 and v.calls == calls
    p = invoke("inspect", "--verify", str(archive))
    assert p.returncode == 0 and "ok:" in p.stdout and "10 executions" in p.stdout
    p = invoke("inspect", "--verify", str(archive.parent))  # the run directory names its archive
    assert p.returncode == 0


def test_inspect_summarises_steps_and_writes_plots(archive, tmp_path):
    p = invoke("inspect", str(archive), "--plots", str(tmp_path / "plots"))
    assert p.returncode == 0, p.stdout
    lines = [line for line in p.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert len(lines) == 2  # one row per committed step
    # Executions 0..3 of make_execution: seeds 0 and 3 end on time_limit, 1 and 2 done.
    assert "done 2" in lines[0] and "time_limit 2" in lines[0]
    for name in ("reward.png", "pass_rate.png", "tokens.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def damage_missing_chunk(archive: Path) -> str:
    (segment(archive) / "tokens" / "0").unlink()
    return "chunk tokens/0 is missing"


def damage_truncated_chunk(archive: Path) -> str:
    chunk = segment(archive) / "logprobs" / "0"
    chunk.write_bytes(chunk.read_bytes()[:10])
    return "does not decode"


def damage_future_schema(archive: Path) -> str:
    doc = json.loads((archive / "zarr.json").read_text())
    doc["attributes"]["gyreflow_archive"] = 99
    (archive / "zarr.json").write_text(json.dumps(doc))
    return "schema version 99"


def damage_missing_segment(archive: Path) -> str:
    import shutil

    shutil.rmtree(segment(archive, 0, "eval"))
    return "missing"


def damage_index_count(archive: Path) -> str:
    doc_path = archive / "steps" / "000001" / "zarr.json"
    doc = json.loads(doc_path.read_text())
    doc["attributes"]["executions"]["ex-1-2"]["n_calls"] += 1
    doc_path.write_text(json.dumps(doc))
    return "n_calls"


def damage_slices(archive: Path) -> str:
    doc_path = segment(archive) / "zarr.json"
    doc = json.loads(doc_path.read_text())
    doc["attributes"]["executions"][1]["slices"]["tokens"][0] += 1
    doc_path.write_text(json.dumps(doc))
    return "tokens"


def damage_pickle(archive: Path) -> str:
    (segment(archive) / "extra.pkl").write_bytes(pickle.dumps({"a": np.arange(3)}))
    return "pickle"


def damage_pickle_codec(archive: Path) -> str:
    doc_path = segment(archive) / "call_meta" / "zarr.json"
    doc = json.loads(doc_path.read_text())
    doc["codecs"] = [{"name": "numcodecs.pickle", "configuration": {}}]
    doc_path.write_text(json.dumps(doc))
    return "numcodecs.pickle"


def damage_committed_list(archive: Path) -> str:
    doc = json.loads((archive / "zarr.json").read_text())
    doc["attributes"]["committed_steps"] = [0, 1, 2]
    (archive / "zarr.json").write_text(json.dumps(doc))
    return "step 2"


@pytest.mark.parametrize("damage", [damage_missing_chunk, damage_truncated_chunk, damage_future_schema,
                                    damage_missing_segment, damage_index_count, damage_slices, damage_pickle,
                                    damage_pickle_codec, damage_committed_list])
def test_damage_is_named_and_exits_non_zero(archive, damage):
    what = damage(archive)
    with pytest.raises(ArchiveDamaged, match=None) as err:
        verify(archive)
    assert what in str(err.value)
    p = invoke("inspect", "--verify", str(archive))
    assert p.returncode == 1 and "damaged" in p.stdout and what in p.stdout


def test_what_is_not_an_archive_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    p = invoke("inspect", "--verify", str(tmp_path / "empty"))
    assert p.returncode == 1 and "not a zarr v3 group" in p.stdout
    p = invoke("inspect", str(tmp_path / "empty"))
    assert p.returncode == 2 and "not a zarr v3 group" in p.stdout
    p = invoke("inspect", "--verify", str(tmp_path / "nowhere"))
    assert p.returncode == 2 and "does not exist" in p.stderr
