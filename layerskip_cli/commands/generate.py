"""``layerskip generate``: decode prompts with any drafter; greedy output is identical to plain decoding in fp32.

In bf16/fp16 a near-tie can flip: verifying several tokens in one forward rounds differently from
one-token decoding, so where the model's top two tokens are within the dtype's resolution the
greedy choice may differ (``layerskip bench`` classifies every such mismatch).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from layerskip_cli.args import (
    add_drafter_flags,
    add_model_flags,
    add_sampling_flags,
    drafter_spec_of,
    model_settings,
    sampling_config,
)
from layerskip_core.cli import check_output_file
from layerskip_core.device import dtype_name
from layerskip_core.errors import UserError
from layerskip_core.options import add_dataclass_flags, from_args
from layerskip_core.prompts import PromptItem, check_text, read_prompts_file

ORDERS = ("input", "finish")
"""``--order``: a batch's rows printed in the prompts' order, or as they finish."""


def add_generation_flags(p: argparse.ArgumentParser) -> None:
    """--max-new-tokens and --target-exit (``DecodeConfig``), --stop, --ignore-eos, and the sampling flags."""
    from infer.decode.engine import DecodeConfig  # torch-heavy: imported when the parser is built

    group = p.add_argument_group("generation")
    add_dataclass_flags(group, DecodeConfig, skip=("sampling", "stop_strings", "stop_at_eos"))
    group.add_argument("--stop", action="append", default=[], metavar="TEXT",
                       help="stop at the token that completes TEXT (repeatable; not empty; a match may begin in the "
                            "prompt's last tokens, as transformers' stop_strings)")
    group.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    add_sampling_flags(p)


def generation_config(args: argparse.Namespace):
    """The DecodeConfig of the flags."""
    from infer.decode.engine import DecodeConfig  # lazy: torch, when the command runs

    if any(not s for s in args.stop):
        raise UserError("--stop needs a non-empty text (an empty stop string would end every output at once)")
    fields = from_args(DecodeConfig, args, DecodeConfig(), skip=("sampling", "stop_strings", "stop_at_eos"))
    return dataclasses.replace(fields, sampling=sampling_config(args), stop_strings=tuple(args.stop),
                               stop_at_eos=not args.ignore_eos)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text with a drafter (lossless: identical to plain decoding "
                       "in fp32; in bf16/fp16 a near-tie can flip)",
                       description="Generate with the draft-verify engine. Greedy output is token-for-token the "
                       "autoregressive output: identical in fp32; in bf16/fp16 a near-tie can flip (not on the "
                       "CPU kernel's batch-invariant bf16 path). Sampling "
                       "follows the same distribution. '--target-exit E' is lossy early exit: plain decoding with "
                       "layers [0, E) only, so the output is the exit layer's.")
    add_model_flags(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompts-file", type=Path, help="a .jsonl file with a 'prompt' field per line")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.add_argument("--force", action="store_true", help="overwrite an existing file named by swift's --save-plan")
    p.add_argument("--stream", action="store_true",
                   help="treat the prompts as one input stream: the drafter keeps its state (e.g. SWIFT's plan and "
                   "optimiser) across prompts; reports per-prompt statistics and a stream summary")
    p.add_argument("--batch-size", type=int, default=1, metavar="B",
                   help="decode B prompts at a time in one batched engine, printed in the prompts' order under "
                   "their ids (see --order; each prompt gets a fresh drafter and its output is the same as alone, "
                   "also sampled with --seed unless a drafter decides from measured time: --adaptive, dynamic_exit's "
                   "calibrate, SWIFT's fallback; rows that finish leave, the next "
                   "prompts join); not with --stream")
    p.add_argument("--order", choices=ORDERS, default="input",
                   help="with --batch-size: input = print the rows in the prompts' order (a row that finishes early "
                   "waits for the rows before it), finish = as they finish; either way a run stopped by Ctrl-C or "
                   "SIGTERM prints every row that finished (default input)")
    add_generation_flags(p)
    add_drafter_flags(p)
    p.set_defaults(func=run)


def _prompts(args: argparse.Namespace):
    if args.prompts_file is not None:
        items = read_prompts_file(args.prompts_file)
    else:
        items = [PromptItem("0", check_text(args.prompt, "--prompt"))]
    for item in items:
        if not item.prompt.strip():
            raise UserError(f"prompt {item.id!r} is empty; give some text")
    return items


def _stats_line(name: str, stats) -> str:
    line = (f"[{name}] {stats.new_tokens} tokens in {stats.wall_time:.2f}s = {stats.tokens_per_second:.1f} tok/s, "
            f"{stats.verify_calls} verify calls, {stats.tokens_per_verify:.2f} tokens/verify")
    if stats.drafted:
        line += (f", acceptance {stats.acceptance_rate:.2f} ({stats.accepted}/{stats.drafted}), "
                 f"{stats.drafted} drafted for {stats.new_tokens} tokens")  # how much drafting there was at all
    elif name != "autoregressive":
        line += "; never drafted: every step was a plain step (the drafter judged drafting would not pay)"
    return line


def _notes(args: argparse.Namespace, engine, dtype: str, generation) -> None:
    """Say once on stderr when the output is not the full model's plain greedy decoding."""
    depth = engine.target_depth(generation)
    if depth != engine.runner.num_layers:
        print(f"layerskip: note: lossy early exit: the output is exit layer {depth}'s (layers [0, {depth}) + "
              f"norm + head), not the {engine.runner.num_layers}-layer model's", file=sys.stderr)
    elif generation.sampling.greedy and dtype != "fp32" and args.drafter != "autoregressive":
        print(f"layerskip: note: in {dtype}, greedy output may differ from plain decoding where two tokens "
              "nearly tie (a near-tie can flip; identical in fp32)", file=sys.stderr)


