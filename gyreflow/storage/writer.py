"""Driver-side and task-side writing of a run's trajectory archive.

Three writers touch an archive, each with its own files, so no two ever write the same file at
once:

* ``create_archive`` / ``ArchiveWriter`` (driver): the root group and its attributes.
* ``write_execution`` (one Dask task per execution): exactly one execution group.
* ``commit_step`` (driver, after all of a step's writes returned): the step group's attributes,
  then the root's ``committed_steps``. The root list is the commit marker: readers see a step
  only once it is listed there, and it is written last.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from gyreflow.storage import files, schema
from gyreflow.storage.calltree import CallTree
from gyreflow.trajectory.records import ExecutionResult

PathLike = str | Path


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _exists(path: PathLike) -> bool:
    """Whether ``path`` already holds something (an empty directory counts as absent)."""
    p = Path(path)
    return p.exists() and (not p.is_dir() or any(p.iterdir()))


def root_attributes(path: PathLike) -> dict[str, Any]:
    """The root attributes of a gyreflow archive we can read, from its ``zarr.json``.

    Raises
    ------
    FileNotFoundError
        If nothing exists at ``path``.
    ValueError
        If ``path`` is not a zarr group with the ``gyreflow_archive`` marker, or was written by
        a newer schema version.
    """
    if not Path(path).exists():
        raise FileNotFoundError(f"no gyreflow archive at {str(path)!r}: path does not exist")
    try:
        doc = files.read_json(Path(path) / files.ZARR_JSON)
    except (FileNotFoundError, IsADirectoryError, ValueError):
        doc = {}
    if doc.get("zarr_format") != 3 or doc.get("node_type") != "group":
        raise ValueError(f"{str(path)!r} is not a zarr v3 group, so not a gyreflow archive")
    attrs = doc.get("attributes") or {}
    version = attrs.get(schema.ROOT_MARKER)
    if version is None:
        raise ValueError(
            f"{str(path)!r} is a zarr group without the {schema.ROOT_MARKER!r} attribute, "
            "so not a gyreflow archive"
        )
    if not isinstance(version, int) or isinstance(version, bool) or version > schema.SCHEMA_VERSION:
        raise ValueError(
            f"{str(path)!r} has archive schema version {version!r}; this gyreflow reads "
            f"versions up to {schema.SCHEMA_VERSION}: upgrade gyreflow"
        )
    return attrs


def open_root(path: PathLike, mode: str = "r") -> zarr.Group:
    """Open an archive's root group and check that it is a gyreflow archive we can read.

    Parameters
    ----------
    path
        The ``archive.zarr`` directory.
    mode
        ``"r"`` or ``"r+"``; the store must already exist.

    Raises
    ------
    FileNotFoundError, ValueError
        As :func:`root_attributes`.
    """
    root_attributes(path)
    try:
        return zarr.open_group(str(path), mode=mode)
    except (FileNotFoundError, ValueError, TypeError) as e:  # zarr raises several kinds
        raise ValueError(f"{str(path)!r} is not a zarr v3 group, so not a gyreflow archive") from e


def _flatten(arrays: list[np.ndarray], dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate ragged per-call arrays into one flat array plus ``n + 1`` int64 offsets."""
    lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)
    return flat, offsets


