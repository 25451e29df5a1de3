"""One decoding step against the machine's read bandwidth, and verification cost v(T): fp32 and bf16, 1 and 2 threads.

    python -m tools.bench.bench_step_bandwidth --rounds 7 --out runs/step_bandwidth.json
    python -m tools.bench.bench_step_bandwidth --dtypes fp32 --threads-list 1 --kernels auto,torch

Each round (per dtype and thread count), every route in turn (``--kernels`` x ``--attention``, so the host's load
changes hit them alike), and for each T: a probe reads a buffer as large as the step's weights
(``torch.sum``: one sequential read, which also evicts the previous step's weights from the cache), then one forward
over T new tokens with ``--context`` tokens already in the cache. The bandwidth ratio of a round is the probe's time
over the one-token step's time (the weight bytes / step time, over the probe's bytes / probe time); it is printed
per round and as the median, beside the milliseconds, so another machine can check it. v(T) = the median T-token
forward over the median one-token step. Interleaving puts the host's other load on probe and step alike.

``--attention rows,sdpa`` measures a kernel runner twice: with the kernel's batch-invariant row attention (``rows``,
the default) and with torch's SDPA in its place (``sdpa``: the route prompt prefill takes), to price the attention.
``--fused on,off`` measures a kernel runner with the fused layer span (``on``, the default: the layers in one C++ call,
``infer.model.fused_span``) and without it (``off``: the Python layer loop over the same kernel calls), in the same
rounds; the SDPA route is always unfused (the fused span attends with the row attention only).

    python -m tools.bench.bench_step_bandwidth --kernels auto,torch --fused on,off --rounds 15 --threads-list 1
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch

from infer.model.loop import EagerExecutor
from infer.model.runner import Runner
from infer.model.weights import Linear
from layerskip_cli.args import add_model_flags, model_settings
from layerskip_core.cli import Parser, add_output_flags, check_output_file, parse_and_run, write_result
from layerskip_core.device import parse_dtype
from layerskip_core.errors import UserError


def weight_bytes(runner: Runner) -> int:
    """Bytes of the matrices one step reads (the layers' and the LM head's)."""
    linears = [runner.lm_head] + [m for w in runner.layers for m in (w.qkv, w.o, w.gate_up, w.down)
                                  if isinstance(m, Linear)]
    return sum(m.nbytes for m in linears)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _prepared(runner: Runner, sizes: list[int], context: int):
    """A cache holding ``context`` tokens, after one warm-up forward of every size."""
    cache = runner.new_cache(context + max(sizes) + 8)
    runner.forward(cache, torch.arange(100, 100 + context))
    for T in sizes:
        cache.rollback(context)
        runner.forward(cache, torch.arange(1000, 1000 + T))
    return cache


def measure(runners: dict[str, Runner], sizes: list[int], rounds: int, context: int) -> dict[str, dict]:
    """Interleaved rounds (the thread count is the caller's): in each, every runner in turn, and for each of its T a
    probe as large as its weights, then one forward over T tokens after ``context`` cached ones; so a change in the
    host's load hits every route and the probe alike."""
    nbytes = {name: weight_bytes(r) for name, r in runners.items()}
    probes = {b: torch.ones(b // 4) for b in set(nbytes.values())}  # fp32, as many bytes as the weights
    caches = {name: _prepared(r, sizes, context) for name, r in runners.items()}
    times = {name: {T: [] for T in sizes} for name in runners}
    probe_s: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(rounds):
        for name, runner in runners.items():
            for T in sizes:
                ids, cache = torch.arange(1000, 1000 + T), caches[name]  # (T,)
                cache.rollback(context)
                probe = _timed(probes[nbytes[name]].sum)
                times[name][T].append(_timed(lambda ids=ids, cache=cache, runner=runner: runner.forward(cache, ids)))
                if T == 1:
                    probe_s[name].append(probe)
    return {name: summary(nbytes[name], times[name], probe_s[name]) for name in runners}


def summary(nbytes: int, times: dict[int, list[float]], probe_s: list[float]) -> dict:
    """Medians of one route's rounds: ms and v(T) per T, the bandwidth ratio per round and its median."""
    ratios = [p / t for p, t in zip(probe_s, times[1], strict=True)]
    base = statistics.median(times[1])
    return {"weight_mb": nbytes / 1e6, "ms": {T: 1000 * statistics.median(v) for T, v in times.items()},
            "v": {T: statistics.median(v) / base for T, v in times.items()},
            "ratio_per_round": ratios, "ratio": statistics.median(ratios),
            "probe_gb_s": statistics.median(nbytes / p / 1e9 for p in probe_s), "step_gb_s": nbytes / base / 1e9}


class SdpaLoop(EagerExecutor):
    """The layer loop attending through SDPA instead of the kernel's row attention (as its ``BULK`` rows do)."""

    def cached_attention(self, i, cache, q, k, v, attn_mask, bulk=False):
        return super().cached_attention(i, cache, q, k, v, attn_mask, bulk=True)


def on_sdpa(runner: Runner) -> Runner:
    """``runner`` attending through SDPA instead of the kernel's row attention, on the Python layer loop
    (``unfused``)."""
    runner.eager = SdpaLoop(runner)
    return unfused(runner)


def unfused(runner: Runner) -> Runner:
    """``runner`` without its fused layer span: every eager forward on the Python layer loop."""
    runner.fused = None
    return runner


def routes(model, dtype: torch.dtype, kernels: str, attentions: list[str], fused: list[str]) -> dict[str, Runner]:
    """The runners to measure side by side, by name: per ``--kernels`` entry, and for a kernel runner per
    ``--attention`` and ``--fused`` entry (shallow copies of the same runner: the same weights). A runner without a
    fused span (not eligible) is measured once, named ``unfused``."""
    runners: dict[str, Runner] = {}
    for kernel in (k.strip() for k in kernels.split(",")):
        runner = Runner.from_pretrained(model, dtype=dtype, device="cpu", kernel=kernel)
        if runner.kernel is None:
            runners["torch"] = runner
            continue
        path = f"kernel-{getattr(runner.kernel, 'path', lambda: 'avx2')()}"
        for attention in attentions:
            if attention == "sdpa":
                runners[f"{path} attn-sdpa unfused"] = on_sdpa(copy.copy(runner))
                continue
            for mode in fused if getattr(runner, "fused", None) is not None else ["off"]:
                name = f"{path} attn-{attention} {'fused' if mode == 'on' else 'unfused'}"
                runners[name] = runner if mode == "on" else unfused(copy.copy(runner))
    return runners


def int_list(text: str, flag: str) -> list[int]:
    """A flag's comma-separated integers, each >= 1 (a UserError naming the flag otherwise)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{flag} {text!r}: expected comma-separated integers") from None
    if not values or min(values) < 1:
        raise UserError(f"{flag} {text!r}: give integers >= 1")
    return values


def _row(name: str, r: dict, sizes: list[int]) -> str:
    vs = " | ".join(f"{r['v'][T]:.2f}" for T in sizes if T != 1)
    return (f"| {name} | {r['ms'][1]:.1f} | {r['step_gb_s']:.1f} | {r['probe_gb_s']:.1f} | {r['ratio']:.2f} | {vs} |")


def run(args: argparse.Namespace) -> int:
    sizes = sorted(set(int_list(args.sizes, "--sizes")) | {1})
    threads_list = int_list(args.threads_list, "--threads-list")
    attentions = [a.strip() for a in args.attention.split(",")]
    if not attentions or not set(attentions) <= {"rows", "sdpa"}:
        raise UserError(f"--attention {args.attention!r}: give rows, sdpa or both")
    fused = [f.strip() for f in args.fused.split(",")]
    if not fused or not set(fused) <= {"on", "off"}:
        raise UserError(f"--fused {args.fused!r}: give on, off or both")
    if args.out:
        check_output_file(args.out, "--out", force=args.force)
    settings = model_settings(args).resolve()
    if settings.device.type != "cpu":
        raise UserError("this benchmark measures CPU memory bandwidth; use --device cpu")
    results = []
    for dtype_text in args.dtypes.split(","):
        runners = routes(settings.model, parse_dtype(dtype_text.strip(), settings.device), args.kernels, attentions,
                         fused)
        for threads in threads_list:
            torch.set_num_threads(threads)
            for route, r in measure(runners, sizes, args.rounds, args.context).items():
                name = f"{dtype_text.strip()} {route} {threads}t"
                print(f"{name}: bandwidth ratio per round " + " ".join(f"{x:.2f}" for x in r["ratio_per_round"])
                      + f" (median {r['ratio']:.2f})", flush=True)
                results.append({"name": name, "dtype": dtype_text.strip(), "kernel": route, "threads": threads} | r)
        del runners
    print("\n| route | T=1 ms | step GB/s | probe GB/s | ratio | " + " | ".join(f"v({T})" for T in sizes if T != 1)
          + " |")
    print("|---|---|---|---|---|" + "---|" * (len(sizes) - 1))
    for r in results:
        print(_row(r["name"], r, sizes))
    if args.out:
        meta = {"context": args.context, "rounds": args.rounds, "sizes": sizes, "argv": sys.argv[1:]}
        write_result(args.out, meta | {"results": results})
    return 0


def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(p, skip=("executor", "dtype", "threads"))
    p.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16")
    p.add_argument("--threads-list", default="1,2", help="comma-separated thread counts")
    p.add_argument("--kernels", default="auto", help="comma-separated: auto (the C++ kernel where it runs), torch")
    p.add_argument("--attention", default="rows", help="comma-separated, for kernel runners: rows (the kernel's "
                   "row attention), sdpa (torch's, as before issue 44 item 4)")
    p.add_argument("--fused", default="on", help="comma-separated, for kernel runners: on (the fused layer span where "
                   "the runner has one), off (the Python layer loop)")
    p.add_argument("--sizes", default="1,2,4,8,16")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--context", type=int, default=200, help="tokens already in the cache")
    add_output_flags(p, "JSON file for the measured numbers")
    return parse_and_run(p, argv, "bench_step_bandwidth", run)


if __name__ == "__main__":
    sys.exit(main())
