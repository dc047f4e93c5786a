"""The torch engine: continuous batching over a paged KV cache, on CPU or GPU.

Keys and values live in fixed-size blocks (:mod:`gyreflow.engine.kvcache`); each request's block
table grows as tokens arrive and is freed when it finishes. Each iteration admits waiting
requests while blocks are free, prefills up to ``prefill_step_tokens`` of their prompts (a long
prompt goes in chunks over several iterations, so it does not stall the others), then decodes one
token for every request whose prompt is in. When blocks run out mid-decode, the youngest request
is preempted: its KV is copied out and it waits to be resumed, exactly where it was. Finished
session requests leave their blocks in a small LRU, and a later request of the same session shares
the blocks of the longest common prefix (copying the partly matching one).

Thread model: ``step`` runs on one thread at a time (usually an
:class:`~gyreflow.engine.runner.EngineRunner`); ``submit``, ``load_weights``, ``export_request``,
``import_request`` and ``stats`` may be called from any thread. Weights swap and requests leave only between iterations.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import deque
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
from gyreflow.engine.constraints import Template
from gyreflow.engine.forward import MASK_ELEMENTS, ModelSpec, ModelWeights, build_weights, forward, rope_tables, sample_tokens
from gyreflow.engine.kvcache import BlockAllocator, KVBlocks

LogitsHook = Callable[[list[str], torch.Tensor], None]

PER_ROW_ATTENTION = 8192
"""Key floats per row (keys x kv heads x head dim) from which decode attends row by row over
views of consecutive blocks rather than gathering every row's keys into one batch: past this, a
gather copies more than a call per row costs."""


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
    """Leading tokens of ``seq`` whose KV is in this request's blocks."""
    prefix_reused: int = 0
    kv_in: np.ndarray | None = None
    """KV brought by ``import_request`` (or kept by a preemption), written into blocks on admission."""
    priority: float = 0.0
    on_token: Callable[[int, float], None] | None = None
    template: Template | None = None
    """The completion's constraint, and where it stands (``template_state``)."""
    template_state: object = None
    received_at: float | None = None
    """Wall time :meth:`TorchEngine.submit` took it in (None if imported)."""

    @property
    def n_prompt(self) -> int:
        return len(self.prompt)

    @property
    def completion(self) -> list[int]:
        return self.seq[len(self.prompt) :]


