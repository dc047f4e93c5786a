"""Driver-side and task-side writing of a run's trajectory archive.

Three writers touch an archive, each with its own files, so no two ever write the same file at
once:

* ``create_archive`` / ``ArchiveWriter`` (driver): the root group and its attributes.
* ``write_executions`` (one Dask task per group of executions, e.g. a task's samples): exactly
  one segment; ``write_execution`` writes a segment of one.
* ``commit_step`` (driver, after all of a step's writes returned): the step group's attributes,
  then the root's ``committed_steps``. The root list is the commit marker: readers see a step
  only once it is listed there, and it is written last.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gyreflow.storage import files, schema
from gyreflow.storage.stores import LocalStore, Store, open_store
from gyreflow.storage.calltree import CallTree
from gyreflow.trajectory.records import ExecutionResult
from gyreflow.trajectory.tree import TrajectoryTree

PathLike = str | Path


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _exists(path: PathLike) -> bool:
    """Whether ``path`` already holds something (an empty directory counts as absent)."""
    return not open_store(path).empty()


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
    store = open_store(path)
    if not store.exists("") if isinstance(store, LocalStore) else store.empty():
        raise FileNotFoundError(f"no gyreflow archive at {str(path)!r}: path does not exist")
    try:
        doc = files.read_json(store, files.ZARR_JSON)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, ValueError):
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


def _flatten(arrays: list[np.ndarray], dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate ragged per-call arrays into one flat array plus ``n + 1`` int64 offsets."""
    lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)
    return flat, offsets


