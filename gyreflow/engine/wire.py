"""Engine requests and results as plain messages for Dask comms (msgpack-able: no pickles)."""

from __future__ import annotations

from dataclasses import asdict

import numpy as np

from gyreflow.engine.base import GenerationRequest, GenerationResult, LiveRequestState, SamplingParams


def _arr(a, dtype) -> bytes:
    return np.ascontiguousarray(a, dtype=dtype).tobytes()


def _params_msg(params: SamplingParams) -> dict:
    out = asdict(params)
    out["stop"] = list(out["stop"])
    out["stop_token_ids"] = list(out["stop_token_ids"])
    return out


def _msg_params(msg: dict) -> SamplingParams:
    p = dict(msg)
    p["stop"] = tuple(p.get("stop", ()))
    p["stop_token_ids"] = tuple(p.get("stop_token_ids", ()))
    return SamplingParams(**p)


def request_to_msg(req: GenerationRequest) -> dict:
    params = _params_msg(req.params)
    return {
        "request_id": req.request_id,
        "prompt_ids": _arr(req.prompt_ids, np.int32),
        "params": params,
        "session": req.session,
        "priority": float(req.priority),
    }


def msg_to_request(msg: dict) -> GenerationRequest:
    return GenerationRequest(
        request_id=msg["request_id"],
        prompt_ids=np.frombuffer(msg["prompt_ids"], np.int32).copy(),
        params=_msg_params(msg["params"]),
        session=msg.get("session"),
        priority=float(msg.get("priority", 0.0)),
    )


def result_to_msg(res: GenerationResult) -> dict:
    return {
        "request_id": res.request_id,
        "prompt_ids": _arr(res.prompt_ids, np.int32),
        "completion_ids": _arr(res.completion_ids, np.int32),
        "logprobs": _arr(res.logprobs, np.float32),
        "versions": _arr(res.versions, np.int32),
        "finish_reason": res.finish_reason,
        "engine": res.engine,
        "prefix_reused": int(res.prefix_reused),
        "received_at": res.received_at,
        "finished_at": res.finished_at,
    }


def msg_to_result(msg: dict) -> GenerationResult:
    return GenerationResult(
        request_id=msg["request_id"],
        prompt_ids=np.frombuffer(msg["prompt_ids"], np.int32).copy(),
        completion_ids=np.frombuffer(msg["completion_ids"], np.int32).copy(),
        logprobs=np.frombuffer(msg["logprobs"], np.float32).copy(),
        versions=np.frombuffer(msg["versions"], np.int32).copy(),
        finish_reason=msg["finish_reason"],
        engine=msg["engine"],
        prefix_reused=msg.get("prefix_reused", 0),
        received_at=msg.get("received_at"),
        finished_at=msg.get("finished_at"),
    )


def array_to_msg(a: np.ndarray) -> dict:
    a = np.ascontiguousarray(a)
    return {"dtype": a.dtype.str, "shape": list(a.shape), "data": a.tobytes()}


def msg_to_array(m: dict) -> np.ndarray:
    return np.frombuffer(m["data"], dtype=np.dtype(m["dtype"])).reshape(m["shape"]).copy()


def state_to_msg(state: LiveRequestState) -> dict:
    """A live request (tokens so far, KV cache, sampler state) as a message for Dask comms; the
    KV travels as one bytes frame, so over UCX it moves by RDMA where the network has it."""
    params = _params_msg(state.params)
    return {
        "request_id": state.request_id,
        "prompt_ids": array_to_msg(state.prompt_ids),
        "completion_ids": array_to_msg(state.completion_ids),
        "logprobs": array_to_msg(state.logprobs),
        "versions": array_to_msg(state.versions),
        "params": params,
        "session": state.session,
        "generator_state": array_to_msg(state.generator_state),
        "kv": array_to_msg(state.kv),
        "prefix_reused": int(state.prefix_reused),
        "source": state.source,
        "source_version": int(state.source_version),
    }


def msg_to_state(msg: dict) -> LiveRequestState:
    return LiveRequestState(
        request_id=msg["request_id"],
        prompt_ids=msg_to_array(msg["prompt_ids"]),
        completion_ids=msg_to_array(msg["completion_ids"]),
        logprobs=msg_to_array(msg["logprobs"]),
        versions=msg_to_array(msg["versions"]),
        params=_msg_params(msg["params"]),
        session=msg.get("session"),
        generator_state=msg_to_array(msg["generator_state"]),
        kv=msg_to_array(msg["kv"]),
        prefix_reused=msg.get("prefix_reused", 0),
        source=msg.get("source", ""),
        source_version=msg.get("source_version", 0),
    )


def state_nbytes(state: LiveRequestState) -> int:
    return int(np.asarray(state.kv).nbytes + np.asarray(state.generator_state).nbytes)
