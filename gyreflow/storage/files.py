"""Segment groups as files of an archive's store, written and read directly.

A segment (or a version-2 execution group) is a dozen small files. Through zarr's store API each costs ~0.3 ms (its event
loop hands every file to a worker thread); written or read here they cost tens of microseconds on a
local directory. The bytes are exactly zarr's (:func:`schema.array_metadata`,
:func:`schema.encode_chunk`), so zarr and xarray open the groups as usual; a group in any other
layout is left to zarr. Any :mod:`~gyreflow.storage.stores` store serves.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from gyreflow.storage import schema
from gyreflow.storage.stores import Store

ZARR_JSON = "zarr.json"


def group_doc(attributes: dict[str, Any]) -> bytes:
    return json.dumps({"zarr_format": 3, "node_type": "group", "attributes": attributes}, allow_nan=True).encode()


def read_json(store: Store, key: str) -> dict[str, Any]:
    """A ``zarr.json`` document.

    Raises
    ------
    FileNotFoundError
        If the file is missing.
    ValueError
        If it is not a JSON object.
    """
    where = f"{store.url}/{key}"
    try:
        doc = json.loads(store.read(key))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{where!r} is not valid JSON: {err}") from None
    except IsADirectoryError:
        raise FileNotFoundError(where) from None
    if not isinstance(doc, dict):
        raise ValueError(f"{where!r} is not a zarr document (not a JSON object)")
    return doc


def attributes(store: Store, group_path: str) -> dict[str, Any]:
    """The attributes of the group at ``group_path`` (``""``: the root)."""
    return read_json(store, _key(group_path, ZARR_JSON)).get("attributes", {})


def set_attributes(store: Store, group_path: str, attrs: dict[str, Any]) -> None:
    """Replace the group's attributes in one write (a reader sees the old set or the new one)."""
    store.write(_key(group_path, ZARR_JSON), group_doc(attrs))


def _key(*parts: str) -> str:
    return "/".join(p for p in parts if p)


def write_group(store: Store, group_path: str, arrays: dict[str, np.ndarray], attrs: dict[str, Any],
                pending: dict[str, Any]) -> None:
    """Write a group of ``TREE_ARRAYS`` with attributes ``pending`` first and ``attrs`` last.

    What a previous attempt left is deleted first. Missing parent groups (the step and its
    segments group) are created empty; writers racing on one write identical bytes.
    """
    parent = group_path.rsplit("/", 1)[0]
    for p in (parent.rsplit("/", 1)[0], parent):
        if not store.exists(_key(p, ZARR_JSON)):
            store.write(_key(p, ZARR_JSON), group_doc({}))
    store.delete(group_path)
    store.write_new(_key(group_path, ZARR_JSON), group_doc(pending))
    for name, data in arrays.items():
        store.write_new(_key(group_path, name, ZARR_JSON), json.dumps(schema.array_metadata(name, len(data))).encode())
        for i, chunk in enumerate(schema.chunks(name, data)):
            store.write_new(_key(group_path, schema.chunk_key(name, i)), chunk)
    store.write(_key(group_path, ZARR_JSON), group_doc(attrs))


def read_group(store: Store, group_path: str) -> tuple[dict[str, Any], dict[str, np.ndarray] | None]:
    """Attributes and arrays of a segment or a version-2 execution group as :func:`write_group`
    lays them out; the arrays are ``None`` for a group in any other layout (version 1, other codecs
    or chunks: read those with zarr).

    Raises
    ------
    FileNotFoundError
        If the group does not exist.
    ValueError
        If the group is damaged: a document that is not JSON, or a chunk that is missing or does
        not decode to its array's length.
    """
    where = f"{store.url}/{group_path}"
    attrs = attributes(store, group_path)
    if attrs.get(schema.SEGMENT_MARKER) != schema.SEGMENT_VERSION and attrs.get(schema.EXECUTION_MARKER) != 2:
        return attrs, None
    arrays = {}
    for name in schema.TREE_ARRAYS:
        try:
            doc = read_json(store, _key(group_path, name, ZARR_JSON))
        except FileNotFoundError:
            raise ValueError(f"group {where!r} is corrupt: array {name!r} is missing") from None
        shape = doc.get("shape")
        if not (isinstance(shape, list) and len(shape) == 1 and isinstance(shape[0], int)):
            return attrs, None
        length = shape[0]
        if doc != json.loads(json.dumps(schema.array_metadata(name, length))):
            return attrs, None
        parts = []
        for i in range(-(-length // schema.CHUNK_ELEMENTS)):
            key = _key(group_path, schema.chunk_key(name, i))
            try:
                data = store.read(key)
            except FileNotFoundError:
                raise ValueError(f"group {where!r} is corrupt: chunk {schema.chunk_key(name, i)} is missing") from None
            parts.append(schema.decode_chunk(name, data, min(schema.CHUNK_ELEMENTS, length - i * schema.CHUNK_ELEMENTS),
                                             where=f"{store.url}/{key}"))
        if not parts:  # an empty array has no chunk
            data_type = schema.TREE_ARRAYS[name][0]
            parts = [np.zeros(0, dtype=object if data_type == "string" else data_type)]
        arrays[name] = np.concatenate(parts) if len(parts) > 1 else parts[0]
    return attrs, arrays
