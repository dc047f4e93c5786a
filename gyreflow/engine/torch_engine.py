"""The torch engine: continuous batching over a slot-indexed KV cache, on CPU or GPU.

Every live request owns one cache slot; live slots are always ``0 .. n-1`` (a finishing request's
slot is refilled by the last one), so a decode iteration reads the cache through a view, with no
gather. Each iteration first admits waiting requests and prefills their uncached tokens, then
decodes one token for every live request in a single batched forward. Sessions leave their KV in a
small LRU of retained slots, from which a later request of the same session copies the longest
common prefix instead of recomputing it.

Thread model: ``step`` runs on one thread at a time (usually an
:class:`~gyreflow.engine.runner.EngineRunner`); ``submit``, ``load_weights``, ``export_request``,
``import_request`` and ``stats`` may be called from any thread. Weights swap and requests leave only between iterations.
"""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from gyreflow.engine.base import (
    GenerationRequest,
    GenerationResult,
    LiveRequestState,
    IMPORTED_PRIORITY,
    RequestExported,
    SamplingParams,
    WorkSignal,
    take_next,
)
from gyreflow.engine.forward import KVCache, ModelSpec, ModelWeights, build_weights, forward, rope_tables, sample_tokens

LogitsHook = Callable[[list[str], torch.Tensor], None]


@dataclass(eq=False)
class _Request:
    """Mutable state of one request inside the engine."""

    request_id: str
    prompt: np.ndarray  # (P,) int32
    params: SamplingParams
    session: str | None
    future: Future
    generator: torch.Generator
    seq: list[int]
    """Prompt then completion ids."""
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    text: bytearray = field(default_factory=bytearray)
    """Completion bytes (ids < 256), for stop strings."""
    n_cached: int = 0
    """Leading tokens of ``seq`` whose KV is in this request's slot."""
    prefix_reused: int = 0
    kv_in: np.ndarray | None = None
    """KV brought by ``import_request``, written into the slot on admission."""
    priority: float = 0.0

    @property
    def n_prompt(self) -> int:
        return len(self.prompt)

    @property
    def completion(self) -> list[int]:
        return self.seq[len(self.prompt) :]


@dataclass
class _Retained:
    """A finished session request's KV, kept in a retained slot."""

    slot: int
    tokens: np.ndarray  # (N,) int32 whose KV the slot holds
    version: int


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if len(diff) else m


