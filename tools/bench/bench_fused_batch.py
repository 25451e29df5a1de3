"""A decoding cycle of B sequences, the fused executor against the Python layer loop, in the same rounds.

    python -m tools.bench.bench_fused_batch --batch-sizes 1,4,8 --rounds 9 --threads 1
    python -m tools.bench.bench_fused_batch --shape gemma3-270m --batch-sizes 1 --rows 1,4 --rounds 9
    python -m tools.bench.bench_fused_batch --shape qwen3-0.6b --batch-sizes 1 --rows 1,4 --rounds 9

Each of B sequences holds its own cache of ``--context`` tokens (a few tokens apart, so the rows attend over
different lengths); one forward runs T new tokens of each (``--rows``: 1 is plain decoding's step) through every
layer and the LM head (``--head off``: the layers only), packed as N = B T rows (``Runner.run``), then the caches
roll back. Each round times, for every B and T, the runner with its fused executor (``fused``:
``infer.model.fused_span``) and the same runner without it (``loop``: ``infer.model.loop``), one after the other
(their order alternating by round), so the host's load hits both alike. Printed per (B, T): the median milliseconds
of a cycle, tokens per second (B T / cycle), and as medians of per-round ratios with their ranges loop / fused and
each route's tokens per second against its B = 1 (the decode phase's scaling: one weight stream for B rows).

``--shape`` builds a runner over seeded random weights in a real model's shape instead of ``--model``'s checkpoint
(``SHAPES``: Gemma 3 270M, Qwen3 0.6B), for families that have no small checkpoint in the cache.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch

from infer.model.program import Program, Rows, Segment
from infer.model.runner import Runner
from layerskip_cli.args import add_model_flags, model_settings
from layerskip_core.cli import Parser, parse_and_run
from layerskip_core.errors import UserError
from layerskip_core.families import ModelSpec
from tools.bench.bench_step_bandwidth import int_list

SHAPES = {
    "gemma3-270m": ("Gemma3TextConfig", dict(num_hidden_layers=18, hidden_size=640, num_attention_heads=4,
                                             num_key_value_heads=1, head_dim=256, intermediate_size=2048,
                                             vocab_size=262144, sliding_window=512, query_pre_attn_scalar=256,
                                             max_position_embeddings=32768, final_logit_softcapping=None)),
    "qwen3-0.6b": ("Qwen3Config", dict(num_hidden_layers=28, hidden_size=1024, num_attention_heads=16,
                                       num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                                       vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=True)),
}
"""Real models' shapes (their configs' numbers) for ``--shape``."""


def random_runner(shape: str, dtype: torch.dtype) -> Runner:
    """A runner over seeded random weights (matrices N(0, 0.02), norm weights near their neutral value) in ``shape``."""
    import transformers

    name, fields = SHAPES[shape]
    config = getattr(transformers, name)(**fields)
    gen = torch.Generator().manual_seed(0)
    state = {}
    for key, (dims, _, needed) in ModelSpec.from_config(config).weight_shapes().items():
        if not needed:
            continue
        if len(dims) == 1:  # a norm: Gemma's scales by 1 + w (w near 0), the others by w (near 1)
            base = 0.0 if config.model_type == "gemma3_text" else 1.0
            state[key] = base + 0.1 * torch.randn(dims, generator=gen)
        else:
            state[key] = 0.02 * torch.randn(dims, generator=gen)
    return Runner(config, state, dtype=dtype)


def caches(runner: Runner, B: int, context: int) -> list:
    """B caches, sequence b holding ``context + 3 b`` tokens."""
    out = []
    for b in range(B):
        cache = runner.new_cache(context + 3 * B + 64)
        runner.forward(cache, (torch.arange(context + 3 * b) * (5 + b)) % 1000 + 100)
        out.append(cache)
    return out


def cycle(runner: Runner, held: list, T: int, head: bool = True) -> float:
    """One forward of T new tokens of each cache (all layers, and the LM head unless ``head`` is False), then the
    caches rolled back: seconds."""
    lengths = [c.lengths[0] for c in held]
    segments = [Segment(c, list(range(n, n + T))) for c, n in zip(held, lengths, strict=True)]
    hidden = runner.embed(torch.arange(len(held) * T) % 500 + 200)  # (B T, d)
    t0 = time.perf_counter()
    runner.run(Program(0, runner.num_layers, logits=head), Rows(hidden, segments))
    seconds = time.perf_counter() - t0
    for c, n in zip(held, lengths, strict=True):
        c.rollback(n)
    return seconds


def measure(runner: Runner, sizes: list[int], rows: list[int], rounds: int, context: int, head: bool) -> dict:
    """{(route, B, T): seconds per round}, the routes alternated within each round."""
    loop = copy.copy(runner)
    loop.fused = None
    routes = {"fused": runner, "loop": loop}
    held = {B: caches(runner, B, context) for B in sizes}
    for B in sizes:  # warm-up
        for T in rows:
            for r in routes.values():
                cycle(r, held[B], T, head)
    times = {(name, B, T): [] for name in routes for B in sizes for T in rows}
    for k in range(rounds):
        for B in sizes:
            for T in rows:
                for name in (list(routes) if k % 2 == 0 else list(routes)[::-1]):
                    times[name, B, T].append(cycle(routes[name], held[B], T, head))
    return times


def _paired(a: list[float], b: list[float]) -> str:
    """The median of per-round ratios a / b, and their range."""
    r = sorted(x / y for x, y in zip(a, b, strict=True))
    return f"{statistics.median(r):.2f} ({r[0]:.2f}-{r[-1]:.2f})"


def report(times: dict, sizes: list[int], rows: list[int]) -> None:
    """Per (B, T): median ms and tokens/s of each route; loop / fused and each route's tokens/s against its B = 1 (the
    smallest B), as medians of per-round ratios (both terms from the same round) with their ranges."""
    print("\n| B | T | fused ms | loop ms | loop / fused | fused tok/s | loop tok/s | fused vs B=1 | loop vs B=1 |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    med = {key: statistics.median(v) for key, v in times.items()}
    b1 = sizes[0]
    for T in rows:
        for B in sizes:
            f, lp = med["fused", B, T], med["loop", B, T]
            scale = [_paired([B * x for x in times[name, b1, T]], [b1 * x for x in times[name, B, T]])
                     for name in ("fused", "loop")]
            gain = _paired(times["loop", B, T], times["fused", B, T])
            print(f"| {B} | {T} | {1000 * f:.1f} | {1000 * lp:.1f} | {gain} | {B * T / f:.1f} | {B * T / lp:.1f} | "
                  f"{scale[0]} | {scale[1]} |")


def run(args: argparse.Namespace) -> int:
    sizes, rows = int_list(args.batch_sizes, "--batch-sizes"), int_list(args.rows, "--rows")
    settings = model_settings(args).resolve()
    if settings.device.type != "cpu":
        raise UserError("the fused executor runs on a CPU; use --device cpu")
    torch.set_num_threads(settings.threads)
    runner = random_runner(args.shape, settings.dtype) if args.shape else \
        Runner.from_pretrained(settings.model, dtype=settings.dtype)
    if runner.fused is None:
        from infer.model.fused_span import unfit

        raise UserError(f"this runner has no fused executor ({unfit(runner)})")
    print(f"{args.shape or settings.model}: {runner.num_layers} layers, {settings.dtype}, {settings.threads} "
          f"thread(s), context {args.context}, {args.rounds} rounds{'' if args.head == 'on' else ', no LM head'}",
          flush=True)
    times = measure(runner, sizes, rows, args.rounds, args.context, args.head == "on")
    report(times, sizes, rows)
    if runner.declines:
        print("declined:", runner.declines)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(p, skip=("executor",))
    p.add_argument("--shape", choices=sorted(SHAPES), help="random weights in a real model's shape (not --model)")
    p.add_argument("--batch-sizes", default="1,4,8", help="comma-separated B: sequences per forward")
    p.add_argument("--rows", default="1", help="comma-separated T: new tokens per sequence (1: a decoding step)")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--context", type=int, default=200, help="tokens already in each cache")
    p.add_argument("--head", choices=("on", "off"), default="on", help="off: the layers only, without the LM head")
    return parse_and_run(p, argv, "bench_fused_batch", run)


if __name__ == "__main__":
    sys.exit(main())
