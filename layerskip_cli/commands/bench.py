"""``layerskip bench``: drafters and `transformers` peers, side by side, on real prompt sets."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from layerskip_cli.args import add_run_flags, add_sampling_flags, run_settings, sampling_config
from layerskip_core.cli import check_output_dir, holding_output_dir
from layerskip_core.errors import UserError
from layerskip_core.prompts import CHAT_MODES


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    return values


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark drafters and transformers peers on real prompts",
                       description="Time every method on the same held-out prompts (interleaved, median of repeats), "
                       "check greedy exactness against autoregressive (identical in fp32; in bf16/fp16 a near-tie can "
                       "flip: such tie flips are reported, any other mismatch makes the bench exit 1 after writing its "
                       "results), and write results.json/.csv/.md and plots. 'autoregressive:target_exit=8' is lossy "
                       "early exit, reported with its agreement with the full model and its GSM8K answer accuracy.")
    p.add_argument("--model", action="append", dest="models", default=None,
                   help="model folder, 'default' or 'gemma3-270m', optionally NAME=PATH (repeatable: e.g. base=default "
                   "trained=runs/cpu-demo/final); '{model}' in a drafter option becomes NAME")
    p.add_argument("--drafters", default="autoregressive,early_exit:E=8:k=6",
                   help="comma-separated drafter specs, e.g. autoregressive,early_exit:E=8:k=6,self_sd:plan=P,swift; "
                   "autoregressive:target_exit=8 = lossy early exit (layers [0, 8) only)")
    p.add_argument("--peers", default=None,
                   help="transformers peers: hf_generate, hf_static (static cache; compiled on CUDA), "
                   "hf_early_exit:E=8, prompt_lookup (default: hf_generate, prompt_lookup and hf_early_exit at each "
                   "early_exit E); 'none' for no peers")
    p.add_argument("--data", default="humaneval,gsm8k", help="comma-separated prompt sources: humaneval, gsm8k, "
                   "a .jsonl file with 'prompt' fields, or a folder of text files")
    p.add_argument("--n", type=int, default=8, help="prompts per task (from the end of each set: held out)")
    p.add_argument("--skip", type=int, default=0, help="leave out the last SKIP prompts of each set first: choose "
                   "settings (e.g. --sweep) with --skip N, then report them on the held-out last N without it")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="timed repeats (median reported)")
    p.add_argument("--batch-size", default=None, help="batched bench: decode each task's prompts B at a time, for "
                   "one B or a list (e.g. 1,4,8): our drafters through the batched engine, the transformers peers "
                   "as left-padded batched generate (peers then default to hf_generate); reports total tokens/s, "
                   "per-row latency and the speed-up vs B=1")
    p.add_argument("--start", default="cold", choices=["cold", "warm"],
                   help="what timed drafters start from: cold (default: nothing remembered is read or written) or "
                   "warm (what earlier commands left in the toolkit cache, read-only); every repeat starts alike")
    add_run_flags(p)  # every method, peers included, runs with these
    p.add_argument("--sample", action="store_true", help="sample instead of greedy (exactness then not checked); "
                   "--temperature defaults to 1.0 then")
    add_sampling_flags(p, _sampling_defaults())
    p.add_argument("--chat", default="auto", choices=CHAT_MODES,
                   help="chat template: auto = for gsm8k only")
    p.add_argument("--stop-at-eos", action="store_true", help="stop at EOS (default: exactly max-new-tokens each)")
    p.add_argument("--sweep", action="store_true", help="add the early-exit grid --exits x --ks and recommend the "
                   "best setting per task")
    p.add_argument("--exits", type=_ints, default=[4, 8, 12, 16, 20, 24], help="exit layers for --sweep")
    p.add_argument("--ks", type=_ints, default=[2, 4, 6], help="draft lengths for --sweep")
    p.add_argument("--vocabs", type=_ints, default=None, help="draft-vocabulary sizes for --sweep (top N of the counts "
                   "shipped for the model; 0 = the full head), e.g. 0,4096,8192 (default: the drafters' default, auto)")
    p.add_argument("--quality-data", default="humaneval", help="held-out text each model (the verifier) is scored on: "
                   "the front items of a prompt source (humaneval, gsm8k, a .jsonl file, a text folder), none timed; "
                   "'none': not measured (default humaneval)")
    p.add_argument("--quality-blocks", type=int, default=16, help="blocks of 128 held-out tokens (default 16)")
    p.add_argument("--base", default=None, help="the model (its NAME) quality deltas are taken against "
                   "(default: the first --model)")
    p.add_argument("--out", type=Path, required=True, help="output folder (created; one holding an earlier run's "
                   "results is refused unless --force)")
    p.add_argument("--force", action="store_true", help="write over the results of an earlier run in --out")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def _sampling_defaults(sample: bool = False):
    """The bench's sampling defaults: seed 0, and temperature 1.0 with --sample (greedy without)."""
    from infer.model.sampling import SamplingConfig  # torch-heavy: imported when the parser is built

    return SamplingConfig(temperature=1.0 if sample else 0.0, seed=0)


