"""Cost of one forward over T tokens relative to one token (v(T)), with and without the C++ kernel.

    python scripts/bench_verify_cost.py --model default --threads 1 --repeats 7 --out runs/verify_cost.json

Speculative decoding pays only if verifying T tokens costs little more than decoding one; this
measures v(T) for the runner's two matmul paths on the same model, interleaved, median of repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from core.models import resolve_model
from infer.loading import set_threads
from infer.runner import Runner


def measure(model: str, sizes: list[int], repeats: int, context: int) -> dict:
    path = resolve_model(model)
    runners = {name: Runner.from_pretrained(path, kernel=k) for name, k in (("kernel", "auto"), ("torch", "torch"))}
    if runners["kernel"].kernel is None:
        runners.pop("kernel")
    caches = {k: r.new_cache(context + max(sizes) + 8) for k, r in runners.items()}
    for k, r in runners.items():
        r.forward(caches[k], torch.arange(100, 100 + context))
    times: dict[str, dict[int, list[float]]] = {k: {T: [] for T in sizes} for k in runners}
    for _ in range(repeats):
        for T in sizes:
            ids = torch.arange(1000, 1000 + T)
            for k, r in runners.items():
                caches[k].rollback(context)
                t0 = time.perf_counter()
                r.forward(caches[k], ids)
                times[k][T].append(time.perf_counter() - t0)
    out = {}
    for k, per_t in times.items():
        base = statistics.median(per_t[1])
        out[k] = {T: {"ms": 1000 * statistics.median(v), "v": statistics.median(v) / base} for T, v in per_t.items()}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--sizes", default="1,2,3,4,5,6,8,12,16,32")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--context", type=int, default=200, help="tokens already in the cache")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    set_threads(args.threads)
    sizes = [int(x) for x in args.sizes.split(",")]
    result = measure(args.model, sizes, args.repeats, args.context)
    print("| T | " + " | ".join(f"{k} ms | {k} v(T)" for k in result) + " |")
    print("|---|" + "---|---|" * len(result))
    for T in sizes:
        print(f"| {T} | " + " | ".join(f"{result[k][T]['ms']:.1f} | {result[k][T]['v']:.2f}" for k in result) + " |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"threads": args.threads, "context": args.context, "result": result}, indent=1))


if __name__ == "__main__":
    main()
