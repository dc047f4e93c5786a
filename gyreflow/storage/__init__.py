"""The zarr v3 trajectory archive: one per run, arrays and JSON only.

Driver side: ``create_archive`` / ``ArchiveWriter`` and ``commit_step``. Task side:
``write_executions`` (one segment per call, e.g. a task's samples; safe to call concurrently)
and ``write_execution`` (a segment of one). Reading:
``ArchiveReader`` and ``open_datatree``. The format is specified in ``storage/README.md``.
"""

from gyreflow.storage.reader import ArchiveReader, open_datatree, split_ragged
from gyreflow.storage.schema import SCHEMA_VERSION
from gyreflow.storage.writer import (
    ArchiveWriter,
    archive_path,
    commit_step,
    create_archive,
    execution_arrays,
    write_execution,
    write_executions,
)

__all__ = [
    "SCHEMA_VERSION",
    "ArchiveReader",
    "ArchiveWriter",
    "archive_path",
    "commit_step",
    "create_archive",
    "execution_arrays",
    "open_datatree",
    "split_ragged",
    "write_execution",
    "write_executions",
]