def config_from_args(args: argparse.Namespace):
    if args.temperature is not None and not args.sample:
        raise UserError("--temperature needs --sample")
    from infer.measure.methods import BenchConfig, parse_batch_sizes, parse_methods, sweep_methods  # torch: lazy
    from infer.measure.quality import QualityConfig  # lazy, as above
    from infer.measure.report import RESULT_FILES  # torch-heavy: not at import (--help stays light)

    check_output_dir(args.out, "--out", writes=RESULT_FILES, force=args.force)
    run = run_settings(args).resolve()  # once; a missing GPU is refused before anything loads
    sampling = sampling_config(args, _sampling_defaults(args.sample), sample_with="--sample")
    sizes = None if args.batch_size is None else parse_batch_sizes(args.batch_size)
    peers = "" if args.peers == "none" else "hf_generate" if args.peers is None and sizes else args.peers
    methods = parse_methods(args.drafters, peers)
    if args.sweep:
        if any(n < 0 for n in args.vocabs or []):
            raise UserError(f"--vocabs {args.vocabs}: sizes must be >= 0 (0 = the full head)")
        known = {m.label for m in methods}
        grid = [m for m in sweep_methods(args.exits, args.ks, args.vocabs) if m.label not in known]
        methods += grid
        if args.peers is None and not sizes:  # the HF early-exit peer at the sweep's exits too
            methods += [m for m in parse_methods("", ",".join(f"hf_early_exit:E={e}" for e in args.exits))
                        if m.is_peer and m.label not in known]
    return BenchConfig(models=args.models or ["default"], methods=methods,
                       data=[d.strip() for d in args.data.split(",") if d.strip()], n=args.n, skip=args.skip,
                       max_new_tokens=args.max_new_tokens, repeats=args.repeats, run=run, sampling=sampling,
                       chat=args.chat, stop_at_eos=args.stop_at_eos, start=args.start,
                       quality=QualityConfig(args.quality_data, args.quality_blocks, base=args.base),
                       batch_sizes=sizes)


def run(args: argparse.Namespace) -> int:
    from infer.measure.bench import run_bench  # torch-heavy: imported when the command runs
    from infer.measure.report import RESULT_FILES, RecordLog, bugs, write_outputs  # lazy, as above
    from infer.measure.screen import screen  # lazy, as above

    cfg = config_from_args(args)
    command = "layerskip " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    with holding_output_dir(args.out, "--out"):  # a second bench into this folder meanwhile is refused
        check_output_dir(args.out, "--out", writes=RESULT_FILES, force=args.force)  # again, now no one else writes
        log = RecordLog(cfg, args.out, command)  # every finished record, as it finishes: a killed bench keeps them
        resolved: dict[str, dict[str, str]] = {}  # each model's drafters as they run (full specs for results.md)
        try:
            records = run_bench(cfg, progress=not args.quiet, log=log, on_quality=log.add_quality,
                                on_methods=resolved.__setitem__)
        finally:
            log.close()
        rows = write_outputs(cfg, records, args.out, command, log.quality, resolved)
    print(screen(rows, args.out))  # short labels, a legend and the recommendation; every column in results.md
    print(f"wrote {args.out}/results.json, results.csv, results.md and plots", file=sys.stderr)
    wrong = bugs(rows)
    if wrong:
        print("layerskip: error: greedy output differs from autoregressive beyond a near-tie (a bug) for "
              + ", ".join(f"{r.model}/{r.task}/{r.method}{f' at B={r.batch_size}' if r.batch_size else ''} "
                          f"({r.mismatches or r.exact_mismatches} prompts)"
                          for r in wrong), file=sys.stderr)
        return 1
    return 0
