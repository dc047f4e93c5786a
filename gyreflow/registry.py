"""The one registry style of gyreflow: name -> implementation of one signature.

Advantage estimators and losses (:mod:`gyreflow.algo`) and placement modes
(:mod:`gyreflow.cluster.modes`) are registries of this kind; callers dispatch through
:meth:`Registry.get` and never branch on names themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class Registry(Generic[F]):
    """A named set of functions of one signature.

    Parameters
    ----------
    kind
        What the registry holds, used in error messages (``"advantage estimator"``).
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._fns: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator that registers a function under ``name``.

        Raises
        ------
        ValueError
            If ``name`` is already taken: silent replacement would make dispatch depend on
            import order.
        """

        def decorator(fn: F) -> F:
            if name in self._fns:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._fns[name] = fn
            return fn

        return decorator

    def unregister(self, name: str) -> F:
        """Remove ``name`` (e.g. an entry a test or an extension added for a while); what it held."""
        try:
            return self._fns.pop(name)
        except KeyError:
            raise ValueError(f"no {self.kind} {name!r} is registered") from None

    def get(self, name: str) -> F:
        """The function registered as ``name``.

        Raises
        ------
        ValueError
            For an unknown name; the message lists the allowed names.
        """
        try:
            return self._fns[name]
        except KeyError:
            allowed = ", ".join(repr(n) for n in self.names())
            raise ValueError(f"unknown {self.kind} {name!r}; allowed: {allowed}") from None

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._fns)

    def __contains__(self, name: object) -> bool:
        return name in self._fns

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()})"
