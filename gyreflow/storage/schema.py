"""The archive format, in one place: names, paths, dtypes, dimension names, codecs, JSON rules.

The format itself is specified in ``storage/README.md``; every constant it names lives here so
that the writer and the reader cannot drift apart.
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring
from typing import Any

import numpy as np

SCHEMA_VERSION = 3
"""Value of the root attribute ``gyreflow_archive``; readers refuse larger values. Version 3 writes
executions in *segments*: one group per write holding the token trees (``TREE_ARRAYS``) of one or
more executions, concatenated. Version 2 wrote one group per execution (its tree), version 1 one
group per execution with every call's whole prompt (``CALL_ARRAYS``); both stay readable."""

ARCHIVE_NAME = "archive.zarr"
"""File name of a run's archive inside its run directory."""

ROOT_MARKER = "gyreflow_archive"
EXECUTION_MARKER = "gyreflow_execution"
SEGMENT_MARKER = "gyreflow_segment"
SEGMENT_VERSION = 3
"""Value of ``gyreflow_segment`` on segment groups (the layout they share with version-2 groups)."""

STEPS = "steps"
EXECUTIONS = "executions"
SEGMENTS = "segments"
CHUNK_ELEMENTS = 1 << 20
"""Chunk length along every flat array: 4 MiB of int32, large enough that a typical execution
is one chunk per array (few files, one codec call) and small enough that a slice read of a
million-token execution decodes only the chunks it touches."""

# Arrays of a segment (and of a version-2 execution group): name -> (zarr data type, dimension
# name, fill value).
# The fill value only shows where a chunk is missing; -1 / NaN cannot be mistaken for data.
TREE_ARRAYS: dict[str, tuple[str, str, Any]] = {
    "tokens": ("int32", "tree_token", -1),
    "node_offsets": ("int64", "node_boundary", -1),
    "node_parent": ("int32", "node", -2),
    "logprobs": ("float32", "completion_token", "NaN"),
    "versions": ("int32", "completion_token", -1),
    "call_meta": ("string", "call", ""),
}
"""Arrays of a segment (``gyreflow_segment: 3``: its executions' call trees, concatenated, each
execution's part named by its ``slices``) and of a version-2 execution group (one call tree)."""

CALL_ARRAYS: dict[str, tuple[str, str, Any]] = {
    "prompt_tokens": ("int32", "prompt_token", -1),
    "prompt_offsets": ("int64", "call_boundary", -1),
    "completion_tokens": ("int32", "completion_token", -1),
    "completion_offsets": ("int64", "call_boundary", -1),
    "logprobs": ("float32", "completion_token", "NaN"),
    "versions": ("int32", "completion_token", -1),
    "call_meta": ("string", "call", ""),
}
"""Execution groups of version 1 (``gyreflow_execution: 1``): every call's prompt whole; read only."""

LAYOUTS = {1: CALL_ARRAYS, 2: TREE_ARRAYS}
"""Execution group version -> its arrays."""

_ITEMSIZE = {"int32": 4, "int64": 8, "float32": 4}


def codecs(data_type: str) -> list[dict[str, Any]]:
    """The codec chain of an array, as zarr v3 metadata JSON.

    Numeric arrays: Blosc lz4 with byte shuffle, measured here at about half the raw size on
    Zipf-like token ids while writing as fast as no compression and reading faster (less I/O);
    zstd variants save another ~20% but write ~4x slower, which would put archive writes on the
    rollout path. Strings (one short JSON per call): zarr's default vlen-utf8 + zstd.
    """
    if data_type == "string":
        return [
            {"name": "vlen-utf8", "configuration": {}},
            {"name": "zstd", "configuration": {"level": 0, "checksum": False}},
        ]
    blosc = {"typesize": _ITEMSIZE[data_type], "cname": "lz4", "clevel": 5}
    return [
        {"name": "bytes", "configuration": {"endian": "little"}},
        {"name": "blosc", "configuration": {**blosc, "shuffle": "shuffle", "blocksize": 0}},
    ]


def encode_chunk(name: str, data: np.ndarray) -> bytes:
    """One chunk of an execution array (``CHUNK_ELEMENTS`` long, or the whole array), encoded with the
    codec chain of :func:`codecs`: the bytes zarr itself would store for it (a test compares them).

    Segments are written chunk by chunk as files (:mod:`gyreflow.storage.files`) rather than
    through zarr's array API, whose per-array overhead (~2 ms) dominated the write.
    """
    from numcodecs import Blosc, VLenUTF8, Zstd

    data_type = TREE_ARRAYS[name][0]
    if data_type == "string":
        utf8 = VLenUTF8().encode(np.asarray(data, dtype=object))
        return Zstd(level=0, checksum=False).encode(utf8)
    raw = np.ascontiguousarray(data, dtype=np.dtype(data_type).newbyteorder("<"))
    blosc = Blosc(cname="lz4", clevel=5, shuffle=Blosc.SHUFFLE, blocksize=0, typesize=_ITEMSIZE[data_type])
    return bytes(blosc.encode(raw.view(np.uint8)))


def chunks(name: str, data: np.ndarray) -> list[bytes]:
    """The encoded chunks of execution array ``name`` holding ``data``, in order.

    The regular chunk grid stores an edge chunk at full size, so the last one is padded with the
    array's fill value (zarr reads a shorter one as damaged).
    """
    out = []
    data_type, _, fill = TREE_ARRAYS[name]
    size = max(1, min(len(data), CHUNK_ELEMENTS))
    for start in range(0, len(data), size):
        part = data[start : start + size]
        if len(part) < size:
            pad = np.full(size - len(part), "" if data_type == "string" else float(fill) if fill == "NaN" else fill,
                          dtype=part.dtype)
            part = np.concatenate([part, pad])
        out.append(encode_chunk(name, part))
    return out


