"""Engine requests and results as plain messages for Dask comms (msgpack-able: no pickles)."""

from __future__ import annotations

from dataclasses import asdict

import numpy as np

from gyreflow.engine.base import GenerationRequest, GenerationResult, SamplingParams


def _arr(a, dtype) -> bytes:
    return np.ascontiguousarray(a, dtype=dtype).tobytes()


def request_to_msg(req: GenerationRequest) -> dict:
    params = asdict(req.params)
    params["stop"] = list(params["stop"])
    params["stop_token_ids"] = list(params["stop_token_ids"])
    return {
        "request_id": req.request_id,
        "prompt_ids": _arr(req.prompt_ids, np.int32),
        "params": params,
        "session": req.session,
    }


def msg_to_request(msg: dict) -> GenerationRequest:
    p = dict(msg["params"])
    p["stop"] = tuple(p.get("stop", ()))
    p["stop_token_ids"] = tuple(p.get("stop_token_ids", ()))
    return GenerationRequest(
        request_id=msg["request_id"],
        prompt_ids=np.frombuffer(msg["prompt_ids"], np.int32).copy(),
        params=SamplingParams(**p),
        session=msg.get("session"),
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
    )
