"""Gradient shares reduced where they are computed: one running sum per trainer cell per step.

A share task adds its gradient into its cell's sum for the step (:class:`CellSums`) and returns
the share without gradients; the step's update takes one sum from each cell that holds some
(:func:`merge` of what it receives), so a step's reduction holds O(parameters x trainer cells),
not O(parameters x shares). Sums are keyed by the share's task key: a share added twice counts once.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from gyreflow.engine.wire import array_to_msg, msg_to_array


@dataclass
class GradientShare:
    """One share of a step's gradient work (``Trainer.gradients``), summed by
    ``Trainer.apply_gradients``."""

    grads: dict[str, np.ndarray] | None
    """Weight-summed gradient of the loss over the share's samples, by parameter name; ``None``
    once it was added to its cell's running sum (:mod:`gyreflow.train.reduce`)."""
    tokens: int
    """Samples trained."""
    weight: float
    """Their total loss weight (the step divides by the sum over its shares)."""
    sums: dict[str, float]
    """Weight-summed metrics of the loss."""
    oldest: int | None
    """Oldest weights version of a trained sample."""
    stale_masked: int
    """Samples left out as staler than the bound."""
    padded_tokens: int
    version: int
    """Weights version the gradient was taken at."""
    train_s: float = 0.0
    worker: str = ""
    """The cell that computed it (and holds its gradient once summed there)."""
    count: int = 1
    """Shares summed into this one."""
    key: str = ""
    """Task key of the share, once its gradient is held in its cell's sum."""
    probe: list = field(default_factory=list)
    """A few of the share's samples (:class:`~gyreflow.train.packing.PathSample`), on which the
    update measures how far it moves the policy; never summed."""


def merge(shares: list[GradientShare]) -> GradientShare:
    """One share whose gradient, counts and metric sums are those of ``shares`` together (all
    computed at one weights version); the inputs are left as they were."""
    if not shares:
        raise ValueError("nothing to merge")
    total = replace(shares[0], grads={n: np.array(g, dtype=np.float32, copy=True)
                                      for n, g in (shares[0].grads or {}).items()}, sums=dict(shares[0].sums))
    for s in shares[1:]:
        absorb(total, s)
    return total


def absorb(total: GradientShare, share: GradientShare) -> None:
    """Add ``share`` into ``total`` in place (its gradient arrays included)."""
    if share.version != total.version:
        raise ValueError(f"gradient shares of weights versions {total.version} and {share.version} cannot be summed")
    if total.grads is None or share.grads is None:
        raise ValueError("a gradient share without its gradient cannot be summed")
    for name, g in share.grads.items():
        if name in total.grads:
            total.grads[name] += g
        else:
            total.grads[name] = np.array(g, dtype=np.float32, copy=True)
    for k, v in share.sums.items():
        total.sums[k] = total.sums.get(k, 0.0) + v
    total.tokens += share.tokens
    total.weight += share.weight
    total.oldest = min((v for v in (total.oldest, share.oldest) if v is not None), default=None)
    total.stale_masked += share.stale_masked
    total.padded_tokens += share.padded_tokens
    total.train_s += share.train_s
    total.count += share.count


@dataclass
class _Sum:
    share: GradientShare | None = None
    keys: set[str] = field(default_factory=set)


class CellSums:
    """The running gradient sums of one cell, by (run, weights version): one per step."""

    def __init__(self) -> None:
        self._sums: dict[tuple[str, int], _Sum] = {}
        self._lock = threading.Lock()  # share tasks run in the worker's thread pool

    def add(self, run: str, key: str, share: GradientShare) -> GradientShare:
        """Add ``share`` (the task ``key``'s) to this cell's sum for its step; returns it without
        its gradient, naming this cell as the holder (``share.worker``)."""
        with self._lock:
            for other in [k for k in self._sums if k[0] != run]:  # a new run on the cell: old sums are dead
                del self._sums[other]
            acc = self._sums.setdefault((run, share.version), _Sum())
            if key not in acc.keys:
                if acc.share is None:
                    acc.share = replace(share, sums=dict(share.sums), probe=[])  # its own arrays: summed in place
                else:
                    absorb(acc.share, share)
                acc.keys.add(key)
        return replace(share, grads=None, key=key)

    def take(self, run: str, version: int, keys: list[str]) -> GradientShare:
        """The sum of exactly the shares ``keys`` of the step at ``version``, removed from the cell.

        Raises
        ------
        KeyError
            If the cell holds no sum for that step, or not exactly those shares (one was lost, or
            recomputed elsewhere).
        """
        with self._lock:
            acc = self._sums.get((run, version))
            if acc is None or acc.keys != set(keys):
                held = sorted(acc.keys) if acc else []
                raise KeyError(f"this cell holds gradient shares {held} of version {version}, not {sorted(keys)}")
            del self._sums[(run, version)]
            return acc.share

    def __len__(self) -> int:
        return len(self._sums)


def share_to_msg(share: GradientShare) -> dict:
    """A share as a message for Dask comms: gradients as bytes frames, the rest plain."""
    return asdict(replace(share, grads=None)) | {"grads": {n: array_to_msg(g) for n, g in (share.grads or {}).items()}}


def msg_to_share(msg: dict) -> GradientShare:
    return GradientShare(**(msg | {"grads": {n: msg_to_array(m) for n, m in msg["grads"].items()}}))