def execution_arrays(result: ExecutionResult) -> dict[str, np.ndarray]:
    """The arrays of one execution group, exactly as they are stored (schema version 2).

    Parameters
    ----------
    result
        A finished execution.

    Returns
    -------
    dict
        Array name -> numpy array: the calls' token tree (``tokens``, ``node_offsets``,
        ``node_parent``), the completions' ``logprobs`` and ``versions``, and ``call_meta`` (a numpy
        ``StringDType`` array of JSON, each with the call's ``node`` and lengths).
    """
    calls = result.calls
    tree = CallTree.of(calls)
    logprobs, _ = _flatten([c.logprobs for c in calls], "float32")
    versions, _ = _flatten([c.versions for c in calls], "int32")
    meta = np.array(
        [schema.dumps(c.meta() | {"node": int(tree.call_node[k]), "n_prompt": int(tree.call_prompt[k]),
                                  "n_completion": int(tree.call_completion[k])})
         for k, c in enumerate(calls)],
        dtype=np.dtypes.StringDType(),
    )
    return {
        "tokens": tree.tokens.astype(np.int32, copy=False),
        "node_offsets": tree.node_offsets.astype(np.int64, copy=False),
        "node_parent": tree.node_parent.astype(np.int32, copy=False),
        "logprobs": logprobs,
        "versions": versions,
        "call_meta": meta,
    }


def write_execution(archive_path: PathLike, result: ExecutionResult) -> dict[str, Any]:
    """Write one execution into its own group of the archive (called from a Dask task).

    Safe to call concurrently for different executions of the same step: each call writes only
    inside ``steps/<step>/executions/<execution_id>/``; a missing parent group is created as an
    empty group, and writers racing on it write identical bytes. A second call for the same
    execution (a retried task) replaces the first one's group. The group is marked ``complete`` last, so a writer killed half-way leaves
    a group that ``commit_step`` ignores.

    Parameters
    ----------
    archive_path
        The ``archive.zarr`` directory, created by ``create_archive``.
    result
        The finished execution; ``result.step`` selects the step.

    Returns
    -------
    dict
        ``execution_id``, ``step``, ``task_id``, ``sample``, ``split``, ``reward``, ``passed``,
        ``n_calls``, ``n_prompt_tokens``, ``n_completion_tokens``.

    Raises
    ------
    ValueError
        If the step is already committed (committed steps are immutable), the archive is not a
        gyreflow archive, or the execution id is not a valid group name.
    """
    path = schema.execution_path(result.step, result.execution_id)
    version = root_attributes(archive_path)[schema.ROOT_MARKER]
    if version < schema.SCHEMA_VERSION:
        raise ValueError(
            f"{str(archive_path)!r} has archive schema version {version}; open it "
            f"with ArchiveWriter (which upgrades it to {schema.SCHEMA_VERSION}) before writing into it"
        )
    step_doc = Path(archive_path) / schema.step_path(result.step) / files.ZARR_JSON
    if step_doc.exists() and files.read_json(step_doc).get("attributes", {}).get("committed"):
        raise ValueError(
            f"step {result.step} of {str(archive_path)!r} is committed; "
            f"refusing to write execution {result.execution_id!r} into it"
        )
    arrays = execution_arrays(result)
    summary = {
        "execution_id": result.execution_id,
        "step": int(result.step),
        "task_id": result.task_id,
        "sample": int(result.sample),
        "split": result.split,
        "reward": result.reward,
        "passed": bool(result.passed),
        "n_calls": len(result.calls),
        "n_prompt_tokens": int(sum(len(c.prompt_ids) for c in result.calls)),
        "n_completion_tokens": int(sum(len(c.completion_ids) for c in result.calls)),
        "n_stored_tokens": int(len(arrays["tokens"])),
    }
    meta = schema.to_json(result.meta())
    meta.update(
        {
            "n_prompt_tokens": summary["n_prompt_tokens"],
            "n_completion_tokens": summary["n_completion_tokens"],
            "n_stored_tokens": summary["n_stored_tokens"],
            "written_at": _now(),
            schema.EXECUTION_MARKER: schema.SCHEMA_VERSION,
            "complete": True,
        }
    )
    files.write_group(Path(archive_path), path, arrays, meta)
    return schema.to_json(summary)


_INDEX_KEYS = (
    "task_id",
    "sample",
    "split",
    "reward",
    "passed",
    "end_reason",
    "n_calls",
    "n_prompt_tokens",
    "n_completion_tokens",
    "n_stored_tokens",
)


