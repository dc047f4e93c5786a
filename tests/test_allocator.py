"""Cells keep reused tensor buffers on the heap although Dask's nanny fixes glibc's thresholds."""

import ctypes
import re
import sys
import tempfile

import numpy as np
import pytest
from distributed import Client

from gyreflow.cluster.cell import CellService
from gyreflow.cluster.local import PoolSpec, local_cluster

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc only")


def _mapped_chunks() -> int:
    """Chunks glibc has mmapped directly in this process (from ``malloc_info``)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.fopen.restype = ctypes.c_void_p
    with tempfile.NamedTemporaryFile() as f:
        fp = ctypes.c_void_p(libc.fopen(f.name.encode(), b"w"))
        libc.malloc_info(0, fp)
        libc.fclose(fp)
        xml = open(f.name).read()
    return int(re.search(r'<total type="mmap" count="(\d+)"', xml).group(1))


def _reused_buffer_is_mapped() -> bool:
    """Allocate and free a 4 MiB buffer a few times, as a training step does with its tensors;
    True when the last one was still mapped anew rather than taken from the heap."""
    for _ in range(4):
        before = _mapped_chunks()
        buf = np.ones(4 << 20, np.uint8)
        mapped = _mapped_chunks() > before
        del buf
    return mapped


def test_cells_take_reused_buffers_from_the_heap():
    with local_cluster(PoolSpec(rollout=1, trainer=1, execution_slots=2)) as cluster, Client(cluster) as client:
        # The nanny's environment alone: glibc's threshold is fixed, each buffer is mapped anew.
        assert all(client.run(_reused_buffer_is_mapped).values())
        client.register_plugin(CellService())
        assert not any(client.run(_reused_buffer_is_mapped).values())