class TorchEngine(WorkSignal):
    """A Llama policy served with continuous batching by a functional torch forward.

    Parameters
    ----------
    model
        A Hugging Face ``LlamaForCausalLM`` (e.g. :func:`gyreflow.model.build_policy`); its weights
        are copied, the module itself is not kept.
    max_batch
        Most requests decoded together.
    max_seq_len
        Longest prompt + completion. Defaults to the model's ``max_position_embeddings``; KV memory
        is taken block by block as sequences grow, so a long limit costs nothing until used.
    device
        Torch device of weights and cache (``"cpu"``, ``"cuda"``, ``"cuda:1"`` ...).
    name
        Address or name written into every result's ``engine`` field.
    version
        Weights version of ``model``'s weights.
    retain_sessions
        Finished sessions whose KV is kept for prefix reuse (LRU); 0 disables reuse. Defaults to
        ``max(1, max_batch // 4)``.
    kv_block_size
        Positions per KV block. ``None`` gives every request one block of ``max_seq_len``
        positions, a reused prefix copied into it: the slot cache before paging, kept as a
        baseline for comparisons.
    kv_blocks
        Blocks in the pool. Defaults to room for ``max_batch + retain_sessions`` sequences of
        ``min(max_seq_len, 4096)`` tokens (and at least one of ``max_seq_len``); with one block
        per request, ``max_batch + retain_sessions``.
    prefill_chunk
        Most tokens of one request per prefill forward (longer prompts go in chunks).
    prefill_batch_tokens
        Most padded tokens per prefill forward; prompts are grouped under it.
    prefill_step_tokens
        Most prompt tokens prefilled per iteration (whole chunks; at least one chunk), so a long
        prompt is spread over iterations while the other requests decode. ``None``: every
        admitted prompt is prefilled in the iteration that admits it.
    dtype
        Weights and cache precision; logits and sampling are always float32/float64.
    logits_hook
        Called as ``hook(request_ids, logits)`` with the (B, V) float32 logits of every sampling
        call, for tests and debugging.

    Raises
    ------
    ValueError
        A limit below 1, ``max_seq_len`` beyond the model's positions, or a pool smaller than
        one sequence of ``max_seq_len`` tokens.
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
        retain_sessions: int | None = None,
        kv_block_size: int | None = 64,
        kv_blocks: int | None = None,
        prefill_chunk: int = 512,
        prefill_batch_tokens: int = 4096,
        prefill_step_tokens: int | None = 4096,
        dtype: torch.dtype = torch.float32,
        logits_hook: LogitsHook | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self.spec = ModelSpec.from_hf_config(model.config)
        positions = int(model.config.max_position_embeddings)
        self.device = torch.device(device if device is not None else "cpu")
        self.dtype = dtype
        self.name = name
        self.version = int(version)
        self.max_batch = int(max_batch)
        self.max_seq_len = int(max_seq_len or positions)
        if not 2 <= self.max_seq_len <= positions:
            raise ValueError(f"max_seq_len {self.max_seq_len} is outside [2, {positions}] (the model's positions)")
        self.retain_sessions = int(max(1, max_batch // 4) if retain_sessions is None else retain_sessions)
        self.prefill_chunk = max(1, int(prefill_chunk))
        self.prefill_batch_tokens = max(1, int(prefill_batch_tokens))
        self.prefill_step_tokens = None if prefill_step_tokens is None else max(1, int(prefill_step_tokens))
        self.logits_hook = logits_hook
        block = self.max_seq_len if kv_block_size is None else int(kv_block_size)
        if block < 1:
            raise ValueError("kv_block_size must be at least 1")
        sequences = self.max_batch + self.retain_sessions
        if kv_blocks is None:
            per_seq = -(-min(self.max_seq_len, 4096) // block)
            kv_blocks = max(sequences * per_seq, -(-self.max_seq_len // block) + 1)
        if int(kv_blocks) * block < self.max_seq_len:
            raise ValueError(f"kv_blocks {kv_blocks} x kv_block_size {block} holds fewer than max_seq_len "
                             f"{self.max_seq_len} tokens")

        with torch.inference_mode():
            self._weights: ModelWeights = build_weights(model.state_dict(), self.spec, self.device, dtype)
            self._rope = rope_tables(self.spec, self.max_seq_len, self.device)
            s = self.spec
            self._kv = KVBlocks(s.num_layers, s.num_kv_heads, s.head_dim, int(kv_blocks), block, self.device, dtype)
        # One slot per request is the layout before paging, kept as it was (a reused prefix is
        # copied into the request's own slot) so that it can serve as the baseline.
        self._blocks = BlockAllocator(int(kv_blocks), block, self.retain_sessions, share_last_block=kv_block_size is not None)
        self._key_width = self.spec.num_kv_heads * self.spec.head_dim
        self._peak_live_blocks = 0
        self._peak_live_tokens = 0
        """Tokens the live requests held when their blocks peaked (what an exact layout would hold)."""
        self._live_grew = False

        # _lock guards the queue, the id table, staged weights and finished futures; _step_lock is
        # held for a whole iteration, so whoever holds it sees the engine between iterations.
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._step_lock = threading.RLock()
        self._waiting: deque[_Request] = deque()
        self._ids: dict[str, _Request] = {}
        self._staged: tuple[ModelWeights, int] | None = None
        self._rows: list[_Request] = []  # live requests, in admission order
        self._done: list[tuple[Future, GenerationResult | BaseException]] = []
        self._counters = dict(
            tokens_generated=0, iterations=0, prefill_tokens=0, reused_tokens=0, finished=0, exported=0, imported=0,
            preempted=0,
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
                       priority=float(request.priority), on_token=request.on_token, received_at=time.time())
        if params.constraint is not None:
            req.template = Template.from_spec(params.constraint)
            req.template_state = req.template.start()
        self._enqueue(req, front=False)
        return req.future

    def import_request(self, state: LiveRequestState, on_token=None) -> Future:
        """Resume a request exported by ``export_request`` (of this or another engine).

        It continues ahead of requests that never started. The future resolves to the full
        result: the completion includes the tokens sampled before the move. ``on_token`` is
        called as for :attr:`GenerationRequest.on_token`, for the tokens sampled from here on.
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
            on_token=on_token,
        )
        if state.params.constraint is not None:
            req.template = Template.from_spec(state.params.constraint)
            req.template_state = req.template.replay(completion)
        self._enqueue(req, front=True)
        with self._lock:
            self._counters["imported"] += 1
        return req.future

    def _check(self, request_id: str, prompt: np.ndarray, params: SamplingParams) -> None:
        if len(prompt) == 0:
            raise ValueError(f"request {request_id!r}: empty prompt")
        if len(prompt) >= self.max_seq_len:
            raise ValueError(f"request {request_id!r}: prompt of {len(prompt)} tokens does not fit the engine's context "
                             f"of {self.max_seq_len} tokens (prompt + completion)")
        if prompt.min() < 0 or prompt.max() >= self.spec.vocab_size:
            raise ValueError(f"request {request_id!r}: token id out of range [0, {self.spec.vocab_size})")
        if params.max_tokens < 1:
            raise ValueError(f"request {request_id!r}: max_tokens must be at least 1")
        if not 0.0 < params.top_p <= 1.0:
            raise ValueError(f"request {request_id!r}: top_p must be in (0, 1]")
        if params.temperature < 0:
            raise ValueError(f"request {request_id!r}: negative temperature")
        if params.constraint is not None:
            try:
                template = Template.from_spec(params.constraint)
            except (ValueError, TypeError) as err:
                raise ValueError(f"request {request_id!r}: bad constraint: {err}") from None
            need = template.shortest_rest(template.start())
            if need > params.max_tokens:
                raise ValueError(f"request {request_id!r}: max_tokens {params.max_tokens} cannot hold its constraint "
                                 f"(at least {need} tokens)")

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
                kv = self._kv.read(self._blocks.table(req.request_id), req.n_cached)
                self._blocks.close(req.request_id)
                self._rows.remove(req)
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
        self._blocks.drop_retained()

    # ------------------------------------------------------------------ the loop

    def has_work(self) -> bool:
        """Whether ``step`` would do anything: live or waiting requests, or staged weights."""
        return bool(self._rows or self._waiting or self._staged is not None)

    def step(self) -> int:
        """One iteration: apply staged weights, admit, prefill, decode every request whose prompt is in.

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
                    self._admit()
                    produced += self._prefill()
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

    def _admit(self) -> None:
        """Move waiting requests in, in priority order, while rows and blocks are free."""
        while len(self._rows) < self.max_batch:
            with self._lock:
                if not self._waiting:
                    break
                req = take_next(self._waiting)
            if not self._place(req):
                with self._lock:
                    self._waiting.appendleft(req)  # first again among its priority
                break
            self._rows.append(req)
        self._note_live()

    def _place(self, req: _Request) -> bool:
        """Give a request blocks for its whole sequence, filled with whatever KV it brings or can
        reuse; False (and nothing held) when the pool cannot hold it now."""
        blocks, rid = self._blocks, req.request_id
        blocks.open(rid)
        reused = 0
        if req.kv_in is None and req.session is not None:
            seq = np.asarray(req.seq, dtype=np.int32)
            reused = blocks.share(rid, req.session, seq, self.version, self._kv.copy)
        if not blocks.grow(rid, len(req.seq)):
            blocks.close(rid)
            return False
        self._prepare_taken()
        if req.kv_in is not None:
            self._kv.write(blocks.table(rid), req.kv_in)
            req.n_cached, req.kv_in = req.kv_in.shape[3], None
        elif reused:
            req.n_cached = req.prefix_reused = reused
            with self._lock:
                self._counters["reused_tokens"] += reused
        return True

    def _prepare_taken(self) -> None:
        """Zero the blocks handed out since the last call that were never used before."""
        taken, self._blocks.taken = self._blocks.taken, []
        if taken:
            self._kv.prepare(taken)
            self._live_grew = True

    def _note_live(self) -> None:
        """Update the peak of blocks held by live requests (it can only rise when tables grew)."""
        if self._live_grew:
            live = len({b for r in self._rows for b in self._blocks.table(r.request_id)})
            if live > self._peak_live_blocks:
                self._peak_live_blocks = live
                self._peak_live_tokens = sum(len(r.seq) for r in self._rows)
            self._live_grew = False

    def _tables(self, rows: list[_Request], n_tokens: int) -> tuple[torch.Tensor, slice | None]:
        """(B, nb) block tables covering ``n_tokens`` positions, short ones padded with their own
        last block; and the slice of blocks when each row has one and they are consecutive."""
        nb = self._blocks.blocks_for(n_tokens)
        tables = [self._blocks.table(r.request_id)[:nb] for r in rows]
        if nb == 1:
            first = tables[0][0]
            if all(t[0] == first + i for i, t in enumerate(tables)):
                return torch.tensor([t[0] for t in tables], device=self.device)[:, None], slice(first, first + len(rows))
        padded = [t + [t[-1]] * (nb - len(t)) for t in tables]
        return torch.tensor(padded, device=self.device), None  # (B, nb)

    def _spans(self, rows: list[_Request]) -> list[tuple[int, int]]:
        """(flat offset of the first key, keys) per decode row; offset -1 when its blocks are not
        one consecutive run."""
        bs, out = self._blocks.block_size, []
        for r in rows:
            n = r.n_cached + 1
            table = self._blocks.table(r.request_id)[: -(-n // bs)]
            contiguous = table[-1] - table[0] == len(table) - 1 and all(b - a == 1 for a, b in zip(table, table[1:]))
            out.append((table[0] * bs if contiguous else -1, n))
        return out

    def _prefill(self) -> int:
        """Feed uncached prompt tokens, whole chunks up to ``prefill_step_tokens``, oldest requests
        first; sample after each request's last token."""
        pending = sorted((r for r in self._rows if len(r.seq) - r.n_cached > 1), key=lambda r: r.priority)
        budget = self.prefill_step_tokens
        spent, produced = 0, 0
        finished: list[tuple[_Request, str]] = []
        while pending:
            chunks: list[tuple[_Request, int]] = []
            for r in pending:
                n = min(len(r.seq) - r.n_cached, self.prefill_chunk)
                if budget is not None and spent > 0 and spent + n > budget:
                    break
                chunks.append((r, n))
                spent += n
            if not chunks:
                break
            for group in self._prefill_groups(chunks):
                rows = [r for r, _ in group]
                n_new = [n for _, n in group]
                width = max(n_new)
                t_keys = max(r.n_cached + n for r, n in group)
                tables, view = self._tables(rows, t_keys)
                toks = [r.seq[r.n_cached : r.n_cached + n] + [0] * (width - n) for r, n in group]
                logits = forward(
                    self._weights,
                    self.spec,
                    self._kv,
                    self._rope,
                    tables,
                    torch.tensor(toks, device=self.device),  # (B, T)
                    torch.tensor([r.n_cached for r in rows], device=self.device),  # (B,)
                    torch.tensor(n_new, device=self.device),  # (B,)
                    t_keys=t_keys,
                    rows=view,
                )  # (B, V)
                for r, n in group:
                    r.n_cached += n
                with self._lock:
                    self._counters["prefill_tokens"] += sum(n_new)
                ready = [i for i, r in enumerate(rows) if r.n_cached == len(r.seq)]
                if ready:
                    rows_ready = [rows[i] for i in ready]
                    logits_ready = logits if len(ready) == len(rows) else logits[torch.tensor(ready, device=self.device)]
                    finished += self._sample_and_append(rows_ready, logits_ready)
                    produced += len(rows_ready)
            pending = [r for r in pending if len(r.seq) - r.n_cached > 1]  # sampled rows have one left
        if finished:
            self._retire(finished)
        return produced

    def _prefill_groups(self, chunks: list[tuple[_Request, int]]) -> list[list[tuple[_Request, int]]]:
        """Split chunks into forwards whose padded size fits ``prefill_batch_tokens`` and whose
        attention mask fits :data:`MASK_ELEMENTS` (a row alone needs no mask)."""
        g = self.spec.group
        groups: list[list[tuple[_Request, int]]] = []
        group: list[tuple[_Request, int]] = []
        width = keys = 0
        for r, n in sorted(chunks, key=lambda c: c[1]):  # by length: less padding
            w, k = max(width, n), max(keys, r.n_cached + n)
            if group and ((len(group) + 1) * w > self.prefill_batch_tokens or (len(group) + 1) * w * g * k > MASK_ELEMENTS):
                groups.append(group)
                group, w, k = [], n, r.n_cached + n
            group.append((r, n))
            width, keys = w, k
        if group:
            groups.append(group)
        return groups

    def _decode(self) -> int:
        """One token for every request whose prompt is in, in one forward."""
        rows = [r for r in self._rows if r.n_cached == len(r.seq) - 1]
        if not rows:
            return 0
        for r in sorted(rows, key=lambda r: r.priority):
            while r in self._rows and not self._blocks.grow(r.request_id, r.n_cached + 1):
                self._preempt(self._victim())
        self._prepare_taken()
        self._note_live()
        rows = [r for r in self._rows if r.n_cached == len(r.seq) - 1]
        if not rows:
            return 0
        n = len(rows)
        t_keys = max(r.n_cached for r in rows) + 1
        tables, view = self._tables(rows, t_keys)
        spans = None
        if view is None and n > 1 and sum(r.n_cached + 1 for r in rows) * self._key_width >= n * PER_ROW_ATTENTION:
            spans = self._spans(rows)
        tokens = torch.tensor([r.seq[-1] for r in rows], device=self.device).view(n, 1)  # (B, 1)
        starts = torch.tensor([r.n_cached for r in rows], device=self.device)  # (B,)
        logits = forward(self._weights, self.spec, self._kv, self._rope, tables, tokens, starts, t_keys=t_keys, rows=view,
                         spans=spans)  # (B, V)
        for r in rows:
            r.n_cached += 1
        finished = self._sample_and_append(rows, logits)
        if finished:
            self._retire(finished)
        return n

    def _victim(self) -> _Request:
        """The live request to preempt: the lowest priority (highest value), the youngest among equals."""
        if not self._rows:
            raise RuntimeError("KV pool exhausted with no request to preempt")
        return max(enumerate(self._rows), key=lambda x: (x[1].priority, x[0]))[1]

    def _preempt(self, r: _Request) -> None:
        """Take a live request out to wait again: its KV is copied out and written back on resume."""
        kv = self._kv.read(self._blocks.table(r.request_id), r.n_cached)
        self._blocks.close(r.request_id)
        self._rows.remove(r)
        r.kv_in, r.n_cached = (kv if kv.shape[3] else None), 0
        with self._lock:
            self._waiting.appendleft(r)
            self._counters["preempted"] += 1

    def _sample_and_append(self, rows: list[_Request], logits: torch.Tensor) -> list[tuple[_Request, str]]:
        """Sample one token per row and record it; return the rows that finished, with why."""
        constrained = [i for i, r in enumerate(rows) if r.template_state is not None]
        if constrained:
            logits = self._constrain(rows, constrained, logits)
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
            if r.template_state is not None:
                r.template_state = r.template.advance(r.template_state, r.template.token(tok))
            if r.on_token is not None:
                r.on_token(tok, lp)
            reason = self._finish_reason(r, tok)
            if reason is not None:
                finished.append((r, reason))
        return finished

    def _constrain(self, rows: list[_Request], constrained: list[int], logits: torch.Tensor) -> torch.Tensor:
        """Mask, in the rows with a constraint, every token that cannot follow it within the
        tokens the request has left."""
        logits = logits.clone()
        vocab = logits.shape[1]
        for i in constrained:
            r = rows[i]
            left = min(r.params.max_tokens - (len(r.seq) - r.n_prompt), self.max_seq_len - len(r.seq))
            ok = r.template.allowed(r.template_state, left, vocab)
            if ok.any():  # else nothing can finish it: sample freely
                logits[i].masked_fill_(~torch.from_numpy(ok).to(logits.device), float("-inf"))
        return logits

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
        for r, reason in finished:
            if r.session is not None and self.retain_sessions > 0 and r.n_cached > 0:
                self._blocks.retain(r.request_id, r.session, np.asarray(r.seq[: r.n_cached], dtype=np.int32), self.version)
            else:
                self._blocks.close(r.request_id)
            self._rows.remove(r)
            result = GenerationResult(
                request_id=r.request_id,
                prompt_ids=r.prompt,
                completion_ids=np.asarray(r.completion, dtype=np.int32),
                logprobs=np.asarray(r.logprobs, dtype=np.float32),
                versions=np.asarray(r.versions, dtype=np.int32),
                finish_reason=reason,
                engine=self.name,
                prefix_reused=r.prefix_reused,
                received_at=r.received_at,
                finished_at=time.time(),
            )
            with self._lock:
                self._ids.pop(r.request_id, None)
                self._counters["finished"] += 1
                self._done.append((r.future, result))

    def _fail_live(self, exc: BaseException) -> None:
        for r in self._rows:
            self._blocks.close(r.request_id)
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
                max_seq_len=self.max_seq_len,
                retained_sessions=self._blocks.retained_sessions,
                kv_block_size=self._blocks.block_size,
                kv_blocks=self._blocks.num_blocks,
                kv_blocks_used=self._blocks.used,
                kv_peak_blocks=self._blocks.peak_used,
                kv_peak_live_blocks=self._peak_live_blocks,
                kv_peak_live_tokens=self._peak_live_tokens,
                kv_bytes_per_block=self._kv.bytes_per_block,
            )
        return out

    def __repr__(self) -> str:
        return f"TorchEngine(name={self.name!r}, device={self.device}, version={self.version}, live={len(self._rows)})"
