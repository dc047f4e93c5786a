"""Text of a call while the engine samples it: token callbacks in, text deltas out.

The engine calls :meth:`TokenStream.push` on its own thread as each token is sampled; the
proxy's event loop takes the tokens from the queue and turns them into the deltas it streams. A
delta never ends inside a character, and the last characters are held back while they could be
the start of a stop string (which the reply leaves out), so everything streamed is a prefix of
the reply's final text.
"""

from __future__ import annotations

import asyncio

import numpy as np


class TokenStream:
    """Tokens of one engine call, and the text streamed from them so far.

    Parameters
    ----------
    loop
        The event loop that reads :attr:`queue`.
    decode
        Token ids to text (special tokens left out), e.g. ``ChatRenderer.decode``.
    hold
        Characters kept back from the end (the longest stop string).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, decode, hold: int = 0) -> None:
        self.loop = loop
        self.decode = decode
        self.hold = int(hold)
        self.queue: asyncio.Queue[int] = asyncio.Queue()
        self.ids: list[int] = []
        self.sent = ""
        """Text streamed so far."""

    def push(self, token: int, logprob: float) -> None:
        """The engine's ``on_token`` (any thread)."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, int(token))

    def delta(self, token: int) -> str:
        """Take one token; the text that may be streamed now ("" when none)."""
        self.ids.append(token)
        text = self.decode(np.asarray(self.ids, dtype=np.int64)).rstrip("\ufffd")  # no half characters
        end = len(text) - self.hold
        if end <= len(self.sent) or not text.startswith(self.sent):
            return ""
        out = text[len(self.sent) : end]
        self.sent += out
        return out

    def rest(self, content: str) -> str:
        """What the final text adds to what was streamed.

        Raises
        ------
        RuntimeError
            The streamed text is not a prefix of ``content`` (nothing can put that right).
        """
        if not content.startswith(self.sent):
            raise RuntimeError("streamed text is not a prefix of the reply")
        return content[len(self.sent):]
