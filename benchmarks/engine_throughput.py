"""Generation throughput: the torch engine against Hugging Face ``model.generate``.

Both serve the same model on the same batch of prompts, sampling (temperature 1, no top-k) with a
KV cache, exactly ``--new-tokens`` tokens per prompt. Prints tokens/s of each and their ratio,
measured in this run.

    python benchmarks/engine_throughput.py                 # default ModelConfig, 32 x 128 tokens
    python benchmarks/engine_throughput.py --batch 16 --new-tokens 64 --device cuda
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from gyreflow.engine.base import GenerationRequest, SamplingParams
from gyreflow.engine.torch_engine import TorchEngine
from gyreflow.model import ModelConfig, build_policy


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=32, help="prompts generated together")
    p.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens sampled per prompt")
    p.add_argument("--hidden", type=int, default=ModelConfig.hidden_size)
    p.add_argument("--intermediate", type=int, default=ModelConfig.intermediate_size)
    p.add_argument("--layers", type=int, default=ModelConfig.num_layers)
    p.add_argument("--heads", type=int, default=ModelConfig.num_heads)
    p.add_argument("--kv-heads", type=int, default=ModelConfig.num_kv_heads)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=2, help="timed runs of each; the best counts")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads for both (0: torch's default); one keeps a shared CPU box steady",
    )
    return p.parse_args()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_engine(engine: TorchEngine, prompts: np.ndarray, new_tokens: int, tag: str) -> float:
    """Seconds to generate ``new_tokens`` for every prompt with continuous batching."""
    params = [SamplingParams(temperature=1.0, max_tokens=new_tokens, seed=i) for i in range(len(prompts))]
    sync(engine.device)
    t0 = time.perf_counter()
    futures = [engine.submit(GenerationRequest(f"{tag}-{i}", p, params[i])) for i, p in enumerate(prompts)]
    engine.drain()
    sync(engine.device)
    elapsed = time.perf_counter() - t0
    assert all(len(f.result().completion_ids) == new_tokens for f in futures)
    return elapsed


def time_hf(model, prompts: np.ndarray, new_tokens: int, device: torch.device) -> float:
    """Seconds for ``model.generate`` on the same batch (equal-length prompts: no padding)."""
    ids = torch.from_numpy(prompts.astype(np.int64)).to(device)
    sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            use_cache=True,
            pad_token_id=256,
        )
    sync(device)
    elapsed = time.perf_counter() - t0
    assert out.shape == (len(prompts), prompts.shape[1] + new_tokens)
    return elapsed


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cfg = ModelConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
    )
    model = build_policy(cfg).to(device)
    prompts = np.random.default_rng(0).integers(0, 256, size=(args.batch, args.prompt_len)).astype(np.int32)
    engine = TorchEngine(
        model,
        max_batch=args.batch,
        max_seq_len=args.prompt_len + args.new_tokens + 1,
        device=device,
        retain_sessions=0,
    )
    tokens = args.batch * args.new_tokens
    print(
        f"model {cfg}\nbatch {args.batch} x prompt {args.prompt_len} + {args.new_tokens} new tokens, "
        f"device {device}, torch threads {torch.get_num_threads()}"
    )

    # Warm-up: allocator, kernels, lazy imports of both paths.
    time_engine(engine, prompts[: min(4, args.batch)], 8, "warm")
    time_hf(model, prompts[: min(4, args.batch)], 8, device)

    t_engine = min(time_engine(engine, prompts, args.new_tokens, f"run{r}") for r in range(args.repeats))
    t_hf = min(time_hf(model, prompts, args.new_tokens, device) for _ in range(args.repeats))
    engine_tps, hf_tps = tokens / t_engine, tokens / t_hf
    print(f"torch engine        {engine_tps:10.1f} tokens/s  ({t_engine:.2f} s)")
    print(f"transformers generate {hf_tps:8.1f} tokens/s  ({t_hf:.2f} s)")
    print(f"ratio engine / generate: {engine_tps / hf_tps:.2f}x")
    stats = engine.stats()
    print(f"engine iterations {stats['iterations']}, prefill tokens {stats['prefill_tokens']}")


if __name__ == "__main__":
    main()
