"""Segment groups as files in a local archive directory, written and read directly.

A segment (or a version-2 execution group) is a dozen small files. Through zarr's store API each costs ~0.3 ms (its event
loop hands every file to a worker thread); written or read here they cost tens of microseconds.
The bytes are exactly zarr's (:func:`schema.array_metadata`, :func:`schema.encode_chunk`), so zarr
and xarray open the groups as usual; a group in any other layout is left to zarr.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from gyreflow.storage import schema

ZARR_JSON = "zarr.json"


def _group_doc(attributes: dict[str, Any]) -> bytes:
    return json.dumps({"zarr_format": 3, "node_type": "group", "attributes": attributes}, allow_nan=True).encode()


def _replace(path: Path, data: bytes) -> None:
    """Write ``path`` atomically: readers see the old file or the new one, never a torn one."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any]:
    """A ``zarr.json`` document.

    Raises
    ------
    FileNotFoundError
        If the file is missing.
    ValueError
        If it is not a JSON object.
    """
    try:
        doc = json.loads(path.read_bytes())
    except json.JSONDecodeError as err:
        raise ValueError(f"{str(path)!r} is not valid JSON: {err}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{str(path)!r} is not a zarr document (not a JSON object)")
    return doc


def write_group(root: Path, group_path: str, arrays: dict[str, np.ndarray], attrs: dict[str, Any],
                pending: dict[str, Any]) -> None:
    """Write a group of ``TREE_ARRAYS`` with attributes ``pending`` first and ``attrs`` last.

    What a previous attempt left is deleted first. Missing parent groups (the step and its
    segments group) are created empty; writers racing on one write identical bytes.
    """
    group = root / group_path
    for parent in (group.parent.parent, group.parent):
        if not (parent / ZARR_JSON).exists():
            parent.mkdir(parents=True, exist_ok=True)
            _replace(parent / ZARR_JSON, _group_doc({}))
    shutil.rmtree(group, ignore_errors=True)
    group.mkdir(parents=True)
    (group / ZARR_JSON).write_bytes(_group_doc(pending))
    for name, data in arrays.items():
        os.mkdir(group / name)
        (group / name / ZARR_JSON).write_bytes(json.dumps(schema.array_metadata(name, len(data))).encode())
        for i, chunk in enumerate(schema.chunks(name, data)):
            (group / schema.chunk_key(name, i)).write_bytes(chunk)
    _replace(group / ZARR_JSON, _group_doc(attrs))


def read_group(root: Path, group_path: str) -> tuple[dict[str, Any], dict[str, np.ndarray] | None]:
    """Attributes and arrays of a segment or a version-2 execution group as :func:`write_group`
    lays them out; the arrays are ``None`` for a group in any other layout (version 1, other codecs
    or chunks: read those with zarr).

    Raises
    ------
    ValueError
        If the group is damaged: a document that is not JSON, or a chunk that is missing or does
        not decode to its array's length.
    """
    group = root / group_path
    attrs = read_json(group / ZARR_JSON).get("attributes", {})
    if attrs.get(schema.SEGMENT_MARKER) != schema.SEGMENT_VERSION and attrs.get(schema.EXECUTION_MARKER) != 2:
        return attrs, None
    arrays = {}
    for name in schema.TREE_ARRAYS:
        try:
            doc = read_json(group / name / ZARR_JSON)
        except FileNotFoundError:
            raise ValueError(f"group {str(group)!r} is corrupt: array {name!r} is missing") from None
        shape = doc.get("shape")
        if not (isinstance(shape, list) and len(shape) == 1 and isinstance(shape[0], int)):
            return attrs, None
        length = shape[0]
        if doc != json.loads(json.dumps(schema.array_metadata(name, length))):
            return attrs, None
        parts = []
        for i in range(-(-length // schema.CHUNK_ELEMENTS)):
            chunk = group / schema.chunk_key(name, i)
            try:
                data = chunk.read_bytes()
            except FileNotFoundError:
                raise ValueError(f"group {str(group)!r} is corrupt: chunk {schema.chunk_key(name, i)} is missing") from None
            parts.append(schema.decode_chunk(name, data, min(schema.CHUNK_ELEMENTS, length - i * schema.CHUNK_ELEMENTS),
                                             where=str(chunk)))
        if not parts:  # an empty array has no chunk
            data_type = schema.TREE_ARRAYS[name][0]
            parts = [np.zeros(0, dtype=object if data_type == "string" else data_type)]
        arrays[name] = np.concatenate(parts) if len(parts) > 1 else parts[0]
    return attrs, arrays