def _complete_executions(step_group: zarr.Group) -> dict[str, dict[str, Any]]:
    """Index entries of the step's executions whose groups are marked complete."""
    try:
        executions = step_group[schema.EXECUTIONS]
    except KeyError:
        return {}
    index: dict[str, dict[str, Any]] = {}
    for name, node in executions.groups():
        attrs = node.attrs
        if attrs.get("complete") is True:
            index[name] = {k: attrs.get(k) for k in _INDEX_KEYS}
    return dict(sorted(index.items()))


def commit_step(
    archive_path: PathLike,
    step: int,
    summary: dict[str, Any] | None = None,
    *,
    expected: Iterable[str] | None = None,
) -> dict[str, Any]:
    """Make a step visible to readers; call once, after all of its writes have returned.

    Writes the step group's attributes (``committed``, counts, an index of its executions and
    ``summary``), then appends ``step`` to the root's ``committed_steps``. That root write is the
    commit point: a crash before it leaves the step invisible (and ``ArchiveWriter.open`` rolls
    it forward, since its data and index are complete).

    Parameters
    ----------
    archive_path
        The ``archive.zarr`` directory.
    step
        The step to commit.
    summary
        Free-form JSON about the step (loss, mean reward, timings...).
    expected
        Execution ids that must be present and complete; when given, a missing one is an error
        instead of being silently left out.

    Returns
    -------
    dict
        The step group's attributes as written.

    Raises
    ------
    ValueError
        If the step is already committed or an expected execution is missing or incomplete.
    """
    root = open_root(archive_path, mode="r+")
    committed = [int(s) for s in root.attrs.get("committed_steps", [])]
    if step in committed:
        raise ValueError(f"step {step} of {str(archive_path)!r} is already committed")
    step_group = root.require_group(schema.step_path(step))
    step_group.require_group(schema.EXECUTIONS)
    index = _complete_executions(step_group)
    if expected is not None:
        missing = sorted(set(expected) - set(index))
        if missing:
            raise ValueError(
                f"cannot commit step {step} of {str(archive_path)!r}: executions "
                f"{missing[:10]}{'...' if len(missing) > 10 else ''} are missing or incomplete"
            )
    attrs = {
        "step": int(step),
        "committed": True,
        "committed_at": _now(),
        "n_executions": len(index),
        "n_calls": int(sum(e["n_calls"] or 0 for e in index.values())),
        "n_prompt_tokens": int(sum(e["n_prompt_tokens"] or 0 for e in index.values())),
        "n_completion_tokens": int(sum(e["n_completion_tokens"] or 0 for e in index.values())),
        "n_stored_tokens": int(sum(e["n_stored_tokens"] or 0 for e in index.values())),
        "executions": index,
        "summary": schema.to_json(summary or {}),
    }
    step_group.attrs.update(attrs)
    # Commit point: written after every byte of the step is on disk.
    root.attrs["committed_steps"] = sorted({*committed, int(step)})
    return attrs


def create_archive(path: PathLike, run_meta: dict[str, Any] | None = None) -> "ArchiveWriter":
    """Create a new, empty archive and return a writer for it.

    Raises
    ------
    FileExistsError
        If something already exists at ``path`` (use ``ArchiveWriter.open`` to resume).
    """
    if _exists(path):
        raise FileExistsError(f"{str(path)!r} already exists; use ArchiveWriter.open to resume")
    return ArchiveWriter(path, run_meta)


