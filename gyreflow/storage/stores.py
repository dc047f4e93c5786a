"""Where an archive's files live: a local directory, or any fsspec filesystem (``s3://``,
``gs://``, ``memory://``...).

Keys are ``/``-separated paths under the archive root, exactly zarr's keys, so what is written here
is a zarr v3 hierarchy that zarr and xarray open on the same store. A local directory is written
with direct file I/O (the fast path); others through fsspec, whose ``pipe_file`` writes an object
whole (readers see the old object or the new one).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol


class Store(Protocol):
    url: str
    """The archive's location as the user gave it."""

    def read(self, key: str) -> bytes:
        """The bytes at ``key``; ``FileNotFoundError`` if absent."""

    def write(self, key: str, data: bytes) -> None:
        """Replace ``key`` whole: a reader sees the old bytes or the new ones."""

    def write_new(self, key: str, data: bytes) -> None:
        """Write ``key`` inside a group no reader looks at yet (no atomicity needed)."""

    def exists(self, key: str) -> bool: ...

    def children(self, key: str) -> list[str]:
        """Names of the sub-directories (groups) directly under ``key``."""

    def delete(self, key: str) -> None:
        """``key`` and everything under it (nothing if absent)."""

    def files(self) -> Iterator[str]:
        """Every file key of the store."""


def _join(*parts: str) -> str:
    return "/".join(p.strip("/") for p in parts if p.strip("/"))


class LocalStore:
    """An archive directory on the local filesystem."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.url = str(root)

    def read(self, key: str) -> bytes:
        return (self.root / key).read_bytes()

    def write(self, key: str, data: bytes) -> None:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    def write_new(self, key: str, data: bytes) -> None:
        path = self.root / key
        try:
            path.write_bytes(data)
        except FileNotFoundError:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)

    def exists(self, key: str) -> bool:
        return (self.root / key).exists()

    def children(self, key: str) -> list[str]:
        try:
            return sorted(d.name for d in os.scandir(self.root / key) if d.is_dir())
        except (FileNotFoundError, NotADirectoryError):
            return []

    def delete(self, key: str) -> None:
        shutil.rmtree(self.root / key, ignore_errors=True)

    def files(self) -> Iterator[str]:
        for dirpath, _, names in os.walk(self.root):
            rel = Path(dirpath).relative_to(self.root).as_posix()
            for name in names:
                yield name if rel == "." else f"{rel}/{name}"

    def empty(self) -> bool:
        """Nothing stored (an empty directory counts as nothing)."""
        return not self.root.exists() or (self.root.is_dir() and not any(self.root.iterdir()))


class FsspecStore:
    """An archive on an fsspec filesystem (object stores, ``memory://``); credentials and endpoints
    come from the filesystem's own configuration (environment variables, config files)."""

    def __init__(self, url: str) -> None:
        from fsspec.core import url_to_fs

        self.url = url
        self.fs, self.root = url_to_fs(url)

    def _path(self, key: str) -> str:
        return _join(self.root, key) if not self.root.startswith("/") else "/" + _join(self.root, key)

    def read(self, key: str) -> bytes:
        try:
            return self.fs.cat_file(self._path(key))
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.url}/{key}") from None

    def write(self, key: str, data: bytes) -> None:
        self.fs.pipe_file(self._path(key), data)

    write_new = write

    def _fresh(self, path: str) -> str:
        # Listings are cached per process (s3fs and others); other processes write the archive.
        self.fs.invalidate_cache(path)
        return path

    def exists(self, key: str) -> bool:
        return bool(self.fs.exists(self._fresh(self._path(key))))

    def children(self, key: str) -> list[str]:
        try:
            entries = self.fs.ls(self._fresh(self._path(key)), detail=True)
        except FileNotFoundError:
            return []
        return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "directory")

    def delete(self, key: str) -> None:
        path = self._fresh(self._path(key))
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def files(self) -> Iterator[str]:
        base = self._fresh(self._path("").rstrip("/"))
        for path in self.fs.find(base):
            yield path[len(base):].lstrip("/")

    def empty(self) -> bool:
        path = self._fresh(self._path(""))
        return not self.fs.exists(path) or not self.fs.find(path)


def open_store(location: str | Path) -> LocalStore | FsspecStore:
    """The store of an archive location: a path (or ``file://`` URL) is a local directory; any
    other URL is opened with fsspec."""
    text = str(location)
    if "://" in text and not text.startswith("file://"):
        return FsspecStore(text)
    return LocalStore(text.removeprefix("file://"))


def is_url(location: str | Path) -> bool:
    """Whether ``location`` names a non-local store."""
    text = str(location)
    return "://" in text and not text.startswith("file://")
