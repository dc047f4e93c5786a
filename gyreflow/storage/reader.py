"""Reading a trajectory archive: committed steps only, arrays and JSON only (no code runs)."""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import fields
from typing import Any

import numpy as np
import zarr
import zarr.api.asynchronous
from zarr.core.sync import sync

from gyreflow.storage import files, schema
from gyreflow.storage.calltree import CallTree
from gyreflow.storage.stores import open_store
from gyreflow.storage.writer import PathLike, root_attributes
from gyreflow.trajectory.records import CallRecord, ExecutionResult

_CALL_FIELDS = {f.name for f in fields(CallRecord)} - {
    "prompt_ids",
    "completion_ids",
    "logprobs",
    "versions",
}


SEGMENT_CACHE_BYTES = 256 << 20
"""Decoded segments an :class:`ArchiveReader` keeps (least recently used first out; at least one)."""


def split_ragged(flat: np.ndarray, offsets: np.ndarray) -> list[np.ndarray]:
    """Cut a flat array into per-call views using ``n + 1`` offsets."""
    return [flat[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]


class ArchiveReader:
    """Read-only view of a run's archive that sees committed steps only.

    The list of committed steps is read once at construction (a consistent snapshot); call
    ``refresh`` to see steps committed since.

    Parameters
    ----------
    path
        The ``archive.zarr`` directory.

    Raises
    ------
    FileNotFoundError
        If nothing exists at ``path``.
    ValueError
        If ``path`` is not a gyreflow archive or was written by a newer schema version.
    """

    def __init__(self, path: PathLike) -> None:
        self.path = str(path)
        self._attrs: dict[str, Any] = root_attributes(self.path)
        self.store = open_store(self.path)
        self._steps: dict[int, dict[str, Any]] = {}
        self._segments: OrderedDict[tuple[int, str], tuple[dict, dict]] = OrderedDict()
        self._cached = 0

    def refresh(self) -> None:
        """Re-read the root attributes (new commits, run metadata)."""
        self._attrs = root_attributes(self.path)

    @property
    def schema_version(self) -> int:
        return int(self._attrs[schema.ROOT_MARKER])

    @property
    def run(self) -> dict[str, Any]:
        """Run-level JSON stored at creation (config and the like)."""
        return dict(self._attrs.get("run", {}))

    @property
    def attrs(self) -> dict[str, Any]:
        """All root attributes."""
        return dict(self._attrs)

    @property
    def committed_steps(self) -> list[int]:
        """Committed steps, ascending."""
        return sorted(int(s) for s in self._attrs.get("committed_steps", []))

    def step_info(self, step: int) -> dict[str, Any]:
        """All attributes of a committed step: counts, execution index, summary.

        Raises
        ------
        ValueError
            If the step is not committed (missing, or still being written).
        """
        if step not in self._steps:
            if step not in self.committed_steps:
                state = "does not exist" if not self._has_group(step) else "is not committed"
                raise ValueError(
                    f"step {step!r} of archive {self.path!r} {state}; "
                    f"committed steps: {self.committed_steps}"
                )
            try:
                self._steps[step] = dict(files.attributes(self.store, schema.step_path(step)))
            except FileNotFoundError:
                raise ValueError(f"committed step {step} of archive {self.path!r} has no step group") from None
        return self._steps[step]

    def _has_group(self, step: Any) -> bool:
        try:
            step_path = schema.step_path(step)
        except ValueError:
            return False
        return self.store.exists(f"{step_path}/{files.ZARR_JSON}")

    def summary(self, step: int) -> dict[str, Any]:
        """The free-form summary passed to ``commit_step``."""
        return dict(self.step_info(step).get("summary", {}))

    def executions(self, step: int) -> list[str]:
        """Ids of the step's committed executions, sorted."""
        return list(self.step_info(step)["executions"])

    def execution_index(self, step: int) -> dict[str, dict[str, Any]]:
        """Per-execution task, split, reward, counts of a step, without reading any array."""
        return dict(self.step_info(step)["executions"])

    def load_execution(self, step: int, execution_id: str) -> ExecutionResult:
        """Load one execution, token-exact.

        Raises
        ------
        ValueError
            If the step is not committed, or the execution is not part of it, or its arrays
            disagree with their offsets.
        """
        index = self.step_info(step)["executions"]
        if execution_id not in index:
            raise ValueError(
                f"execution {execution_id!r} is not in committed step {step} of {self.path!r}"
            )
        segment = index[execution_id].get("segment")
        if segment is not None:
            entries, arrays = self._segment(step, segment)
            where = f"{self.path}:{schema.segment_path(step, segment)}"
            if execution_id not in entries:
                raise ValueError(f"segment {where!r} is corrupt: it does not hold execution {execution_id!r}")
            meta = entries[execution_id]
            return _to_result(meta, _slice(arrays, meta.get("slices"), f"{where} ({execution_id})"), where, 2)
        path = schema.execution_path(step, execution_id)
        try:
            attrs, arrays = files.read_group(self.store, path)
        except FileNotFoundError:
            raise ValueError(f"execution group {self.path}:{path} is missing from committed step {step}") from None
        if arrays is None:  # another layout (version 1): through zarr
            attrs, arrays = sync(_read_group(self.path, path))
        if attrs.get("complete") is not True:
            raise ValueError(f"execution group {self.path}:{path!r} is incomplete")
        return _to_result(attrs, arrays, f"{self.path}:{path}", attrs.get(schema.EXECUTION_MARKER))

    def _segment(self, step: int, segment: str) -> tuple[dict[str, dict], dict[str, np.ndarray]]:
        """A segment's execution entries by id and its arrays, decoded once while they stay in the
        cache (iterating a step reads each segment once)."""
        key = (step, segment)
        if key in self._segments:
            self._segments.move_to_end(key)
            return self._segments[key]
        path = schema.segment_path(step, segment)
        try:
            attrs, arrays = files.read_group(self.store, path)
        except FileNotFoundError:
            raise ValueError(f"segment {self.path}:{path} is missing from committed step {step}") from None
        if arrays is None:  # rewritten in another layout: through zarr
            attrs, arrays = sync(_read_group(self.path, path))
        if attrs.get("complete") is not True:
            raise ValueError(f"segment {self.path}:{path!r} is incomplete")
        entries = {e["execution_id"]: e for e in attrs.get("executions", [])}
        self._segments[key] = (entries, arrays)
        self._cached += sum(a.nbytes for a in arrays.values())
        while self._cached > SEGMENT_CACHE_BYTES and len(self._segments) > 1:
            _, (_, old) = self._segments.popitem(last=False)
            self._cached -= sum(a.nbytes for a in old.values())
        return entries, arrays

    def iter_executions(
        self, split: str | None = None, steps: Iterable[int] | None = None
    ) -> Iterator[ExecutionResult]:
        """Yield executions of committed steps in step then id order.

        Parameters
        ----------
        split
            Only executions of this split (``train`` or ``heldout``); filtered with the step
            index, so skipped executions cost no array reads.
        steps
            Only these steps (each must be committed); default all committed steps.
        """
        for step in self.committed_steps if steps is None else steps:
            for eid, entry in self.execution_index(step).items():
                if split is None or entry.get("split") == split:
                    yield self.load_execution(step, eid)

    def to_xarray(self, steps: Iterable[int] | None = None, chunks: Any = None) -> Any:
        """The committed part of the archive as an ``xarray.DataTree``; see ``open_datatree``."""
        return open_datatree(self.path, steps=steps, chunks=chunks, reader=self)


def load_from_segment(path: PathLike, step: int, segment: str, execution_id: str) -> ExecutionResult:
    """One execution of a complete segment, whether or not its step is committed yet (a pipeline
    reading back what it wrote).

    Raises
    ------
    ValueError
        If the segment is missing, incomplete or damaged, or does not hold the execution.
    """
    where = f"{path}:{schema.segment_path(step, segment)}"
    try:
        attrs, arrays = files.read_group(open_store(path), schema.segment_path(step, segment))
    except FileNotFoundError:
        raise ValueError(f"segment {where!r} is missing") from None
    if attrs.get("complete") is not True or arrays is None:
        raise ValueError(f"segment {where!r} is incomplete or not in the segment layout")
    entries = {e["execution_id"]: e for e in attrs.get("executions", [])}
    if execution_id not in entries:
        raise ValueError(f"segment {where!r} does not hold execution {execution_id!r}")
    meta = entries[execution_id]
    return _to_result(meta, _slice(arrays, meta.get("slices"), f"{where} ({execution_id})"), where, 2)


async def _read_group(
    root_path: str, group_path: str
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Attributes and all arrays of one execution group (either layout), read concurrently."""
    group = await zarr.api.asynchronous.open_group(store=root_path, path=group_path, mode="r")
    attrs = dict(group.attrs)
    names = list(schema.LAYOUTS.get(attrs.get(schema.EXECUTION_MARKER), schema.TREE_ARRAYS))
    nodes = await asyncio.gather(*(group.getitem(name) for name in names))
    data = await asyncio.gather(*(node.getitem(...) for node in nodes))
    return attrs, dict(zip(names, data))


def _calls_v1(arrays: Mapping[str, np.ndarray], where: str) -> list[tuple[np.ndarray, np.ndarray, dict]]:
    """(prompt, completion, meta) of each call of a version-1 group: prompts stored whole."""
    p_off, c_off = arrays["prompt_offsets"], arrays["completion_offsets"]
    n = len(arrays["call_meta"])
    if (
        len(p_off) != n + 1
        or len(c_off) != n + 1
        or int(p_off[-1]) != len(arrays["prompt_tokens"])
        or int(c_off[-1]) != len(arrays["completion_tokens"])
    ):
        raise ValueError(f"execution group {where!r} is corrupt: arrays disagree with offsets")
    prompts = split_ragged(arrays["prompt_tokens"], p_off)
    completions = split_ragged(arrays["completion_tokens"], c_off)
    return [(prompts[i], completions[i], json.loads(str(m))) for i, m in enumerate(arrays["call_meta"])]


def _calls_v2(arrays: Mapping[str, np.ndarray], where: str) -> list[tuple[np.ndarray, np.ndarray, dict]]:
    """(prompt, completion, meta) of each call of a version-2 group: sequences cut from the tree."""
    try:  # one parse for all the calls' documents
        metas = json.loads("[" + ",".join(map(str, arrays["call_meta"])) + "]")
    except json.JSONDecodeError as err:
        raise ValueError(f"execution group {where!r} is corrupt: call_meta is not JSON ({err})") from None
    if not all(isinstance(m, dict) for m in metas):
        raise ValueError(f"execution group {where!r} is corrupt: a call_meta entry is not a JSON object")
    offsets, parent = arrays["node_offsets"], arrays["node_parent"]
    if len(offsets) != len(parent) + 1 or int(offsets[0]) != 0 or int(offsets[-1]) != len(arrays["tokens"]):
        raise ValueError(f"execution group {where!r} is corrupt: node offsets do not span the tokens")
    try:
        tree = CallTree(arrays["tokens"], offsets, parent,
                        np.array([m.pop("node") for m in metas], np.int32),
                        np.array([m.pop("n_prompt") for m in metas], np.int64),
                        np.array([m.pop("n_completion") for m in metas], np.int64))
        out = []
        for k, (meta, seq) in enumerate(zip(metas, tree.sequences())):
            p = int(tree.call_prompt[k])
            out.append((seq[:p], seq[p:], meta))
    except (KeyError, ValueError) as err:
        raise ValueError(f"execution group {where!r} is corrupt: {err}") from None
    return out


def _slice(arrays: Mapping[str, np.ndarray], slices: Any, where: str) -> dict[str, np.ndarray]:
    """One execution's part of a segment's arrays, by its ``slices``."""
    out = {}
    for name in schema.TREE_ARRAYS:
        try:
            a, b = (int(x) for x in slices[name])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"segment {where!r} is corrupt: no slice of {name!r}") from None
        if not 0 <= a <= b <= len(arrays[name]):
            raise ValueError(f"segment {where!r} is corrupt: slice {[a, b]} of {name!r} is outside its "
                             f"{len(arrays[name])} elements")
        out[name] = arrays[name][a:b]
    return out


def _to_result(meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray], where: str, layout: int) -> ExecutionResult:
    """Rebuild an ``ExecutionResult`` from an execution's metadata and arrays (``layout`` 1: whole
    prompts per call; 2: the call tree)."""
    parts = (_calls_v1 if layout == 1 else _calls_v2)(arrays, where)
    ends = np.cumsum([0] + [len(c) for _, c, _ in parts]).tolist()
    if not len(arrays["logprobs"]) == len(arrays["versions"]) == ends[-1]:
        raise ValueError(f"execution group {where!r} is corrupt: arrays disagree with offsets")
    calls = []
    for i, (prompt, completion, call) in enumerate(parts):
        known = call if call.keys() <= _CALL_FIELDS else {k: v for k, v in call.items() if k in _CALL_FIELDS}
        calls.append(
            CallRecord(
                **known,
                prompt_ids=prompt,
                completion_ids=completion,
                logprobs=arrays["logprobs"][ends[i] : ends[i + 1]],
                versions=arrays["versions"][ends[i] : ends[i + 1]],
            )
        )
    return ExecutionResult(
        execution_id=meta["execution_id"],
        task_id=meta["task_id"],
        step=int(meta["step"]),
        sample=int(meta["sample"]),
        split=meta["split"],
        calls=calls,
        reward=meta["reward"],
        passed=bool(meta["passed"]),
        end_reason=meta["end_reason"],
        metrics=dict(meta.get("metrics") or {}),
        worker=meta.get("worker", ""),
    )


def open_datatree(
    path: PathLike,
    steps: Iterable[int] | None = None,
    chunks: Any = None,
    reader: ArchiveReader | None = None,
) -> Any:
    """Open the committed part of an archive as an ``xarray.DataTree``.

    Each committed step is opened on its own and only its listed executions are kept, so a step
    being written, or a stray group left by a killed writer, never shows up.

    Parameters
    ----------
    path
        The ``archive.zarr`` directory.
    steps
        Committed steps to include; default all.
    chunks
        Passed to ``xarray.open_datatree``: ``None`` loads eagerly, ``{}`` gives lazy dask arrays
        with the stored chunks.

    Returns
    -------
    xarray.DataTree
        Root attributes on the root node; nodes ``steps/<step>/segments/<name>`` (each segment's
        executions listed, with their slices, in its ``executions`` attribute) and, for steps
        written before segments, ``steps/<step>/executions/<id>``.
    """
    import xarray as xr  # imported here: reading tokens with gyreflow never needs xarray

    reader = reader or ArchiveReader(path)
    selected = reader.committed_steps if steps is None else list(steps)
    nodes: dict[str, Any] = {"/": xr.Dataset(attrs=reader.attrs)}
    for step in selected:
        index = reader.execution_index(step)
        keep = {eid for eid, e in index.items() if "segment" not in e}
        segments = {e["segment"] for e in index.values() if "segment" in e}
        sub = xr.open_datatree(
            str(path),
            engine="zarr",
            group=schema.step_path(step),
            consolidated=False,
            chunks=chunks,
        )
        base = schema.step_path(step)
        nodes[base] = xr.Dataset(attrs=sub.attrs)
        for kind, names in ((schema.EXECUTIONS, keep), (schema.SEGMENTS, segments)):
            if names:
                groups = sub.children[kind]
                nodes[f"{base}/{kind}"] = xr.Dataset()
                for name in sorted(names):
                    nodes[f"{base}/{kind}/{name}"] = groups[name].to_dataset(inherit=False)
    return xr.DataTree.from_dict(nodes)
