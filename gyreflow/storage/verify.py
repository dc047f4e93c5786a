"""``gyreflow inspect --verify``: check every committed step of an archive, stop at the first damage.

What is checked: the root (marker, schema version, ``committed_steps``); for each committed step
its group and index; every segment or execution group it names (complete, every array present,
metadata as the format specifies, chunks decode to their lengths, slices inside the arrays and
covering them, the call trees consistent with their offsets); every execution loads token-exact
and its counts agree with the index; and nowhere a pickle (no pickle codec, no object dtype, no
file that starts as a pickle stream).
"""

from __future__ import annotations

from dataclasses import dataclass

from gyreflow.storage import files, schema
from gyreflow.storage.reader import ArchiveReader
from gyreflow.storage.stores import Store
from gyreflow.storage.writer import PathLike

ALLOWED_CODECS = {"bytes", "blosc", "zstd", "vlen-utf8", "gzip", "crc32c", "transpose"}
"""Codecs a gyreflow archive may name: none of them runs code or unpickles."""
_PICKLE_STARTS = tuple(bytes([0x80, protocol]) for protocol in range(2, 6))


class ArchiveDamaged(ValueError):
    """The first damage found in an archive (the message names where and what)."""


@dataclass
class Verified:
    """What a sound archive holds."""

    schema_version: int
    steps: list[int]
    executions: int = 0
    calls: int = 0
    tokens: int = 0
    files: int = 0


def verify(path: PathLike) -> Verified:
    """Check the archive at ``path``; returns its counts.

    Raises
    ------
    FileNotFoundError
        If nothing exists at ``path``.
    ArchiveDamaged
        At the first damage, naming it.
    """
    root = str(path)
    try:
        reader = ArchiveReader(root)
    except ValueError as err:
        raise ArchiveDamaged(str(err)) from None
    committed = reader.attrs.get("committed_steps", [])
    if not isinstance(committed, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                  for s in committed):
        raise ArchiveDamaged(f"{str(root)!r}: root attribute committed_steps is not a list of steps: {committed!r}")
    if len(set(committed)) != len(committed):
        raise ArchiveDamaged(f"{str(root)!r}: committed_steps repeats a step: {committed}")
    out = Verified(reader.schema_version, sorted(committed))
    out.files = _no_pickles(reader.store)
    for step in out.steps:
        _verify_step(reader, step, out)
    return out


def _no_pickles(store: Store) -> int:
    """Every document names only allowed codecs and no object dtype; no file starts as a pickle."""
    count = 0
    for key in store.files():
        count += 1
        where = f"{store.url}/{key}"
        if store.read(key)[:2] in _PICKLE_STARTS:
            raise ArchiveDamaged(f"{where!r} is a pickle stream: archives hold arrays and JSON only")
        if key.rsplit("/", 1)[-1] != files.ZARR_JSON:
            continue
        try:
            doc = files.read_json(store, key)
        except ValueError as err:
            raise ArchiveDamaged(str(err)) from None
        if doc.get("node_type") != "array":
            continue
        for codec in doc.get("codecs", []):
            codec_name = codec.get("name") if isinstance(codec, dict) else codec
            if codec_name not in ALLOWED_CODECS:
                raise ArchiveDamaged(f"{where!r} names codec {codec_name!r}, which a gyreflow archive never uses")
        if doc.get("data_type") in ("object", "|O", "O"):
            raise ArchiveDamaged(f"{where!r} has an object data type (pickled values)")
    return count


def _verify_step(reader: ArchiveReader, step: int, out: Verified) -> None:
    where = f"{reader.path}:{schema.step_path(step)}"
    try:
        info = reader.step_info(step)
    except ValueError as err:
        raise ArchiveDamaged(str(err)) from None
    if info.get("committed") is not True or info.get("step") != step:
        raise ArchiveDamaged(f"step group {where!r} is listed as committed but its attributes do not say so")
    index = info.get("executions")
    if not isinstance(index, dict):
        raise ArchiveDamaged(f"step group {where!r} has no execution index")
    if info.get("n_executions") != len(index):
        raise ArchiveDamaged(f"step group {where!r} counts {info.get('n_executions')} executions, its index lists "
                             f"{len(index)}")
    segments = sorted({e["segment"] for e in index.values() if isinstance(e, dict) and "segment" in e})
    for segment in segments:
        _verify_segment(reader, step, segment, {eid for eid, e in index.items() if e.get("segment") == segment})
    totals = {"n_calls": 0, "n_prompt_tokens": 0, "n_completion_tokens": 0, "n_stored_tokens": 0}
    for eid, entry in index.items():
        try:
            ex = reader.load_execution(step, eid)
        except (ValueError, KeyError) as err:
            raise ArchiveDamaged(f"execution {eid!r} of step {step}: {err}") from None
        found = {"n_calls": len(ex.calls), "n_prompt_tokens": sum(len(c.prompt_ids) for c in ex.calls),
                 "n_completion_tokens": sum(len(c.completion_ids) for c in ex.calls)}
        for key, value in found.items():
            if entry.get(key) is not None and entry[key] != value:
                raise ArchiveDamaged(f"execution {eid!r} of step {step}: the index says {key} {entry[key]}, "
                                     f"its arrays hold {value}")
        for key in totals:
            totals[key] += int(entry.get(key) or 0)
        out.executions += 1
        out.calls += found["n_calls"]
        out.tokens += found["n_prompt_tokens"] + found["n_completion_tokens"]
    for key, value in totals.items():
        if key in info and info[key] != value:
            raise ArchiveDamaged(f"step group {where!r} counts {key} {info[key]}, its executions add up to {value}")


def _verify_segment(reader: ArchiveReader, step: int, segment: str, expected: set[str]) -> None:
    path = schema.segment_path(step, segment)
    where = f"{reader.path}:{path}"
    try:
        attrs, arrays = files.read_group(reader.store, path)
    except FileNotFoundError:
        raise ArchiveDamaged(f"segment {where!r} is missing") from None
    except ValueError as err:
        raise ArchiveDamaged(str(err)) from None
    if attrs.get("complete") is not True:
        raise ArchiveDamaged(f"segment {where!r} is incomplete")
    if arrays is None:
        raise ArchiveDamaged(f"segment {where!r}: its arrays are not laid out as the format specifies")
    entries = attrs.get("executions", [])
    ids = {e.get("execution_id") for e in entries}
    if ids != expected:
        raise ArchiveDamaged(f"segment {where!r} holds executions {sorted(map(str, ids))[:5]}, the step index names "
                             f"{sorted(expected)[:5]}")
    for name in schema.TREE_ARRAYS:  # the executions' slices tile each array
        spans = sorted(tuple(e.get("slices", {}).get(name, (None, None))) for e in entries)
        at = 0
        for a, b in spans:
            if a != at or b is None or b < a:
                raise ArchiveDamaged(f"segment {where!r}: the executions' slices of {name!r} do not tile the array "
                                     f"(gap or overlap at {at})")
            at = b
        if at != len(arrays[name]):
            raise ArchiveDamaged(f"segment {where!r}: array {name!r} holds {len(arrays[name])} elements, the slices "
                                 f"cover {at}")