def execution_arrays(result: ExecutionResult, tree: TrajectoryTree | None = None) -> dict[str, np.ndarray]:
    """The arrays of one execution, exactly as a segment stores them (concatenated with the other
    executions' of the segment).

    Parameters
    ----------
    result
        A finished execution.
    tree
        Its trajectory tree, where the pipeline built it already (used only if it is the tree of
        exactly these calls: same execution, same call count, not a dropped placeholder).

    Returns
    -------
    dict
        Array name -> numpy array: the calls' token tree (``tokens``, ``node_offsets``,
        ``node_parent``), the completions' ``logprobs`` and ``versions``, and ``call_meta`` (a numpy
        ``StringDType`` array of JSON, each with the call's ``node`` and lengths).
    """
    calls = result.calls
    usable = tree is not None and tree.execution_id == result.execution_id and not tree.dropped
    tree = CallTree.of(calls, tree if usable else None)
    logprobs, _ = _flatten([c.logprobs for c in calls], "float32")
    versions, _ = _flatten([c.versions for c in calls], "int32")
    meta = np.array(
        [schema.call_document(c, node, p, n) for c, node, p, n in
         zip(calls, tree.call_node.tolist(), tree.call_prompt.tolist(), tree.call_completion.tolist())],
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
    """Write one execution as a segment of its own (named by its id); see :func:`write_executions`."""
    return write_executions(archive_path, [result])[0]


def write_executions(archive_path: PathLike, results: Sequence[ExecutionResult],
                     segment: str | None = None, trees: Sequence[TrajectoryTree] | None = None,
                     keep_existing: bool = False) -> list[dict[str, Any]]:
    """Write executions of one step into one segment of the archive (called from a Dask task).

    Safe to call concurrently for different segments of the same step: each call writes only
    inside ``steps/<step>/segments/<segment>/``; a missing parent group is created as an empty
    group, and writers racing on it write identical bytes. A second call for the same segment (a
    retried task) replaces the first one's. The segment is marked ``complete`` last, so a writer
    killed half-way leaves a segment that ``commit_step`` ignores.

    Parameters
    ----------
    archive_path
        The ``archive.zarr`` directory, created by ``create_archive``.
    results
        Finished executions of one step (``result.step``), distinct ids.
    segment
        The segment's name; default the first execution's id.
    trees
        The executions' trajectory trees, where the pipeline built them already (one per
        execution, in order); the calls are stored as those trees rather than built again.
    keep_existing
        If the segment is already complete, keep it and return its summaries: the first write
        wins. A pipeline whose training reads what it archived passes this, so that executions
        run again after their worker died (Dask recomputes lost results) never replace the ones
        that were trained.

    Returns
    -------
    list[dict]
        Per execution: ``execution_id``, ``step``, ``task_id``, ``sample``, ``split``, ``reward``,
        ``passed``, ``end_reason``, ``n_calls``, ``n_prompt_tokens``, ``n_completion_tokens``,
        ``n_stored_tokens``, ``digest`` (:func:`tokens_digest` of the stored tree).

    Raises
    ------
    ValueError
        If there is nothing to write, the executions span several steps or repeat an id, the step
        is already committed (committed steps are immutable), the archive is not a gyreflow
        archive, or an id is not a valid group name.
    """
    results = list(results)
    if not results:
        raise ValueError("write_executions: no executions to write")
    steps = sorted({int(r.step) for r in results})
    if len(steps) > 1:
        raise ValueError(f"write_executions: one segment holds one step's executions, got steps {steps}")
    ids = [r.execution_id for r in results]
    for eid in ids:
        schema.check_execution_id(eid)
    if len(set(ids)) != len(ids):
        raise ValueError(f"write_executions: execution ids repeat: {sorted({i for i in ids if ids.count(i) > 1})}")
    step = steps[0]
    path = schema.segment_path(step, segment if segment is not None else ids[0])
    version = root_attributes(archive_path)[schema.ROOT_MARKER]
    if version < schema.SCHEMA_VERSION:
        raise ValueError(
            f"{str(archive_path)!r} has archive schema version {version}; open it "
            f"with ArchiveWriter (which upgrades it to {schema.SCHEMA_VERSION}) before writing into it"
        )
    store = open_store(archive_path)
    if _step_attributes(store, step).get("committed"):
        raise ValueError(
            f"step {step} of {str(archive_path)!r} is committed; "
            f"refusing to write executions {ids[:3]}{'...' if len(ids) > 3 else ''} into it"
        )
    if keep_existing:
        kept = _complete_segment(store, path)
        if kept is not None:
            return [{k: e.get(k) for k in _SUMMARY_KEYS} for e in kept]
    if trees is not None and len(trees) != len(results):
        raise ValueError(f"write_executions: {len(trees)} trees for {len(results)} executions")
    per = [execution_arrays(r, t) for r, t in zip(results, trees or [None] * len(results))]
    arrays = {name: np.concatenate([p[name] for p in per]) for name in schema.TREE_ARRAYS}
    summaries, entries = [], []
    start = dict.fromkeys(schema.TREE_ARRAYS, 0)
    for r, p in zip(results, per):
        summary = {
            "execution_id": r.execution_id,
            "step": int(r.step),
            "task_id": r.task_id,
            "sample": int(r.sample),
            "split": r.split,
            "reward": r.reward,
            "passed": bool(r.passed),
            "end_reason": r.end_reason,
            "n_calls": len(r.calls),
            "n_prompt_tokens": int(sum(len(c.prompt_ids) for c in r.calls)),
            "n_completion_tokens": int(sum(len(c.completion_ids) for c in r.calls)),
            "n_stored_tokens": int(len(p["tokens"])),
            "digest": tokens_digest(p["tokens"]),
        }
        slices = {name: [start[name], start[name] + len(p[name])] for name in schema.TREE_ARRAYS}
        start = {name: b for name, (_, b) in slices.items()}
        entries.append(schema.to_json(r.meta()) | {k: summary[k] for k in _ENTRY_COUNTS} | {"slices": slices})
        summaries.append(schema.to_json(summary))
    attrs = {schema.SEGMENT_MARKER: schema.SEGMENT_VERSION, "complete": True, "written_at": _now(),
             "executions": entries}
    files.write_group(store, path, arrays, attrs,
                      pending={schema.SEGMENT_MARKER: schema.SEGMENT_VERSION, "complete": False})
    return summaries


_ENTRY_COUNTS = ("n_prompt_tokens", "n_completion_tokens", "n_stored_tokens", "digest")
_SUMMARY_KEYS = ("execution_id", "step", "task_id", "sample", "split", "reward", "passed", "end_reason", "n_calls",
                 *_ENTRY_COUNTS)


def tokens_digest(tokens: np.ndarray) -> str:
    """Identifies an execution's stored token tree (its ``tokens`` array, or a trajectory tree's)."""
    import hashlib

    return hashlib.blake2b(np.ascontiguousarray(tokens, dtype="<i4").tobytes(), digest_size=8).hexdigest()


def _complete_segment(store: Store, group: str) -> list[dict[str, Any]] | None:
    """The execution entries of a complete segment at ``group`` (``None`` if absent or incomplete)."""
    try:
        attrs = files.attributes(store, group)
    except (FileNotFoundError, ValueError):
        return None
    return attrs.get("executions") if attrs.get("complete") is True else None


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


def _step_attributes(store: Store, step: int) -> dict[str, Any]:
    """A step group's attributes (empty while it has none)."""
    try:
        return files.attributes(store, schema.step_path(step))
    except FileNotFoundError:
        return {}


def _complete_executions(store: Store, step_dir: str) -> dict[str, dict[str, Any]]:
    """Index entries of the step's executions in complete segments (and complete execution groups
    of versions 1 and 2); a segment's executions name it.

    Raises
    ------
    ValueError
        If two complete groups hold the same execution.
    """
    index: dict[str, dict[str, Any]] = {}

    def add(eid: str, entry: dict[str, Any], where: str) -> None:
        if eid in index:
            raise ValueError(f"execution {eid!r} is written twice in {store.url}/{step_dir} (again in {where})")
        index[eid] = entry

    for kind in (schema.EXECUTIONS, schema.SEGMENTS):
        for name in store.children(f"{step_dir}/{kind}"):
            try:
                attrs = files.attributes(store, f"{step_dir}/{kind}/{name}")
            except (FileNotFoundError, ValueError):
                continue  # a writer killed before its first document
            if attrs.get("complete") is not True:
                continue
            if kind == schema.EXECUTIONS:
                add(name, {k: attrs.get(k) for k in _INDEX_KEYS}, f"execution group {name!r}")
                continue
            for entry in attrs.get("executions", []):
                add(entry["execution_id"], {k: entry.get(k) for k in _INDEX_KEYS} | {"segment": name},
                    f"segment {name!r}")
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
    root = root_attributes(archive_path)
    store = open_store(archive_path)
    committed = [int(s) for s in root.get("committed_steps", [])]
    if step in committed:
        raise ValueError(f"step {step} of {str(archive_path)!r} is already committed")
    index = _complete_executions(store, schema.step_path(step))
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
    files.set_attributes(store, schema.step_path(step), _step_attributes(store, step) | attrs)
    # Commit point: written after every byte of the step is on disk.
    files.set_attributes(store, "", root | {"committed_steps": sorted({*committed, int(step)})})
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
            store = open_store(self.path)
            files.set_attributes(store, schema.STEPS, {})
            files.set_attributes(store, "", attrs)
            return
        root_attributes(self.path)
        store = open_store(self.path)
        if recover:
            self.recovered = self._recover(store)
        root = root_attributes(self.path)
        upgraded = {}
        if root[schema.ROOT_MARKER] < schema.SCHEMA_VERSION:
            # Execution groups say their own layout: older groups stay as they are, new ones are
            # written in the current one, and older readers must refuse the archive from now on.
            upgraded = {"upgraded_from": root[schema.ROOT_MARKER]}
            root[schema.ROOT_MARKER] = schema.SCHEMA_VERSION
        if run_meta is not None or any(self.recovered.values()) or upgraded:
            resumes = list(root.get("resumes", []))
            resumes.append({"at": _now(), "run": schema.to_json(run_meta), **self.recovered, **upgraded})
            files.set_attributes(store, "", root | {"resumes": resumes})

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

    def _recover(self, store: Store) -> dict[str, list[int]]:
        root = root_attributes(self.path)
        committed = {int(s) for s in root.get("committed_steps", [])}
        rolled, discarded = [], []
        for name in store.children(schema.STEPS):
            if not name.isdigit() or int(name) in committed:
                continue
            step = int(name)
            if _step_attributes(store, step).get("committed") is True:
                rolled.append(step)
            else:
                store.delete(schema.step_path(step))
                discarded.append(step)
        if rolled:
            files.set_attributes(store, "", root | {"committed_steps": sorted(committed | set(rolled))})
        return {"rolled_forward": sorted(rolled), "discarded": sorted(discarded)}

    @property
    def committed_steps(self) -> list[int]:
        """Committed steps, ascending (read from the store, not cached)."""
        return [int(s) for s in root_attributes(self.path).get("committed_steps", [])]

    def update_run(self, meta: dict[str, Any]) -> None:
        """Merge ``meta`` into the root ``run`` attribute (driver only)."""
        root = root_attributes(self.path)
        files.set_attributes(open_store(self.path), "", root | {"run": {**root.get("run", {}), **schema.to_json(meta)}})

    def write_execution(self, result: ExecutionResult) -> dict[str, Any]:
        """Write one execution from the driver process; see ``write_execution``."""
        return write_execution(self.path, result)

    def write_executions(self, results: Sequence[ExecutionResult], segment: str | None = None) -> list[dict[str, Any]]:
        """Write executions as one segment from the driver process; see ``write_executions``."""
        return write_executions(self.path, results, segment)

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
