"""An OpenAI-compatible proxy in front of gyreflow's engines.

Unmodified agent programs talk to it as to any OpenAI-compatible server; each execution has its
own session (base URL and key), and every model call is recorded token-exact: the prompt ids the
engine consumed, the ids it sampled, their behaviour log-probs and weights versions.

Modules: :mod:`.errors` (OpenAI-style errors), :mod:`.requests` (validation of request bodies),
:mod:`.toolcalls` (tool-call syntax of the model), :mod:`.render` (messages to prompt ids),
:mod:`.sessions` (sessions, budgets, records, retries), :mod:`.calls` (one model call, start to
record), :mod:`.responses` (OpenAI response objects and stream events), :mod:`.server` (HTTP),
:mod:`.plugin` (the proxy on a Dask worker).
"""

from gyreflow.proxy.errors import ApiError
from gyreflow.proxy.sessions import Budget, Session, SessionRegistry

__all__ = ["ApiError", "Budget", "Session", "SessionRegistry"]
