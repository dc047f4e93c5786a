"""Paged KV memory: keys and values in fixed-size blocks, and the block tables that own them.

:class:`KVBlocks` is the storage (one tensor each for keys and values); :class:`BlockAllocator`
is the bookkeeping: which blocks each request's table lists, reference counts for blocks shared
between requests of one session, and the retained tables of finished session requests that a
later request of the same session reuses (copy-on-write at the divergence point). A block size
equal to the longest sequence gives one block per request: the slot cache this replaces.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch


class KVBlocks:
    """Keys and values of every layer in ``num_blocks`` blocks of ``block_size`` positions.

    ``k`` and ``v`` are (L, NB, BS, Hkv, Dh). Memory is allocated uninitialised and each block is
    zeroed the first time it is handed out, so a large pool costs resident memory only once used.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.empty(shape, device=device, dtype=dtype)
        self.v = torch.empty(shape, device=device, dtype=dtype)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._ready = np.zeros(num_blocks, dtype=bool)  # blocks that hold finite values

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.k[:, 0].numel() * self.k.element_size()

    def prepare(self, blocks: list[int]) -> None:
        """Zero the blocks among ``blocks`` never used before, before anything reads them.

        Masked positions are still multiplied by a zero attention weight, and 0 * NaN from
        uninitialised memory would poison the output.
        """
        fresh = [b for b in blocks if not self._ready[b]]
        if fresh:
            idx = torch.tensor(fresh, device=self.k.device)
            self.k.index_fill_(1, idx, 0)
            self.v.index_fill_(1, idx, 0)
            self._ready[fresh] = True

    def copy(self, src: int, dst: int, n: int) -> None:
        """Copy the first ``n`` positions of block ``src`` into block ``dst`` (prepared first)."""
        self.prepare([dst])
        self.k[:, dst, :n] = self.k[:, src, :n]
        self.v[:, dst, :n] = self.v[:, src, :n]

    def read(self, blocks: list[int], n: int) -> np.ndarray:
        """The first ``n`` positions of a block table as one array (L, 2, Hkv, n, Dh) float32."""
        if n == 0:
            L, _, _, hkv, dh = self.k.shape
            return np.zeros((L, 2, hkv, 0, dh), dtype=np.float32)
        idx = torch.tensor(blocks[: -(-n // self.block_size)], device=self.k.device)
        L, _, bs, hkv, dh = self.k.shape
        k = self.k.index_select(1, idx).reshape(L, -1, hkv, dh)[:, :n]  # (L, n, Hkv, Dh)
        v = self.v.index_select(1, idx).reshape(L, -1, hkv, dh)[:, :n]
        kv = torch.stack([k, v], dim=1).transpose(2, 3)  # (L, 2, Hkv, n, Dh)
        return kv.float().cpu().numpy().copy()

    def write(self, blocks: list[int], kv: np.ndarray) -> None:
        """Store an array from :meth:`read` at the start of a block table."""
        n = kv.shape[3]
        if n == 0:
            return
        bs = self.block_size
        t = torch.from_numpy(np.ascontiguousarray(kv)).to(device=self.k.device, dtype=self.k.dtype)  # (L, 2, Hkv, n, Dh)
        t = t.transpose(2, 3)  # (L, 2, n, Hkv, Dh)
        for i, b in enumerate(blocks[: -(-n // bs)]):
            lo, hi = i * bs, min(n, (i + 1) * bs)
            self.k[:, b, : hi - lo] = t[:, 0, lo:hi]
            self.v[:, b, : hi - lo] = t[:, 1, lo:hi]


@dataclass
class _Retained:
    blocks: list[int]
    tokens: np.ndarray  # (N,) int32 whose KV the blocks hold
    version: int
    extended: bool = False
    """A request that continues the whole history shares (and writes past it in) the last block."""


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if len(diff) else m


class BlockAllocator:
    """Block tables of live requests and retained sessions, over a pool of ``num_blocks`` blocks.

    A block is free, or referenced by one or more tables (live requests, retained sessions). A
    request reusing a retained prefix shares its whole blocks; the partly filled last block is
    shared only with the first request that continues the whole history (it writes past the
    retained positions, never over them), and copied for any other (copy-on-write). Positions
    below a table's length are never written again, so sharing never changes what a table reads.
    When no block is free, retained sessions are evicted, least recently used first; when none is
    left, :meth:`grow` fails and the engine preempts a request.

    Blocks are placed so tables stay contiguous where they can (a run of consecutive blocks is
    read through a view, without a gather): a table grows into the block after its last when
    that is free, and otherwise starts a run in the middle of the largest free run, leaving room
    on both sides.

    Parameters
    ----------
    num_blocks, block_size
        Pool size and positions per block.
    retain_sessions
        Most finished sessions whose KV is kept for reuse (0: none).
    share_last_block
        Whether a request continuing a whole retained history shares its last block (else it
        is copied, as a cache of one slot per request did).
    """

    def __init__(self, num_blocks: int, block_size: int, retain_sessions: int, share_last_block: bool = True) -> None:
        self.share_last_block = bool(share_last_block)
        self.num_blocks = int(num_blocks)
        self.block_size = int(block_size)
        self.retain_sessions = int(retain_sessions)
        self._is_free = np.ones(self.num_blocks, dtype=bool)
        self._n_free = self.num_blocks
        self._refs = [0] * self.num_blocks
        self.taken: list[int] = []
        """Blocks handed out since the caller last emptied this list (to prepare them)."""
        self._tables: dict[str, list[int]] = {}
        self._retained: OrderedDict[str, _Retained] = OrderedDict()
        self.peak_used = 0
        """Most blocks referenced at once (live and retained)."""

    # ------------------------------------------------------------------ queries

    def blocks_for(self, n_tokens: int) -> int:
        return -(-int(n_tokens) // self.block_size)

    @property
    def used(self) -> int:
        return self.num_blocks - self._n_free

    @property
    def retained_sessions(self) -> int:
        return len(self._retained)

    def table(self, request_id: str) -> list[int]:
        """The block table of a live request (a live list: do not modify)."""
        return self._tables[request_id]

    # ------------------------------------------------------------------ live tables

    def open(self, request_id: str) -> None:
        """Start an empty table for a request."""
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already has a block table")
        self._tables[request_id] = []

    def grow(self, request_id: str, n_tokens: int) -> bool:
        """Make the request's table cover ``n_tokens`` positions; False when the pool is exhausted
        (the blocks already added stay in the table)."""
        table = self._tables[request_id]
        while len(table) * self.block_size < n_tokens:
            b = self._take(table[-1] + 1 if table else None)
            if b is None:
                return False
            table.append(b)
        return True

    def close(self, request_id: str) -> None:
        """Drop a request's table, freeing every block no other table references."""
        self._release(self._tables.pop(request_id, []))

    # ------------------------------------------------------------------ sessions

    def retain(self, request_id: str, session: str, tokens: np.ndarray, version: int) -> None:
        """Close a finished request's table, keeping its blocks for ``tokens`` under ``session``."""
        table = self._tables.pop(request_id)
        keep = self.blocks_for(len(tokens))
        self._release(table[keep:])
        old = self._retained.pop(session, None)
        if old is not None:
            self._release(old.blocks)
        if self.retain_sessions <= 0 or keep == 0:
            self._release(table[:keep])
            return
        self._retained[session] = _Retained(table[:keep], np.asarray(tokens, dtype=np.int32), int(version))
        while len(self._retained) > self.retain_sessions:
            self._release(self._retained.popitem(last=False)[1].blocks)

    def share(self, request_id: str, session: str, seq: np.ndarray, version: int,
              copy: Callable[[int, int, int], None]) -> int:
        """Start a request's table with the longest prefix of ``seq`` that ``session`` retains.

        Whole blocks are shared; a partly matching block is copied into a new block with
        ``copy(src, dst, n)``. At least one token of ``seq`` is left uncached (its logits are
        needed). Returns the number of positions reused (0 when nothing matches).
        """
        entry = self._retained.get(session)
        table = self._tables[request_id]
        if entry is None or entry.version != version or table:
            return 0
        self._retained.move_to_end(session)
        reuse = min(common_prefix(entry.tokens, seq), len(seq) - 1)
        full, partial = divmod(reuse, self.block_size)
        for b in entry.blocks[:full]:
            self._refs[b] += 1
            table.append(b)
        if partial and self.share_last_block and reuse == len(entry.tokens) and not entry.extended:
            entry.extended = True  # this request writes past the history in the shared block
            self._refs[entry.blocks[full]] += 1
            table.append(entry.blocks[full])
        elif partial:
            src = entry.blocks[full]
            self._refs[src] += 1  # held while a new block is taken: eviction must not free it
            dst = self._take()
            if dst is None:
                partial = 0
            else:
                copy(src, dst, partial)
                table.append(dst)
            self._release([src])
        return full * self.block_size + partial

    def drop_retained(self) -> None:
        """Forget every retained session (their weights version is gone)."""
        while self._retained:
            self._release(self._retained.popitem()[1].blocks)

    # ------------------------------------------------------------------ blocks

    def _take(self, prefer: int | None = None) -> int | None:
        while not self._n_free and self._retained:
            self._release(self._retained.popitem(last=False)[1].blocks)
        if not self._n_free:
            return None
        if prefer is not None and prefer < self.num_blocks and self._is_free[prefer]:
            b = prefer
        else:
            b = self._middle_of_largest_free_run()
        self._is_free[b] = False
        self._n_free -= 1
        self._refs[b] = 1
        self.taken.append(b)
        self.peak_used = max(self.peak_used, self.used)
        return b

    def _middle_of_largest_free_run(self) -> int:
        edges = np.diff(np.concatenate([[0], self._is_free.view(np.int8), [0]]))
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        i = int(np.argmax(ends - starts))
        start, end = int(starts[i]), int(ends[i])
        # A run at the pool's start is taken from its start: nothing before it can grow into it.
        return start if start == 0 else (start + end) // 2

    def _release(self, blocks: list[int]) -> None:
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._is_free[b] = True
                self._n_free += 1
