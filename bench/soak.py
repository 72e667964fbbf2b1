"""Resident memory of `mrv2 serve` under a long soak, by hand:

    python bench/soak.py [--requests 2000] [--concurrency 8] [--json out.json] [-- SERVE ARGS]

Starts the server on the built-in model (defaults as a user gets them, the 4 GiB KV cache
included, unless serve arguments follow `--`), sends the fixed request mix of
`mrv2.testing.soak` (streams, disconnects, n=2 with logprobs, a JSON schema, a rejected
request), and prints the RSS of the API process and of the engine core every 200 requests and
their growth from request 200 to the end: the issue's bar is "within a few percent".
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

from mrv2.models.builtin import builtin_model_path
from mrv2.testing.server import ServerProcess
from mrv2.testing.soak import run_soak


def main(argv: list[str]) -> int:
    if "--" in argv:
        split = argv.index("--")
        argv, serve_args = argv[:split], argv[split + 1:]
    else:
        serve_args = []
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200, help="growth is measured from here")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--sample-every", type=int, default=200)
    parser.add_argument("--json", help="write the samples and the growth here")
    args = parser.parse_args(argv)

    model_name = "soak"
    started = time.perf_counter()
    with ServerProcess(builtin_model_path(), ["--served-model-name", model_name,
                                              "--uvicorn-log-level", "warning",
                                              *serve_args]) as server:
        processes = {"api": server.proc.pid, "core": server.core_pid()}
        print(f"server up in {time.perf_counter() - started:.0f} s; "
              f"{args.requests} requests, {args.concurrency} at a time")

        def show(done: int, rss: dict[str, int]) -> None:
            cells = "  ".join(f"{name} {value / 2**20:8.1f} MiB" for name, value in rss.items())
            print(f"{done:6d} requests  {cells}", flush=True)

        result = run_soak(server.url, model_name, args.requests, processes=processes,
                          concurrency=args.concurrency, sample_every=args.sample_every,
                          on_sample=show)
        log = server.log_text().splitlines()
        errors = [i for i, line in enumerate(log)
                  if line.startswith("Traceback") or "Exception in ASGI" in line]
    growth = {name: result.growth(name, args.warmup) for name in processes}
    print("outcomes:", dict(sorted((f"{k}:{o}", n) for (k, o), n in result.outcomes.items())))
    print("growth from request", args.warmup, "to the end:",
          "  ".join(f"{name} {100 * g:+.2f}%" for name, g in growth.items()))
    print("tracebacks in the server log:", len(errors))
    for i in errors[:3]:
        print("\n".join(log[max(0, i - 2):i + 40]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"requests": args.requests, "concurrency": args.concurrency,
                       "serve_args": serve_args, "machine": platform.processor() or None,
                       "samples": result.samples, "growth_from": args.warmup,
                       "growth": growth, "server_log_tracebacks": len(errors),
                       "outcomes": {f"{k}:{o}": n for (k, o), n in result.outcomes.items()}},
                      f, indent=1)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
