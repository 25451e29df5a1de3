"""Cost of one forward over T tokens relative to one token (v(T)), with and without the C++ kernel.

    python -m tools.bench.bench_verify_cost --model default --threads 1 --repeats 7 --out runs/verify_cost.json
    python -m tools.bench.bench_verify_cost --model default --device cuda --dtype bf16

Speculative decoding pays only if verifying T tokens costs little more than decoding one; this
measures v(T) for the runner's matmul paths on the same model (the C++ small-matmul kernel runs on a CPU, for fp32,
and for bf16 where the CPU has AVX512_BF16), interleaved, median of repeats. The step against the machine's read
bandwidth: tools/bench/bench_step_bandwidth.py.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from infer.model.runner import Runner
from layerskip_cli.args import add_model_flags, model_settings
from layerskip_core.cli import Parser, add_output_flags, check_output_file, parse_and_run, write_result
from layerskip_core.device import dtype_name
from layerskip_core.errors import UserError


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(path: Path, sizes: list[int], repeats: int, context: int, device: torch.device,
            dt: torch.dtype) -> dict:
    dev = device
    runners = {name: Runner.from_pretrained(path, dtype=dt, device=dev, kernel=k)
               for name, k in (("kernel", "auto"), ("torch", "torch"))}
    if runners["kernel"].kernel is None:
        runners.pop("kernel")
    caches = {k: r.new_cache(context + max(sizes) + 8) for k, r in runners.items()}
    for k, r in runners.items():
        r.forward(caches[k], torch.arange(100, 100 + context, device=dev))
    times: dict[str, dict[int, list[float]]] = {k: {T: [] for T in sizes} for k in runners}
    for _ in range(repeats):
        for T in sizes:
            ids = torch.arange(1000, 1000 + T, device=dev)  # (T,)
            for k, r in runners.items():
                caches[k].rollback(context)
                _sync(dev)
                t0 = time.perf_counter()
                r.forward(caches[k], ids)
                _sync(dev)
                times[k][T].append(time.perf_counter() - t0)
    out = {}
    for k, per_t in times.items():
        base = statistics.median(per_t[min(sizes)])
        out[k] = {T: {"ms": 1000 * statistics.median(v), "v": statistics.median(v) / base} for T, v in per_t.items()}
    return out


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--sizes {text!r}: expected comma-separated integers, e.g. 1,2,4,8") from None
    if not sizes or min(sizes) < 1 or 1 not in sizes:
        raise UserError(f"--sizes {text!r}: give token counts >= 1, including 1 (the reference)")
    return sizes


def run(args: argparse.Namespace) -> int:
    sizes = _sizes(args.sizes)
    if args.out:
        check_output_file(args.out, "--out", force=args.force)
    run = model_settings(args).resolve()  # a missing GPU is refused before the model loads
    run.apply_threads()
    result = measure(run.model, sizes, args.repeats, args.context, run.device, run.dtype)
    print("| T | " + " | ".join(f"{k} ms | {k} v(T)" for k in result) + " |")
    print("|---|" + "---|---|" * len(result))
    for T in sizes:
        print(f"| {T} | " + " | ".join(f"{result[k][T]['ms']:.1f} | {result[k][T]['v']:.2f}" for k in result) + " |")
    if args.out:
        meta = {"threads": run.threads, "context": args.context, "device": str(run.device),
                "dtype": dtype_name(run.dtype)}
        write_result(args.out, meta | {"result": result})
    return 0


def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(p, skip=("executor",))  # both runners here run eagerly: the kernel is what varies
    p.add_argument("--sizes", default="1,2,3,4,5,6,8,12,16,32")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--context", type=int, default=200, help="tokens already in the cache")
    add_output_flags(p, "JSON file for the measured numbers")
    return parse_and_run(p, argv, "bench_verify_cost", run)


if __name__ == "__main__":
    sys.exit(main())