class ArchiveWriter:
    """Driver-side handle on a run's archive.

    Creates the archive if ``path`` is absent (or an empty directory); otherwise opens it and,
    with ``recover=True``, repairs what a crash left: a step whose attributes say committed but
    which is missing from ``committed_steps`` is rolled forward, and any other uncommitted step
    group is deleted so that a resumed run rewrites it from scratch. Recover only while no task
    of the run is writing.

    Parameters
    ----------
    path
        The ``archive.zarr`` directory (see ``archive_path``).
    run_meta
        Run-level JSON (config, model, git revision...). Stored as root attribute ``run`` on
        creation; on reopen it is appended to root attribute ``resumes`` instead.
    recover
        Repair uncommitted steps when opening an existing archive.
    """

    def __init__(
        self, path: PathLike, run_meta: dict[str, Any] | None = None, *, recover: bool = True
    ) -> None:
        self.path = str(path)
        self.recovered: dict[str, list[int]] = {"rolled_forward": [], "discarded": []}
        if not _exists(path):
            attrs = {
                schema.ROOT_MARKER: schema.SCHEMA_VERSION,
                "created": _now(),
                "run": schema.to_json(run_meta or {}),
                "committed_steps": [],
            }
            root = zarr.open_group(self.path, mode="w", attributes=attrs)
            root.require_group(schema.STEPS)
            return
        root = open_root(self.path, mode="r+")
        if recover:
            self.recovered = self._recover(root)
        upgraded = {}
        if root.attrs[schema.ROOT_MARKER] < schema.SCHEMA_VERSION:
            # Execution groups say their own layout: older groups stay as they are, new ones are
            # written in the current one, and older readers must refuse the archive from now on.
            upgraded = {"upgraded_from": root.attrs[schema.ROOT_MARKER]}
            root.attrs[schema.ROOT_MARKER] = schema.SCHEMA_VERSION
        if run_meta is not None or any(self.recovered.values()) or upgraded:
            resumes = list(root.attrs.get("resumes", []))
            resumes.append({"at": _now(), "run": schema.to_json(run_meta), **self.recovered, **upgraded})
            root.attrs["resumes"] = resumes

    @classmethod
    def open(cls, path: PathLike, *, recover: bool = True) -> "ArchiveWriter":
        """Open an existing archive for writing (resume a run).

        Raises
        ------
        FileNotFoundError
            If nothing exists at ``path``.
        """
        if not _exists(path):
            raise FileNotFoundError(f"no gyreflow archive at {str(path)!r}")
        return cls(path, recover=recover)

    @staticmethod
    def _recover(root: zarr.Group) -> dict[str, list[int]]:
        committed = {int(s) for s in root.attrs.get("committed_steps", [])}
        steps = root.require_group(schema.STEPS)
        rolled, discarded = [], []
        for name, node in list(steps.groups()):
            step = int(name)
            if step in committed:
                continue
            if node.attrs.get("committed") is True:
                rolled.append(step)
            else:
                del steps[name]
                discarded.append(step)
        if rolled:
            root.attrs["committed_steps"] = sorted(committed | set(rolled))
        return {"rolled_forward": sorted(rolled), "discarded": sorted(discarded)}

    @property
    def committed_steps(self) -> list[int]:
        """Committed steps, ascending (read from the store, not cached)."""
        return [int(s) for s in open_root(self.path).attrs.get("committed_steps", [])]

    def update_run(self, meta: dict[str, Any]) -> None:
        """Merge ``meta`` into the root ``run`` attribute (driver only)."""
        root = open_root(self.path, mode="r+")
        run = dict(root.attrs.get("run", {}))
        run.update(schema.to_json(meta))
        root.attrs["run"] = run

    def write_execution(self, result: ExecutionResult) -> dict[str, Any]:
        """Write one execution from the driver process; see ``write_execution``."""
        return write_execution(self.path, result)

    def commit_step(
        self,
        step: int,
        summary: dict[str, Any] | None = None,
        *,
        expected: Iterable[str] | None = None,
    ) -> dict[str, Any]:
        """Commit a step; see ``commit_step``."""
        return commit_step(self.path, step, summary, expected=expected)


def archive_path(run_dir: PathLike) -> Path:
    """Where a run directory keeps its archive: ``<run_dir>/archive.zarr``."""
    return Path(run_dir) / schema.ARCHIVE_NAME