class TorchEngine(WorkSignal):
    """A Llama policy served with continuous batching by a functional torch forward.

    Parameters
    ----------
    model
        A Hugging Face ``LlamaForCausalLM`` (e.g. :func:`gyreflow.model.build_policy`); its weights
        are copied, the module itself is not kept.
    max_batch
        Most requests decoded together (live slots).
    max_seq_len
        Longest prompt + completion; the KV cache holds this many positions per slot. Defaults to
        ``min(max_position_embeddings, 2048)``.
    device
        Torch device of weights and cache (``"cpu"``, ``"cuda"``, ``"cuda:1"`` ...).
    name
        Address or name written into every result's ``engine`` field.
    version
        Weights version of ``model``'s weights.
    retain_slots
        Extra cache slots that keep finished sessions' KV for prefix reuse (LRU); 0 disables
        reuse. Defaults to ``max(1, max_batch // 4)``.
    prefill_chunk
        Most tokens of one request per prefill forward (longer prompts go in chunks).
    prefill_batch_tokens
        Most padded tokens per prefill forward; admitted requests are grouped under it.
    dtype
        Weights and cache precision; logits and sampling are always float32/float64.
    logits_hook
        Called as ``hook(request_ids, logits)`` with the (B, V) float32 logits of every sampling
        call, for tests and debugging.
    """

    def __init__(
        self,
        model,
        *,
        max_batch: int = 64,
        max_seq_len: int | None = None,
        device: str | torch.device | None = None,
        name: str = "torch",
        version: int = 0,
        retain_slots: int | None = None,
        prefill_chunk: int = 512,
        prefill_batch_tokens: int = 4096,
        dtype: torch.dtype = torch.float32,
        logits_hook: LogitsHook | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self.spec = ModelSpec.from_hf_config(model.config)
        self.device = torch.device(device if device is not None else "cpu")
        self.dtype = dtype
        self.name = name
        self.version = int(version)
        self.max_batch = int(max_batch)
        self.max_seq_len = int(max_seq_len or min(model.config.max_position_embeddings, 2048))
        self.retain_slots = int(max(1, max_batch // 4) if retain_slots is None else retain_slots)
        self.prefill_chunk = max(1, int(prefill_chunk))
        self.prefill_batch_tokens = max(1, int(prefill_batch_tokens))
        self.logits_hook = logits_hook

        with torch.inference_mode():
            self._weights: ModelWeights = build_weights(model.state_dict(), self.spec, self.device, dtype)
            self._rope = rope_tables(self.spec, self.max_seq_len, self.device)
            self._cache = KVCache.allocate(self.spec, self.max_batch + self.retain_slots, self.max_seq_len, self.device, dtype)

        # _lock guards the queue, the id table, staged weights and finished futures; _step_lock is
        # held for a whole iteration, so whoever holds it sees the engine between iterations.
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._step_lock = threading.RLock()
        self._waiting: deque[_Request] = deque()
        self._ids: dict[str, _Request] = {}
        self._staged: tuple[ModelWeights, int] | None = None
        self._rows: list[_Request] = []  # live requests; index = cache slot
        self._retained: OrderedDict[str, _Retained] = OrderedDict()
        self._free_retained = list(range(self.max_batch + self.retain_slots - 1, self.max_batch - 1, -1))
        self._done: list[tuple[Future, GenerationResult | BaseException]] = []
        self._counters = dict(
            tokens_generated=0, iterations=0, prefill_tokens=0, reused_tokens=0, finished=0, exported=0, imported=0
        )

    @classmethod
    def from_checkpoint(cls, path: str | Path, **kwargs) -> "TorchEngine":
        """An engine for a Hugging Face checkpoint directory (see :func:`gyreflow.model.load_policy`)."""
        from gyreflow.model.policy import load_policy

        return cls(load_policy(path), **kwargs)

    # ------------------------------------------------------------------ requests in

    def submit(self, request: GenerationRequest) -> Future:
        """Queue a request; the future resolves to its :class:`GenerationResult`.

        Raises
        ------
        ValueError
            Bad prompt or parameters, or a request with this id is already in the engine.
        """
        prompt = np.asarray(request.prompt_ids, dtype=np.int32).reshape(-1).copy()
        params = request.params
        self._check(request.request_id, prompt, params)
        gen = torch.Generator(device="cpu")
        gen.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
        req = _Request(request.request_id, prompt, params, request.session, Future(), gen, seq=prompt.tolist(),
                       priority=float(request.priority))
        self._enqueue(req, front=False)
        return req.future

    def import_request(self, state: LiveRequestState) -> Future:
        """Resume a request exported by ``export_request`` (of this or another engine).

        It continues ahead of requests that never started. The future resolves to the full
        result: the completion includes the tokens sampled before the move.
        """
        prompt = np.asarray(state.prompt_ids, dtype=np.int32).reshape(-1).copy()
        completion = np.asarray(state.completion_ids, dtype=np.int32).reshape(-1)
        self._check(state.request_id, prompt, state.params)
        kv = np.asarray(state.kv)
        n_seq = len(prompt) + len(completion)
        n_kv = kv.shape[3] if kv.ndim == 5 else 0
        if n_kv:
            s = self.spec
            want = (s.num_layers, 2, s.num_kv_heads, n_kv, s.head_dim)
            if kv.shape != want:
                raise ValueError(f"imported KV has shape {kv.shape}, this engine needs {want}")
        if n_kv >= n_seq:
            raise ValueError(f"imported KV covers {n_kv} of {n_seq} tokens; the last token must be uncached")
        if len(completion) >= state.params.max_tokens or n_seq > self.max_seq_len:
            raise ValueError(f"request {state.request_id!r} is already complete or too long for this engine")
        gen = torch.Generator(device="cpu")
        gen.set_state(torch.from_numpy(np.asarray(state.generator_state, dtype=np.uint8).copy()))
        req = _Request(
            state.request_id,
            prompt,
            state.params,
            state.session,
            Future(),
            gen,
            seq=prompt.tolist() + completion.tolist(),
            logprobs=[float(x) for x in np.asarray(state.logprobs, dtype=np.float32)],
            versions=[int(x) for x in np.asarray(state.versions)],
            text=bytearray(int(t) for t in completion if t < 256),
            prefix_reused=int(state.prefix_reused),
            kv_in=kv if n_kv else None,
            priority=IMPORTED_PRIORITY,
        )
        self._enqueue(req, front=True)
        with self._lock:
            self._counters["imported"] += 1
        return req.future

    def _check(self, request_id: str, prompt: np.ndarray, params: SamplingParams) -> None:
        if len(prompt) == 0:
            raise ValueError(f"request {request_id!r}: empty prompt")
        if len(prompt) >= self.max_seq_len:
            raise ValueError(f"request {request_id!r}: prompt of {len(prompt)} tokens, engine holds {self.max_seq_len}")
        if prompt.min() < 0 or prompt.max() >= self.spec.vocab_size:
            raise ValueError(f"request {request_id!r}: token id out of range [0, {self.spec.vocab_size})")
        if params.max_tokens < 1:
            raise ValueError(f"request {request_id!r}: max_tokens must be at least 1")
        if not 0.0 < params.top_p <= 1.0:
            raise ValueError(f"request {request_id!r}: top_p must be in (0, 1]")
        if params.temperature < 0:
            raise ValueError(f"request {request_id!r}: negative temperature")

    def _enqueue(self, req: _Request, front: bool) -> None:
        with self._work:
            if req.request_id in self._ids:
                raise ValueError(f"request {req.request_id!r} is already in this engine")
            self._ids[req.request_id] = req
            if front:
                self._waiting.appendleft(req)
            else:
                self._waiting.append(req)
            self._work.notify_all()

    # ------------------------------------------------------------------ requests out

    def export_request(self, request_id: str) -> LiveRequestState:
        """Take a waiting or in-flight request out of this engine, between iterations.

        Its ``submit`` (or ``import_request``) future resolves with :class:`RequestExported`.

        Raises
        ------
        KeyError
            No such request here (never submitted, finished, or already exported).
        """
        with self._step_lock, torch.inference_mode():
            with self._lock:
                req = self._ids.pop(request_id, None)
                if req is None:
                    raise KeyError(f"no request {request_id!r} in engine {self.name}")
                waiting = req in self._waiting
                if waiting:
                    self._waiting.remove(req)
                self._counters["exported"] += 1
            if waiting:
                kv = req.kv_in if req.kv_in is not None else self._empty_kv()
            else:
                slot = self._rows.index(req)
                kv = self._cache.read(slot, req.n_cached)
                self._remove_row(slot)
        state = LiveRequestState(
            request_id=req.request_id,
            prompt_ids=req.prompt.copy(),
            completion_ids=np.asarray(req.completion, dtype=np.int32),
            logprobs=np.asarray(req.logprobs, dtype=np.float32),
            versions=np.asarray(req.versions, dtype=np.int32),
            params=req.params,
            session=req.session,
            generator_state=req.generator.get_state().numpy().copy(),
            kv=kv,
            prefix_reused=req.prefix_reused,
            source=self.name,
            source_version=self.version,
        )
        req.future.set_exception(RequestExported(request_id))
        return state

    def request_ids(self) -> list[str]:
        """Ids of the requests in this engine, live or waiting (what a migration moves)."""
        with self._lock:
            return list(self._ids)

    def _empty_kv(self) -> np.ndarray:
        s = self.spec
        return np.zeros((s.num_layers, 2, s.num_kv_heads, 0, s.head_dim), dtype=np.float32)

    # ------------------------------------------------------------------ weights

    def load_weights(self, weights: dict[str, np.ndarray], version: int) -> None:
        """Stage a new weight set; it takes effect at the start of the next iteration.

        The arrays are validated and copied to the device here, on the caller's thread, so the
        swap itself costs the engine nothing. Retained session KV of older versions is dropped
        when it applies; requests in flight keep their KV and continue under the new weights.
        """
        with torch.inference_mode():
            built = build_weights(weights, self.spec, self.device, self.dtype)
        with self._work:
            self._staged = (built, int(version))
            self._work.notify_all()

    def _apply_staged(self) -> None:
        with self._lock:
            staged, self._staged = self._staged, None
        if staged is None:
            return
        self._weights, self.version = staged
        while self._retained:
            self._free_retained.append(self._retained.popitem()[1].slot)

    # ------------------------------------------------------------------ the loop

    def has_work(self) -> bool:
        """Whether ``step`` would do anything: live or waiting requests, or staged weights."""
        return bool(self._rows or self._waiting or self._staged is not None)

    def step(self) -> int:
        """One iteration: apply staged weights, admit and prefill, decode every live request.

        Returns
        -------
        int
            Tokens sampled in this iteration.
        """
        produced = 0
        try:
            with self._step_lock, torch.inference_mode():
                try:
                    self._apply_staged()
                    admitted = self._admit()
                    if admitted:
                        produced += self._prefill([r for r in admitted if len(r.seq) - r.n_cached > 1])
                    if self._rows:
                        produced += self._decode()
                    with self._lock:
                        self._counters["iterations"] += 1
                        self._counters["tokens_generated"] += produced
                except BaseException as exc:
                    self._fail_live(exc)
                    raise
        finally:
            self._resolve_done()
        return produced

    def drain(self, max_steps: int | None = None) -> int:
        """Step until no work is left (or ``max_steps``); return tokens sampled."""
        total, n = 0, 0
        while self.has_work() and (max_steps is None or n < max_steps):
            total += self.step()
            n += 1
        return total

    def _admit(self) -> list[_Request]:
        admitted = []
        with self._lock:
            while self._waiting and len(self._rows) < self.max_batch:
                req = take_next(self._waiting)
                self._rows.append(req)
                admitted.append(req)
        first = len(self._rows) - len(admitted)
        for i, req in enumerate(admitted):
            self._place(req, first + i)
        return admitted

    def _place(self, req: _Request, slot: int) -> None:
        """Fill a newly assigned slot with whatever KV the request can reuse."""
        if req.kv_in is not None:
            self._cache.write(slot, req.kv_in)
            req.n_cached, req.kv_in = req.kv_in.shape[3], None
            return
        entry = self._retained.get(req.session) if req.session is not None else None
        if entry is None or entry.version != self.version:
            return
        # At least one token must be fed to get next-token logits.
        reuse = min(_common_prefix(entry.tokens, req.prompt), len(req.seq) - 1)
        self._retained.move_to_end(req.session)
        if reuse > 0:
            self._cache.move(entry.slot, slot, reuse)
            req.n_cached = req.prefix_reused = reuse
            with self._lock:
                self._counters["reused_tokens"] += reuse

    def _prefill(self, rows: list[_Request]) -> int:
        """Feed every uncached token of ``rows``, in chunks, and sample after each row's last."""
        produced = 0
        finished: list[tuple[_Request, str]] = []
        # Slots stay put until the retirements at the end of the phase.
        slot_of = {id(r): i for i, r in enumerate(self._rows)}
        for group in self._prefill_groups(rows):
            pending = group
            while pending:
                n_new = [min(len(r.seq) - r.n_cached, self.prefill_chunk) for r in pending]
                width = max(n_new)
                toks = [r.seq[r.n_cached : r.n_cached + n] + [0] * (width - n) for r, n in zip(pending, n_new)]
                logits = forward(
                    self._weights,
                    self.spec,
                    self._cache,
                    self._rope,
                    self._slots_arg([slot_of[id(r)] for r in pending]),
                    torch.tensor(toks, device=self.device),  # (B, T)
                    torch.tensor([r.n_cached for r in pending], device=self.device),  # (B,)
                    torch.tensor(n_new, device=self.device),  # (B,)
                    t_keys=max(r.n_cached + n for r, n in zip(pending, n_new)),
                )  # (B, V)
                for r, n in zip(pending, n_new):
                    r.n_cached += n
                with self._lock:
                    self._counters["prefill_tokens"] += sum(n_new)
                ready = [i for i, r in enumerate(pending) if r.n_cached == len(r.seq)]
                rest = [r for r in pending if r.n_cached < len(r.seq)]
                if ready:
                    rows_ready = [pending[i] for i in ready]
                    logits_ready = logits if len(ready) == len(pending) else logits[torch.tensor(ready, device=self.device)]
                    finished += self._sample_and_append(rows_ready, logits_ready)
                    produced += len(rows_ready)
                pending = rest
        if finished:
            self._retire(finished)
        return produced

    def _slots_arg(self, slots: list[int]) -> slice | torch.Tensor:
        """Cache slots for :func:`forward`: a slice when they are consecutive, else an index tensor.

        Admitted requests take consecutive slots, so a prefill batch in slot order usually reads
        its keys through a view instead of gathering them.
        """
        lo = slots[0]
        if slots == list(range(lo, lo + len(slots))):
            return slice(lo, lo + len(slots))
        return torch.tensor(slots, device=self.device)  # (B,)

    def _prefill_groups(self, rows: list[_Request]) -> list[list[_Request]]:
        """Split ``rows`` into batches whose padded size fits ``prefill_batch_tokens``.

        Rows are grouped by length (less padding), then each group is put back in slot order.
        """
        slot_of = {id(r): i for i, r in enumerate(self._rows)}
        groups: list[list[_Request]] = []
        group: list[_Request] = []
        width = 0
        for r in sorted(rows, key=lambda r: len(r.seq) - r.n_cached):
            w = min(len(r.seq) - r.n_cached, self.prefill_chunk)
            if group and (len(group) + 1) * max(width, w) > self.prefill_batch_tokens:
                groups.append(group)
                group, width = [], 0
            group.append(r)
            width = max(width, w)
        if group:
            groups.append(group)
        return [sorted(g, key=lambda r: slot_of[id(r)]) for g in groups]

    def _decode(self) -> int:
        """One token for every live request, in one forward over slots ``0 .. n-1``."""
        rows = self._rows
        n = len(rows)
        tokens = torch.tensor([r.seq[-1] for r in rows], device=self.device).view(n, 1)  # (B, 1)
        starts = torch.tensor([r.n_cached for r in rows], device=self.device)  # (B,)
        t_keys = max(r.n_cached for r in rows) + 1
        logits = forward(self._weights, self.spec, self._cache, self._rope, slice(0, n), tokens, starts, t_keys=t_keys)  # (B, V)
        for r in rows:
            r.n_cached += 1
        finished = self._sample_and_append(list(rows), logits)
        if finished:
            self._retire(finished)
        return n

    def _sample_and_append(self, rows: list[_Request], logits: torch.Tensor) -> list[tuple[_Request, str]]:
        """Sample one token per row and record it; return the rows that finished, with why."""
        if self.logits_hook is not None:
            self.logits_hook([r.request_id for r in rows], logits.detach().clone())
        temps = [float(r.params.temperature) for r in rows]
        draws = [
            torch.rand((), generator=r.generator, dtype=torch.float64).item() if t > 0 else 0.0 for r, t in zip(rows, temps)
        ]
        tokens, logprobs = sample_tokens(
            logits,
            torch.tensor(temps, dtype=torch.float32, device=logits.device),
            torch.tensor([float(r.params.top_p) for r in rows], dtype=torch.float64, device=logits.device),
            torch.tensor(draws, dtype=torch.float64, device=logits.device),
        )
        version = self.version
        finished: list[tuple[_Request, str]] = []
        for r, tok, lp in zip(rows, tokens.tolist(), logprobs.tolist()):
            r.seq.append(tok)
            r.logprobs.append(lp)
            r.versions.append(version)
            reason = self._finish_reason(r, tok)
            if reason is not None:
                finished.append((r, reason))
        return finished

    def _finish_reason(self, r: _Request, tok: int) -> str | None:
        p = r.params
        if tok in p.stop_token_ids:
            return "stop"
        if tok < 256:
            r.text.append(tok)
            if p.stop and any(s and r.text.endswith(s.encode("utf-8")) for s in p.stop):
                return "stop"
        if len(r.seq) - r.n_prompt >= p.max_tokens or len(r.seq) >= self.max_seq_len:
            return "length"
        return None

    def _retire(self, finished: list[tuple[_Request, str]]) -> None:
        slot_of = {id(r): i for i, r in enumerate(self._rows)}
        # Highest slot first: a row moved down to fill a hole is never one still to be retired.
        for r, reason in sorted(finished, key=lambda x: -slot_of[id(x[0])]):
            slot = slot_of[id(r)]
            if r.session is not None and self.retain_slots > 0 and r.n_cached > 0:
                self._retain(r, slot)
            self._remove_row(slot)
            result = GenerationResult(
                request_id=r.request_id,
                prompt_ids=r.prompt,
                completion_ids=np.asarray(r.completion, dtype=np.int32),
                logprobs=np.asarray(r.logprobs, dtype=np.float32),
                versions=np.asarray(r.versions, dtype=np.int32),
                finish_reason=reason,
                engine=self.name,
                prefix_reused=r.prefix_reused,
            )
            with self._lock:
                self._ids.pop(r.request_id, None)
                self._counters["finished"] += 1
                self._done.append((r.future, result))

    def _retain(self, r: _Request, slot: int) -> None:
        entry = self._retained.pop(r.session, None)
        if entry is not None:
            dst = entry.slot
        elif self._free_retained:
            dst = self._free_retained.pop()
        else:
            dst = self._retained.popitem(last=False)[1].slot  # least recently used
        self._cache.move(slot, dst, r.n_cached)
        self._retained[r.session] = _Retained(dst, np.asarray(r.seq[: r.n_cached], dtype=np.int32), self.version)

    def _remove_row(self, slot: int) -> None:
        """Free a live slot, moving the last live request into it to keep slots contiguous."""
        last = len(self._rows) - 1
        if slot != last:
            moved = self._rows[last]
            self._cache.move(last, slot, moved.n_cached)
            self._rows[slot] = moved
        self._rows.pop()

    def _fail_live(self, exc: BaseException) -> None:
        with self._lock:
            for r in self._rows:
                self._ids.pop(r.request_id, None)
                self._done.append((r.future, exc))
        self._rows.clear()

    def _resolve_done(self) -> None:
        # Outside the step lock: a future's callbacks may submit or export.
        with self._lock:
            done, self._done = self._done, []
        for fut, outcome in done:
            if isinstance(outcome, BaseException):
                fut.set_exception(outcome)
            else:
                fut.set_result(outcome)

    # ------------------------------------------------------------------ introspection

    def stats(self) -> dict:
        """Counters and occupancy: live, waiting, version, tokens generated, iterations, ..."""
        with self._lock:
            out = dict(self._counters)
            out.update(
                name=self.name,
                live=len(self._rows),
                waiting=len(self._waiting),
                version=self.version,
                staged_version=self._staged[1] if self._staged is not None else None,
                max_batch=self.max_batch,
                retained_sessions=len(self._retained),
            )
        return out

    def __repr__(self) -> str:
        return f"TorchEngine(name={self.name!r}, device={self.device}, version={self.version}, live={len(self._rows)})"