def _print_result(args: argparse.Namespace, model, item: PromptItem, result, several: bool) -> None:
    if args.json:
        stats = result.stats.to_dict() | {"device": str(model.runner.device), "dtype": dtype_name(model.runner.dtype),
                                          "executor": model.runner.executor, "batch_size": args.batch_size}
        print(json.dumps({"kind": "prompt", "id": item.id, "prompt": item.prompt, "drafter": args.drafter,
                          "tokens": result.tokens, "text": result.text, "finish_reason": result.finish_reason,
                          "stats": stats}), flush=True)
        return
    if several:
        print(f"### {item.id}")
    print(result.text, flush=True)
    print(_stats_line(args.drafter, result.stats), file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    # Everything that can be checked without the model is checked first; an output that exists before anything
    # heavy is imported (a refusal in a moment, not after transformers loads).
    if getattr(args, "save_plan", None):
        reads = [(f"--{k.replace('_', '-')}", getattr(args, k, None)) for k in ("plan", "draft_vocab", "adapter")]
        reads = [(f, v) for f, v in reads if isinstance(v, str)] + [("--prompts-file", args.prompts_file)]
        check_output_file(args.save_plan, "--save-plan", force=args.force, inputs=tuple(reads))
    from infer.loading import load_resolved  # lazy: transformers, when the command runs

    spec = drafter_spec_of(args)  # parsed and checked once
    generation = generation_config(args)
    if args.batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {args.batch_size}")
    prompts = _prompts(args)
    resolved = model_settings(args).resolve()  # once; a missing GPU is refused before the model loads
    if args.batch_size > 1 and args.stream:
        raise UserError("--stream keeps one drafter over the prompts in turn; drop --stream or --batch-size")
    args.batch_size = min(args.batch_size, len(prompts))  # one row slot per row, built up front: none unused
    model = load_resolved(resolved)
    encoded = [model.encode(item.prompt, args.chat) for item in prompts]
    drafter = spec.resolve(model.runner, model.tokenizer)  # once: every engine below builds its drafter from it
    engine = model.engine(spec.drafter, drafter)
    _notes(args, engine, dtype_name(model.runner.dtype), generation)
    if args.batch_size > 1:
        engine.close()
        printer = RowPrinter(lambda i, result: _print_result(args, model, prompts[i], result, True), args.order)
        with model.batch_engine(spec.drafter, drafter, batch_size=args.batch_size) as batch, \
                printer.keeping_finished(), _stop_on_sigterm():
            batch.generate(encoded, generation, on_result=printer)
        return 0
    results = []
    for item, ids in zip(prompts, encoded, strict=True):
        if not args.stream and results:
            engine.close()
            engine = model.engine(spec.drafter, drafter)  # independent prompts: fresh drafter state
        results.append(engine.generate(ids, generation))
        _print_result(args, model, item, results[-1], len(prompts) > 1)
    engine.close()  # after the output is printed: --save-plan, the gate's memory
    if args.stream:
        _stream_summary(args, results)
    _say_if_drafting_lost(spec, model.runner, results)
    return 0


class RowPrinter:
    """A batch's finished rows to ``emit(i, result)``: in the prompts' order (``order`` 'input': a row that finishes
    early is held until every row before it is printed) or as they finish ('finish'). ``keeping_finished`` prints
    every row still held when the run is stopped, so a stopped run loses no finished row."""

    def __init__(self, emit: Callable, order: str):
        self.emit, self.order = emit, order
        self.held: dict[int, object] = {}
        """Finished rows waiting for a row before them, by prompt index."""
        self.next = 0
        """The prompt index printed next in input order."""

    def __call__(self, i: int, result) -> None:
        if self.order == "finish":
            self.emit(i, result)
            return
        self.held[i] = result
        while self.next in self.held:
            self.emit(self.next, self.held.pop(self.next))
            self.next += 1

    @contextlib.contextmanager
    def keeping_finished(self) -> Iterator[None]:
        """On any stop but a closed output, print the rows still held (in the prompts' order), then stop."""
        try:
            yield
        except BrokenPipeError:  # the reader is gone: nothing more can reach it
            raise
        except BaseException:
            if self.held:
                print(f"layerskip: stopped: the {len(self.held)} finished row(s) after the first unfinished one "
                      "follow, each under its id", file=sys.stderr, flush=True)
            for i in sorted(self.held):
                self.emit(i, self.held.pop(i))
            raise


@contextlib.contextmanager
def _stop_on_sigterm() -> Iterator[None]:
    """SIGTERM raises (exit status 143) while the block runs, so what is finished is printed before the exit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, _frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _say_if_drafting_lost(spec, runner, results) -> None:
    """Once, at the end: when drafting was measurably slower than plain decoding would have been (estimated from the
    run's own statistics: ``infer.measure.verdict``), say so on stderr with what to use instead."""
    from infer.drafters.spec import check_best  # lazy: torch, when the command runs
    from infer.measure.verdict import judge  # lazy, as above

    verdict = judge([r.stats for r in results if not r.stats.lossy])
    if verdict is None or not verdict.slower:
        return
    instead = []
    if not spec.best:
        with contextlib.suppress(UserError):  # refused: no best setting is known for this model
            check_best(runner)
            instead.append("--drafter best (this model's best measured setting)")
    if getattr(spec.config, "adaptive", True) is False:
        instead.append("--adaptive (draft only while drafting measures faster)")
    instead.append("plain decoding (--drafter autoregressive)")
    print(f"layerskip: note: drafting was slower than plain decoding here: {verdict.describe()}; use "
          f"{', or '.join(instead)}",
          file=sys.stderr, flush=True)


def stream_summary(results) -> dict:
    """Totals over a stream of prompts: speed, acceptance, optimisation share, matchness trajectory."""
    from infer.decode.engine import tokens_per_verify  # lazy: torch, when the command runs
    from infer.drafters.swift import SwiftStats  # torch-heavy: see the module docstring

    stats = [r.stats for r in results]
    wall = sum(s.wall_time for s in stats)
    drafted = sum(s.drafted for s in stats)
    swift = [s.drafter for s in stats if isinstance(s.drafter, SwiftStats)]
    last = dataclasses.asdict(stats[-1].drafter) if stats else {}
    return {
        "prompts": len(stats), "new_tokens": sum(s.new_tokens for s in stats),
        "tokens_per_second": sum(s.new_tokens for s in stats) / wall if wall else 0.0,
        "acceptance_rate": sum(s.accepted for s in stats) / drafted if drafted else 0.0, "drafted": drafted,
        "tokens_per_verify": tokens_per_verify(stats) or 0.0,
        "opt_time_share": sum(s.opt_time for s in swift) / wall if wall else 0.0,
        "matchness_trajectory": [p for s in swift for p in s.matchness_trajectory],
        "final_drafter_state": {k: v for k, v in last.items() if k != "matchness_trajectory"},
    }


def _stream_summary(args: argparse.Namespace, results) -> None:
    summary = stream_summary(results)
    if args.json:  # self-describing like the prompts' objects: totals over the stream under "stats"
        print(json.dumps({"kind": "stream_summary", "drafter": args.drafter, "stats": summary}), flush=True)
        return
    traj = summary["matchness_trajectory"]
    print(f"[stream] {summary['prompts']} prompts, {summary['new_tokens']} tokens, "
          f"{summary['tokens_per_second']:.1f} tok/s, acceptance {summary['acceptance_rate']:.2f} "
          f"({summary['drafted']} drafted for {summary['new_tokens']} tokens), "
          f"{summary['tokens_per_verify']:.2f} tokens/verify, optimisation {summary['opt_time_share']:.1%} of time",
          file=sys.stderr)
    if traj:
        marks = traj[:: max(1, len(traj) // 8)] + [traj[-1]]
        print("[stream] best matchness by optimisation step: " + ", ".join(f"{s}:{m:.2f}" for s, m in marks),
              file=sys.stderr)
    state = summary["final_drafter_state"]
    if "plan" in state:
        print(f"[stream] final plan: {state['plan']}", file=sys.stderr)