def decode_chunk(name: str, data: bytes, length: int, where: str) -> np.ndarray:
    """The inverse of :func:`encode_chunk`: ``length`` elements of array ``name``.

    Raises
    ------
    ValueError
        If the bytes do not decode to ``length`` elements (a damaged chunk, named by ``where``).
    """
    from numcodecs import Blosc, VLenUTF8, Zstd

    data_type = TREE_ARRAYS[name][0]
    try:
        if data_type == "string":
            out = VLenUTF8().decode(Zstd().decode(data))
        else:
            out = np.frombuffer(Blosc().decode(data), dtype=np.dtype(data_type).newbyteorder("<"))
    except Exception as err:  # numcodecs raises several kinds on bad bytes
        raise ValueError(f"chunk {where!r} does not decode: {err}") from None
    if len(out) < length:
        raise ValueError(f"chunk {where!r} holds {len(out)} elements, its array says {length}")
    out = out[:length]  # an edge chunk is padded to full size
    return out if data_type == "string" else out.astype(data_type, copy=False)


def array_metadata(name: str, length: int) -> dict[str, Any]:
    """The complete ``zarr.json`` of one execution array of ``length`` elements.

    Spelled out (rather than left to zarr's defaults) so the stored format is exactly what
    ``storage/README.md`` specifies, whatever defaults a future zarr release picks.
    """
    data_type, dim, fill = TREE_ARRAYS[name]
    # A regular chunk grid stores edge chunks at full size, so never make a chunk longer than
    # the array (a 4 MiB chunk for a 10-token array would cost a 4 MiB encode).
    chunk = max(1, min(length, CHUNK_ELEMENTS))
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": [length],
        "data_type": data_type,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [chunk]}},
        # Chunk i at "<array>/i" (zarr's "v2" key encoding), not "<array>/c/i": one directory
        # fewer per array, and the arrays are one-dimensional so no separator ever appears.
        "chunk_key_encoding": {"name": "v2", "configuration": {"separator": "."}},
        "fill_value": fill,
        "codecs": codecs(data_type),
        "attributes": {},
        "dimension_names": [dim],
    }


def step_name(step: int) -> str:
    """Group name of a step: zero-padded so that lexical order is step order."""
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return f"{int(step):06d}"


def step_path(step: int) -> str:
    """Path of a step group relative to the archive root."""
    return f"{STEPS}/{step_name(step)}"


def execution_path(step: int, execution_id: str) -> str:
    """Path of an execution group relative to the archive root."""
    check_execution_id(execution_id)
    return f"{step_path(step)}/{EXECUTIONS}/{execution_id}"


def segment_path(step: int, segment: str) -> str:
    """Path of a segment group relative to the archive root."""
    check_execution_id(segment)
    return f"{step_path(step)}/{SEGMENTS}/{segment}"


def check_execution_id(execution_id: str) -> None:
    """Reject ids that are not a single, portable zarr node name.

    Raises
    ------
    ValueError
        If the id is empty, contains a path separator, is ``.``/``..``, or starts with ``__``
        (reserved by the zarr v3 spec).
    """
    if (
        not isinstance(execution_id, str)
        or not execution_id
        or "/" in execution_id
        or "\\" in execution_id
        or execution_id in (".", "..")
        or execution_id.startswith("__")
    ):
        raise ValueError(f"execution_id {execution_id!r} cannot be used as a zarr group name")


def chunk_key(name: str, i: int) -> str:
    """Path of chunk ``i`` of array ``name`` inside its group (see :func:`array_metadata`)."""
    return f"{name}/{i}"


def _json_default(obj: Any) -> Any:
    # numpy scalars and arrays turn up in metrics dicts; store them as plain JSON values.
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON-serialisable (archives hold JSON only)")


def call_document(call: Any, node: int, n_prompt: int, n_completion: int) -> str:
    """One ``call_meta`` entry: the call's :meth:`~gyreflow.trajectory.records.CallRecord.meta`
    and where it lies in the tree, as the JSON :func:`dumps` writes, assembled field by field
    (an archive write makes one per call; the generic encoder costs several times more)."""
    return (f'{{"execution_id":{_str(call.execution_id)},"call_index":{int(call.call_index)},'
            f'"call_id":{_str(call.call_id)},"role":{_str(call.role)},"finish_reason":{_str(call.finish_reason)},'
            f'"engine":{_str(call.engine)},"t_start":{_float(call.t_start)},"t_end":{_float(call.t_end)},'
            f'"temperature":{_float(call.temperature)},"top_p":{_float(call.top_p)},'
            f'"node":{int(node)},"n_prompt":{int(n_prompt)},"n_completion":{int(n_completion)}}}')


def _str(value: Any) -> str:
    return encode_basestring(str(value))


def _float(value: Any) -> str:
    x = float(value)
    if x != x:
        return "NaN"
    if x in (float("inf"), float("-inf")):
        return "Infinity" if x > 0 else "-Infinity"
    return repr(x)


_ENCODER = json.JSONEncoder(default=_json_default, separators=(",", ":"), ensure_ascii=False)


def dumps(obj: Any) -> str:
    """Serialise to compact JSON; numpy values become plain numbers/lists.

    Non-finite floats are written as ``NaN``/``Infinity`` (Python's json dialect, which zarr also
    uses for attributes), so a NaN reward survives a round trip.
    """
    return _ENCODER.encode(obj)


def to_json(obj: Any) -> Any:
    """Return ``obj`` as plain JSON types (dict/list/str/int/float/bool/None)."""
    return json.loads(dumps(obj))
