"""Call roles, their training priority, and the rule that names a call's role when no one did.

Bounded path sampling (:meth:`~gyreflow.trajectory.tree.TrajectoryTree.sample_paths`) takes paths
of the highest-priority role first: ``main`` > ``main-summary`` > ``sub-agent`` >
``sub-agent-summary``. :func:`register_role` adds a role; names from earlier releases read as
their current ones (``policy`` is ``main``); a role nobody registered ranks last.

The rule for a call that names no role (an agent program without the ``X-Gyreflow-Role`` header):

- it is a ``sub-agent`` call if its prompt does not begin with the execution's first prompt (a
  different system prompt or task), a ``main`` call otherwise;
- it is a *summary* (``main-summary``, ``sub-agent-summary``) if nothing continues it (its sequence
  ends at a leaf of the tree), a later call does, and its completion reappears inside a later
  call's prompt: the agent compacted its context into it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MAIN, MAIN_SUMMARY, SUB_AGENT, SUB_AGENT_SUMMARY = "main", "main-summary", "sub-agent", "sub-agent-summary"

_PRIORITY: dict[str, int] = {MAIN: 0, MAIN_SUMMARY: 1, SUB_AGENT: 2, SUB_AGENT_SUMMARY: 3}
_ALIASES = {"policy": MAIN, "summarizer": MAIN_SUMMARY, "subagent": SUB_AGENT}


def register_role(name: str, priority: int) -> None:
    """Add a role; lower ``priority`` trains first (``main`` is 0, ``sub-agent-summary`` 3)."""
    if not name or name in _PRIORITY or name in _ALIASES:
        raise ValueError(f"role {name!r} is empty or already known")
    _PRIORITY[name] = int(priority)


def canonical(role: str) -> str:
    """The current name of ``role`` (``policy`` -> ``main``)."""
    return _ALIASES.get(role, role)


def priority(role: str) -> int:
    """Training priority class of ``role`` (lower first); unregistered roles rank last."""
    return _PRIORITY.get(canonical(role), max(_PRIORITY.values()) + 1)


def _contains(hay: np.ndarray, needle: np.ndarray) -> bool:
    """Whether int32 ``needle`` occurs as a contiguous run in ``hay``."""
    h, n = hay.astype(np.int32).tobytes(), needle.astype(np.int32).tobytes()
    at = h.find(n)
    while at >= 0 and at % 4:
        at = h.find(n, at + 1)
    return at >= 0


def infer_roles(calls: Sequence, ends_at_leaf: Sequence[bool]) -> list[str]:
    """Roles of ``calls`` (sorted by ``call_index``), by the rule in the module docstring where a
    call names none; ``ends_at_leaf[i]``: nothing continues call ``i``'s sequence."""
    if not calls:
        return []
    first = calls[0].prompt_ids
    out = []
    for i, c in enumerate(calls):
        if c.role:
            out.append(canonical(c.role))
            continue
        p = c.prompt_ids
        main = len(p) >= len(first) and np.array_equal(p[: len(first)], first)
        summary = (bool(ends_at_leaf[i]) and i < len(calls) - 1 and len(c.completion_ids) > 0
                   and any(_contains(d.prompt_ids, c.completion_ids) for d in calls[i + 1:]))
        out.append((MAIN_SUMMARY if summary else MAIN) if main else (SUB_AGENT_SUMMARY if summary else SUB_AGENT))
    return out
