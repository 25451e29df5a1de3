"""The draft cost c of every drafter at every draft dtype, and what its draft reads and holds (issue 64 item 5).

    python -m tools.bench.bench_draft_cost --model default --threads 1 --repeats 7 --out runs/draft_cost.json

c is one draft forward's time over one plain decoding step's (the drafter's own forward object, as its chains call
it: layers, head and the Python around them), both on the same prompt and position, interleaved, median of repeats;
beside it the bytes one draft forward reads over the bytes a plain step reads (what c would be at the read bandwidth)
and the megabytes of weights the draft holds beyond the model (its copies of layers, the exit adapter, the draft
head). Drafters: early exit at E = 8 and at E = L (the model's own copy: ``quant_self`` when quantized), the shipped
exit adapter where the model has one, dynamic exit's candidate exits, Self-SD and SWIFT with SWIFT's uniform start plan
(skip ratio 0.45), each at draft dtype model (the model's), bf16, int8 and int4 (``--draft-dtypes``) with its
defaults otherwise (prefix auto, draft_vocab auto). The speed-up a drafter can reach is M / (k c + v(T))
(``tools/bench/bench_verify_cost.py`` measures v).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from infer.decode.engine import DecodeConfig, Engine
from infer.drafters import drafter_spec
from infer.drafters.chain import EarlyExitForward, PlanForward
from infer.drafters.prefix_copy import CopiedPrefixForward
from infer.model.plan import LayerPlan
from infer.model.quant_weights import copy_nbytes
from infer.model.runner import Runner
from infer.model.weights import LayerWeights
from layerskip_cli.args import add_model_flags, model_settings
from layerskip_core.cli import Parser, add_output_flags, check_output_file, parse_and_run, write_result
from layerskip_core.device import dtype_name
from layerskip_core.errors import UserError

DTYPES = ("model", "bf16", "int8", "int4")
PROMPT_TOKENS = 120
"""Prompt length before the measured position (the KV a forward attends over)."""
MB = 1e6


def cases(runner: Runner) -> list[tuple[str, str, dict]]:
    """(label, drafter, options) of every drafter row, without the draft dtype."""
    L = runner.num_layers
    uniform = LayerPlan(L, frozenset(range(1, L - 1, 2)), frozenset(range(2, L - 1, 2)))  # ~0.45 of the sublayers
    rows = [("early_exit E=8", "early_exit", {"exit_layer": min(8, L)}),
            (f"early_exit E={L}", "early_exit", {"exit_layer": L}),  # int8 / int4: quant_self
            ("early_exit adapter=default", "early_exit", {"adapter": "default"}),
            ("dynamic_exit", "dynamic_exit", {}),
            ("self_sd (uniform plan)", "self_sd", {"plan": uniform}),
            ("swift (uniform start plan)", "swift", {"plan": uniform, "adaptive": False, "remember": "off"})]
    return rows


def forwards(drafter) -> list[tuple[str, object]]:
    """The draft forward objects a drafter chains: (suffix for the label, forward)."""
    if hasattr(drafter, "forwards_at"):
        return [(f" E={e}", f) for e, f in drafter.forwards_at.items()]
    return [("", drafter.forward)]


def matrices(w: LayerWeights, attn: bool = True, mlp: bool = True) -> list:
    return [m for m in ((w.qkv, w.o) if attn else ()) + ((w.gate_up, w.down) if mlp else ()) if m is not None]


def reads_and_holds(runner: Runner, forward) -> tuple[int, int]:
    """(bytes one draft forward reads of weights, bytes of weights it holds beyond the model's)."""
    head = forward.vocab.linear.nbytes if forward.vocab is not None else runner.lm_head.nbytes
    held = 0 if forward.vocab is None else forward.vocab.linear.nbytes
    if isinstance(forward, CopiedPrefixForward):
        layers = forward.prefix.layers[:forward.exit_layer]
        extra = [] if forward.adapter is None else forward.adapter.layer.layers
        own = copy_nbytes(layers) + copy_nbytes(extra)
        return own + head, own + held
    if isinstance(forward, PlanForward):
        r = forward.runner
        read = sum(m.nbytes for s in forward.program.steps for m in matrices(r.layers[s.layer], s.attn, s.mlp))
        return read + head, held + (0 if r is runner else copy_nbytes(r.layers))
    if isinstance(forward, EarlyExitForward):
        r = forward.runner
        read = copy_nbytes(r.layers[:forward.exit_layer])
        return read + head, held + (0 if r is runner else read)
    adapter = copy_nbytes(forward.adapter.layer.layers)  # AdapterForward: the model's layers [0, E), then its own
    return copy_nbytes(runner.layers[:forward.exact_layers]) + adapter + head, adapter + held


def timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure_one(runner: Runner, name: str, options: dict, repeats: int) -> list[dict]:
    """Each draft forward of drafter ``name`` against a plain step at the same position: c, bytes, held."""
    engine = Engine(runner, drafter_spec(name, options).build(runner))
    prompt = list(range(100, 100 + PROMPT_TOKENS))
    gen = engine.start(prompt, DecodeConfig(max_new_tokens=8, stop_at_eos=False))
    state, n = gen.state, gen.state.n
    token = runner.to_device([state.pending])  # (1,)

    def rollback(forward) -> None:
        state.cache.rollback(n)
        for own in ("cache", "adapter_cache"):
            if getattr(forward, own, None) is not None:
                getattr(forward, own).rollback(n)

    def plain() -> None:
        runner.forward(state.cache, token, torch.tensor([n]))
        state.cache.rollback(n)

    rows = []
    for suffix, forward in forwards(engine.drafter):
        draft = lambda f=forward: (f(state.cache, token, n), rollback(f))  # noqa: E731
        times = {"draft": [], "plain": []}
        for fn in (draft, plain):  # warm: anything built on first use
            fn()
        for _ in range(repeats):
            times["draft"].append(timed(draft))
            times["plain"].append(timed(plain))
        reads, holds = reads_and_holds(runner, forward)
        step = statistics.median(times["plain"])
        rows.append({"suffix": suffix, "draft_ms": 1e3 * statistics.median(times["draft"]), "plain_ms": 1e3 * step,
                     "c": statistics.median(times["draft"]) / step, "c_bytes": reads / plain_bytes(runner),
                     "read_mb": reads / MB, "held_mb": holds / MB})
    runner.release_cache(state.cache)
    engine.close()
    return rows


def plain_bytes(runner: Runner) -> int:
    return copy_nbytes(runner.layers) + runner.lm_head.nbytes


def measure(runner: Runner, draft_dtypes: list[str], repeats: int) -> list[dict]:
    out = []
    for label, name, options in cases(runner):
        for dt in draft_dtypes:
            try:
                rows = measure_one(runner, name, options | {"draft_dtype": dt}, repeats)
            except UserError as e:  # a model without a shipped adapter, int4 widths that do not fit: said, not hidden
                print(f"{label} draft_dtype={dt}: not measured: {e}", file=sys.stderr)
                continue
            out += [{"drafter": label + r.pop("suffix"), "draft_dtype": dt} | r for r in rows]
    return out


def table(rows: list[dict]) -> str:
    lines = ["| drafter | draft dtype | c (measured) | c (bytes read) | draft forward ms | plain step ms | "
             "MB read a draft | MB held beyond the model |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['drafter']} | {r['draft_dtype']} | {r['c']:.3f} | {r['c_bytes']:.3f} | {r['draft_ms']:.2f} | "
              f"{r['plain_ms']:.2f} | {r['read_mb']:.1f} | {r['held_mb']:.1f} |" for r in rows]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    dtypes = [d.strip() for d in args.draft_dtypes.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad or not dtypes:
        raise UserError(f"--draft-dtypes {args.draft_dtypes!r}: give some of {', '.join(DTYPES)}")
    if args.repeats < 1:
        raise UserError(f"--repeats must be >= 1, got {args.repeats}")
    if args.out:
        check_output_file(args.out, "--out", force=args.force)
    settings = model_settings(args).resolve()
    settings.apply_threads()
    runner = Runner.from_pretrained(settings.model, dtype=settings.dtype, device=settings.device)
    rows = measure(runner, dtypes, args.repeats)
    print(table(rows))
    if args.out:
        meta = {"threads": settings.threads, "device": str(settings.device), "dtype": dtype_name(settings.dtype),
                "repeats": args.repeats, "prompt_tokens": PROMPT_TOKENS}
        write_result(args.out, meta | {"rows": rows})
    return 0


def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(p, skip=("executor",))
    p.add_argument("--draft-dtypes", default=",".join(DTYPES), help="comma-separated: model, bf16, int8, int4")
    p.add_argument("--repeats", type=int, default=7)
    add_output_flags(p, "JSON file for the measured numbers")
    return parse_and_run(p, argv, "bench_draft_cost", run)


if __name__ == "__main__":
    sys.exit(main())
