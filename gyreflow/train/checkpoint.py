"""RL checkpoints: the policy in Hugging Face format, the optimizer and the RL state beside it.

A checkpoint directory holds ``config.json``, ``model.safetensors`` and the tokenizer (what
``transformers`` loads), ``optimizer.safetensors`` (every tensor of the optimizer's state dict) and
``rl_state.json`` (step, weights version, run name, optimizer settings and parameter groups).
Nothing is pickled. A checkpoint is written into a temporary directory and renamed into place,
so a directory named ``step-NNNNNN`` is always whole.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from gyreflow.train.state import PolicyState, PublishedWeights

FORMAT = 1
"""Value of ``format`` in ``rl_state.json``; readers refuse larger values."""

STATE_FILE = "rl_state.json"
OPTIMIZER_FILE = "optimizer.safetensors"


class CheckpointError(ValueError):
    """A directory that is not a readable gyreflow checkpoint (the message names what is wrong)."""


def step_dir(root: str | Path, step: int) -> Path:
    """Where the checkpoint taken after ``step`` lives under a run's ``checkpoints/``."""
    return Path(root) / f"step-{int(step):06d}"


def save_state(state: PolicyState, path: str | Path, step: int, extra: dict[str, Any] | None = None) -> str:
    """Write ``state`` (the RL state after ``step``'s update) as a checkpoint directory at ``path``.

    Runs as a Dask task wherever the state is; a checkpoint already at ``path`` is replaced whole.
    """
    import torch
    from safetensors.torch import save_file

    from gyreflow.model.policy import save_policy

    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    save_policy(_model(state.published), tmp)
    tensors, groups = {}, []
    if state.optimizer is not None:
        for index, entry in state.optimizer["state"].items():
            for name, value in entry.items():
                tensors[f"state.{int(index)}.{name}"] = torch.as_tensor(value).detach().cpu().contiguous()
        groups = [_plain(g) for g in state.optimizer["param_groups"]]
    save_file(tensors, str(tmp / OPTIMIZER_FILE))
    doc = {"format": FORMAT, "step": int(step), "version": int(state.version), "run": state.run,
           "optim": asdict(state.published.optim) if state.published.optim is not None else None,
           "optimizer": None if state.optimizer is None else {"param_groups": groups},
           **(extra or {})}
    (tmp / STATE_FILE).write_text(json.dumps(doc, indent=1) + "\n")
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)
    return str(path)


def read_meta(path: str | Path) -> dict[str, Any]:
    """``rl_state.json`` of the checkpoint at ``path``.

    Raises
    ------
    CheckpointError
        If the directory holds no checkpoint, or one of a newer format.
    """
    doc_path = Path(path) / STATE_FILE
    try:
        doc = json.loads(doc_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{str(path)!r} is not a gyreflow checkpoint: {STATE_FILE} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{str(doc_path)!r} is damaged: {err}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("format"), int) or not isinstance(doc.get("step"), int):
        raise CheckpointError(f"{str(doc_path)!r} is damaged: no integer 'format' and 'step'")
    if doc["format"] > FORMAT:
        raise CheckpointError(f"{str(path)!r} has checkpoint format {doc['format']}; this gyreflow reads up to "
                              f"{FORMAT}: upgrade gyreflow")
    return doc


def load_state(path: str | Path) -> PolicyState:
    """The RL state saved at ``path`` by :func:`save_state`.

    Raises
    ------
    CheckpointError
        If a file is missing or does not load.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from gyreflow.model.policy import load_policy, state_dict_numpy
    from gyreflow.train.trainer import OptimConfig

    doc = read_meta(path)
    try:
        model = load_policy(path)
        tensors = load_file(str(Path(path) / OPTIMIZER_FILE))
    except (OSError, SafetensorError, ValueError) as err:
        raise CheckpointError(f"checkpoint {str(path)!r} does not load: {err}") from None
    optim = OptimConfig(**doc["optim"]) if doc.get("optim") else None
    optimizer = None
    if doc.get("optimizer") is not None:
        state: dict[int, dict] = {}
        for key, value in tensors.items():
            _, index, name = key.split(".", 2)
            state.setdefault(int(index), {})[name] = value
        groups = [dict(g, betas=tuple(g["betas"])) if "betas" in g else dict(g) for g in doc["optimizer"]["param_groups"]]
        optimizer = {"state": state, "param_groups": groups}
    published = PublishedWeights(int(doc["version"]), str(doc["run"]), model.config.to_dict(), state_dict_numpy(model),
                                 optim)
    return PolicyState(published, optimizer, {"checkpoint": str(path), "step": doc["step"]})


def _model(published: PublishedWeights):
    from transformers import LlamaConfig, LlamaForCausalLM

    from gyreflow.model.policy import load_state_dict_numpy

    model = LlamaForCausalLM(LlamaConfig(**published.hf_config))
    load_state_dict_numpy(model, published.weights)
    return model


def _plain(value: Any) -> Any:
    """Optimizer settings as JSON values (tuples to lists, tensors and numpy scalars to numbers)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return value.item()
    return value
