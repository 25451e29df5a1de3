"""``layerskip generate``: decode prompts with any drafter; greedy output is identical to plain decoding in fp32.

In bf16/fp16 a near-tie can flip: verifying several tokens in one forward rounds differently from
one-token decoding, so where the model's top two tokens are within the dtype's resolution the
greedy choice may differ (``layerskip bench`` classifies every such mismatch).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from core.cli import check_output_file
from core.device import DEVICE_HELP, DTYPE_CHOICES, DTYPE_HELP, EXECUTOR_CHOICES, EXECUTOR_HELP, dtype_name
from core.errors import UserError
from core.options import add_flag
from core.prompts import PromptItem, read_prompts_file
from infer.bench import tokens_per_verify

EXACTNESS = "greedy output is identical to plain decoding in fp32; in bf16/fp16 a near-tie can flip"


def add_model_args(p: argparse.ArgumentParser, threads: int | None = None) -> None:
    """--model, --device, --dtype and --threads (``threads``: the default thread count; None = torch's choice)."""
    p.add_argument("--model", default="default",
                   help="a local Hugging Face model folder, or 'default' (SmolLM2-135M-Instruct, fetched on first use)")
    p.add_argument("--device", default="auto", help=f"where to run: {DEVICE_HELP} (default auto)")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help=f"weights/compute dtype: {DTYPE_HELP} (default auto; {EXACTNESS})")
    p.add_argument("--executor", default="auto", choices=EXECUTOR_CHOICES, help=EXECUTOR_HELP)
    p.add_argument("--threads", type=int, default=threads,
                   help=f"torch CPU threads (default: {threads if threads else 'torch' + chr(39) + 's choice'})")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128, help="generate at most this many tokens")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0 = off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop once the output contains TEXT (repeatable; not empty)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")


def add_drafter_args(p: argparse.ArgumentParser) -> None:
    """--drafter and one flag group per drafter; options several drafters share get a group of their own."""
    # infer.drafters, infer.engine and infer.loading import torch: loaded inside the functions that
    # need them, so --help and argument errors answer without it
    from infer.drafters import DRAFTERS, all_options

    p.add_argument("--drafter", default="autoregressive",
                   help=f"one of: {', '.join(DRAFTERS)} (default autoregressive)")
    options = all_options()
    current = [o for o in options.values() if not o.deprecated_for]
    shared = [o for o in current if len(o.owners) > 1]
    group = p.add_argument_group("options of several drafters (same meaning in each; defaults per drafter)")
    for o in shared:
        add_flag(group, o.field, o.type, f"{o.help()} [{', '.join(o.owners)}]")
    for name in DRAFTERS:
        own = [o for o in current if o.owners == [name]]
        if own:
            group = p.add_argument_group(f"{name} options")
            for o in own:
                add_flag(group, o.field, o.type, o.help())
    old = [o for o in options.values() if o.deprecated_for]
    if old:
        group = p.add_argument_group("deprecated option names (accepted for one release)")
        for o in old:
            add_flag(group, o.field, o.type, o.help())


def drafter_options(args: argparse.Namespace) -> dict:
    from infer.drafters import all_options

    return {f: getattr(args, f) for f in all_options() if getattr(args, f, None) is not None}


def generation_config(args: argparse.Namespace):
    from infer.engine import GenerationConfig
    from infer.sampling import SamplingConfig

    if any(not s for s in args.stop):
        raise UserError("--stop needs a non-empty text (an empty stop string would end every output at once)")
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    return GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=sampling, stop_strings=tuple(args.stop),
                            stop_at_eos=not args.ignore_eos)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text with a drafter (lossless: identical to plain decoding "
                       "in fp32; in bf16/fp16 a near-tie can flip)",
                       description="Generate with the draft-verify engine. Greedy output is token-for-token the "
                       "autoregressive output: identical in fp32; in bf16/fp16 a near-tie can flip. Sampling "
                       "follows the same distribution. '--drafter autoregressive --exit-layer E' is lossy early "
                       "exit: it decodes with layers [0, E) only, so the output is the exit layer's.")
    add_model_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompts-file", type=Path, help="a .jsonl file with a 'prompt' field per line")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.add_argument("--stream", action="store_true",
                   help="treat the prompts as one input stream: the drafter keeps its state (e.g. SWIFT's plan and "
                   "optimiser) across prompts; reports per-prompt statistics and a stream summary")
    add_sampling_args(p)
    add_drafter_args(p)
    p.set_defaults(func=run)


def _prompts(args: argparse.Namespace):
    if args.prompts_file is not None:
        items = read_prompts_file(args.prompts_file)
    else:
        items = [PromptItem("0", args.prompt)]
    for item in items:
        if not item.prompt.strip():
            raise UserError(f"prompt {item.id!r} is empty; give some text")
    return items


