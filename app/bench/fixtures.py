"""`python -m app.bench.fixtures NAME OUT`: write a random checkpoint at a real model's shapes
(adapters.hf.fixtures: Qwen3-0.6B, its untied 0.75B variant, a small Qwen3-MoE, and the tiny
shapes tests use), for `refit demo --model OUT` and the real-size benchmarks. No download."""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    from adapters.hf.fixtures import FIXTURES, write_fixture

    p = argparse.ArgumentParser(prog="python -m app.bench.fixtures", description=__doc__)
    p.add_argument("name", choices=sorted(FIXTURES))
    p.add_argument("out", help="the directory to write (created)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    p.add_argument("--max-shard-size", default="500MB", help="safetensors shard size (default 500MB)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    path = write_fixture(args.name, args.out, seed=args.seed, max_shard_size=args.max_shard_size)
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    sys.stdout.write(f"{args.name}: {size / 2**20:.1f} MiB in {path} ({time.perf_counter() - t0:.1f} s)\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
