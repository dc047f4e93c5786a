"""Latency the OpenAI-compatible proxy adds per call, over a direct engine call, with a zero-cost engine.

Times, call by call in the same run, the engine call the proxy makes (in-process), the same call
as a chat completion through the proxy over HTTP, and the same request to a trivial tornado
server (the HTTP floor). Prints p50/p99/mean per call, calls/s, the latency added (proxied less
direct) against the 2 ms target at p50, and the ratios proxied / direct and proxied / floor. See
:mod:`gyreflow.bench.proxy`.

    python benchmarks/proxy_overhead.py                          # 2,000 calls, 8 messages, http.client
    python benchmarks/proxy_overhead.py --client openai          # what an agent on the official SDK sees
    python benchmarks/proxy_overhead.py --messages 32 --concurrency 4 --json proxy.json
"""

from __future__ import annotations

import argparse
import json

from gyreflow.bench.proxy import CLIENTS, format_proxy, run_bench


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000, help="timed calls of each path")
    p.add_argument("--warmup", type=int, default=200, help="untimed calls of each path first")
    p.add_argument("--messages", type=int, default=8, help="messages of the request (system, user, tool turns)")
    p.add_argument("--concurrency", type=int, default=1,
                   help="above 1, also this many client threads at once, each with its own connection")
    p.add_argument("--client", choices=CLIENTS, default="http",
                   help="http: http.client, one keep-alive connection; openai: the official SDK")
    p.add_argument("--no-floor", action="store_true", help="skip the trivial tornado server")
    p.add_argument("--json", default=None, help="also write the figures here")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    result = run_bench(calls=args.calls, warmup=args.warmup, prompt_messages=args.messages,
                       concurrency=args.concurrency, client=args.client, floor=not args.no_floor)
    print(format_proxy(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