def _stats_line(name: str, stats) -> str:
    line = (f"[{name}] {stats.new_tokens} tokens in {stats.wall_time:.2f}s = {stats.tokens_per_second:.1f} tok/s, "
            f"{stats.verify_calls} verify calls, {stats.tokens_per_verify:.2f} tokens/verify")
    if stats.drafted:
        line += f", acceptance {stats.acceptance_rate:.2f} ({stats.accepted}/{stats.drafted})"
    return line


def _notes(args: argparse.Namespace, engine, dtype: str, greedy: bool) -> None:
    """Say once on stderr when the output is not the full model's plain greedy decoding."""
    lossy = engine.exit_layer
    if lossy is not None:
        print(f"layerskip: note: lossy early exit: the output is exit layer {lossy}'s (layers [0, {lossy}) + "
              f"norm + head), not the {engine.runner.num_layers}-layer model's", file=sys.stderr)
    elif greedy and dtype != "fp32" and args.drafter != "autoregressive":
        print(f"layerskip: note: in {dtype}, greedy output may differ from plain decoding where two tokens "
              "nearly tie (a near-tie can flip; identical in fp32)", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    from infer.drafters import build_config, drafter_class
    from infer.loading import load_model, set_threads

    # Everything that can be checked without the model is checked first.
    drafter_class(args.drafter)
    options = drafter_options(args)
    config = build_config(args.drafter, options)
    if getattr(config, "save_plan", None):
        check_output_file(config.save_plan, "--save-plan")
    gen = generation_config(args)
    prompts = _prompts(args)
    set_threads(args.threads)

    model = load_model(args.model, args.dtype, args.device, args.executor)
    device, dtype = str(model.runner.device), dtype_name(model.runner.dtype)
    encoded = [model.encode(item.prompt, args.chat) for item in prompts]
    engine = model.engine(args.drafter, options)
    lossy = engine.exit_layer is not None
    _notes(args, engine, dtype, gen.sampling.greedy)
    results = []
    for item, ids in zip(prompts, encoded, strict=True):
        if not args.stream and results:
            engine.drafter.finish()
            engine = model.engine(args.drafter, options)  # independent prompts: fresh drafter state
        result = engine.generate(ids, gen)
        results.append(result)
        if args.json:
            stats = result.stats.to_dict() | {"device": device, "dtype": dtype, "lossy": lossy,
                                              "executor": model.runner.executor}
            print(json.dumps({"id": item.id, "prompt": item.prompt, "drafter": args.drafter, "tokens": result.tokens,
                              "text": result.text, "finish_reason": result.finish_reason,
                              "stats": stats}), flush=True)
        else:
            if len(prompts) > 1:
                print(f"### {item.id}")
            print(result.text, flush=True)
            print(_stats_line(args.drafter, result.stats), file=sys.stderr, flush=True)
    engine.drafter.finish()  # after the output is printed: --save-plan, the gate's memory
    if args.stream:
        _stream_summary(args, results)
    return 0


def stream_summary(results) -> dict:
    """Totals over a stream of prompts: speed, acceptance, optimisation share, matchness trajectory."""
    stats = [r.stats for r in results]
    wall = sum(s.wall_time for s in stats)
    drafted = sum(s.drafted for s in stats)
    opt = sum(float(s.drafter.get("opt_time", 0.0)) for s in stats)
    last = stats[-1].drafter if stats else {}
    return {
        "prompts": len(stats), "new_tokens": sum(s.new_tokens for s in stats),
        "tokens_per_second": sum(s.new_tokens for s in stats) / wall if wall else 0.0,
        "acceptance_rate": sum(s.accepted for s in stats) / drafted if drafted else 0.0,
        "tokens_per_verify": tokens_per_verify(stats) or 0.0,
        "opt_time_share": opt / wall if wall else 0.0,
        "matchness_trajectory": [p for s in stats for p in s.drafter.get("matchness_trajectory", [])],
        "final_drafter_state": {k: v for k, v in last.items() if k != "matchness_trajectory"},
    }


def _stream_summary(args: argparse.Namespace, results) -> None:
    summary = stream_summary(results)
    if args.json:
        print(json.dumps({"stream_summary": summary}), flush=True)
        return
    traj = summary["matchness_trajectory"]
    print(f"[stream] {summary['prompts']} prompts, {summary['new_tokens']} tokens, "
          f"{summary['tokens_per_second']:.1f} tok/s, acceptance {summary['acceptance_rate']:.2f}, "
          f"{summary['tokens_per_verify']:.2f} tokens/verify, optimisation {summary['opt_time_share']:.1%} of time",
          file=sys.stderr)
    if traj:
        marks = traj[:: max(1, len(traj) // 8)] + [traj[-1]]
        print("[stream] best matchness by optimisation step: " + ", ".join(f"{s}:{m:.2f}" for s, m in marks),
              file=sys.stderr)
    state = summary["final_drafter_state"]
    if "plan" in state:
        print(f"[stream] final plan: {state['plan']}", file=sys.stderr)
