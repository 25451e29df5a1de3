"""``layerskip search``: find a Self-SD sublayer skip plan offline with Bayesian optimisation (optuna)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from layerskip_cli.args import add_model_flags, model_settings
from layerskip_core.cli import check_distinct, check_output_file, finite_float
from layerskip_core.device import dtype_name
from layerskip_core.draft_vocab import resolve_draft_vocab_option
from layerskip_core.errors import UserError
from layerskip_core.prompts import load_prompts, task_name, use_chat_template


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("search", help="search a Self-SD skip plan (which attention/MLP sublayers the draft skips)",
                       description="Bayesian optimisation (optuna) over the 2L sublayer skip choices on calibration "
                       "prompts from the front of a data set; the best plan is written atomically to --out with the "
                       "model's identity, and the study (with its calibration) is kept beside it: --resume "
                       "continues an interrupted search, or one given more --trials, without calibrating again.")
    add_model_flags(p)
    p.add_argument("--data", required=True, help="calibration prompts: humaneval, gsm8k, a .jsonl file with 'prompt' "
                   "fields, or a folder of text files (items are taken from the front of the set)")
    p.add_argument("--out", type=Path, required=True, help="plan file to write, e.g. plans/smollm2-135m-humaneval.json")
    p.add_argument("--trials", type=int, default=100, help="trials the study should hold in total (default 100; "
                   "a resumed study runs only the missing ones)")
    p.add_argument("--objective", default=None,
                   help="'model' (default): expected speed-up from teacher-forced agreement and "
                   "draft cost, noise-free and fast; 'speed' (default with --paper): measured tokens/s of "
                   "self-speculative decoding")
    p.add_argument("--skip-ratio", type=finite_float, default=None,
                   help="skip exactly this fraction of the 2L sublayers (default: the search chooses how many)")
    p.add_argument("--seed", type=int, default=0, help="seed of the optuna sampler (default 0)")
    p.add_argument("--timeout", type=finite_float, default=None, help="stop starting trials after SEC seconds")
    p.add_argument("--sampler", default="tpe", help="'tpe' (multivariate TPE, default) or 'gp' (Gaussian process)")
    p.add_argument("--n", type=int, default=8, help="calibration prompts (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="tokens per calibration prompt (default 64 for model, 32 for speed)")
    p.add_argument("--num-draft", type=int, default=None,
                   help="most drafts per verification (the drafter's k; the largest k the model objective replays; "
                   "default 12 for model, 8 for speed, as Self-SD's search code drafts)")
    p.add_argument("--cost", default="measured", help="model objective: draft/verify costs 'measured' once before "
                   "the search (default) or counted in 'weights' read (deterministic)")
    p.add_argument("--speed-reference", default="interleaved",
                   help="speed objective: 'interleaved' (default; value = speed-up over autoregressive decoding of "
                   "each prompt timed just before it) or 'once' (value = tokens/s, as in Self-SD)")
    p.add_argument("--no-warm-start", action="store_true", help="do not enqueue uniform plans as first trials")
    p.add_argument("--draft-vocab", default="auto",
                   help="the one draft head both objectives and the cost model score with, recorded in the plan "
                   "(self_sd drafts the plan with it): auto (default; the 8192 most frequent ids of the counts shipped "
                   "for the model, else the full head), a size, a file from `layerskip draft-vocab`, or off")
    p.add_argument("--paper", action="store_true",
                   help="the reference's search: GP-UCB (kappa 2.576, alpha 1e-2) on a continuous point in [0,1]^2L "
                   "thresholded at 0.5, --iterations suggestions, the full head, the speed objective unless "
                   "--objective says otherwise; no study journal")
    p.add_argument("--iterations", type=int, default=1000,
                   help="with --paper: GP-UCB suggestions (default 1000, the reference's)")
    p.add_argument("--chat", default="auto", choices=["auto", "always", "never"],
                   help="chat template: auto = for gsm8k only (as `layerskip bench` does)")
    p.add_argument("--study", type=Path, default=None,
                   help="optuna journal file (default: beside --out, e.g. plans/x.study.log)")
    p.add_argument("--resume", action="store_true", help="continue the study kept beside --out (an interrupted search, "
                   "or more --trials), reusing its calibration; --out is rewritten whenever the best plan improves")
    p.add_argument("--force", action="store_true", help="overwrite an existing --out and start its study over")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _check_resume(args: argparse.Namespace, study: Path) -> None:
    """--resume continues a study that exists; --force starts over; without either, nothing earlier is touched."""
    if args.resume and args.force:
        raise UserError("--resume continues the study and --force starts it over; pass one of them")
    if args.resume and args.paper:
        raise UserError("--paper keeps no study to resume (an interrupted paper search starts over); drop --resume")
    if args.resume and not study.is_file():
        raise UserError(f"--resume: there is no study {study} to continue; run without --resume to start one")
    if not (args.resume or args.force) and args.out.exists():
        raise UserError(f"--out {args.out} exists; pass --resume to continue its search, or --force to overwrite it "
                        "and start over")
    if not (args.resume or args.force or args.paper) and study.is_file():
        raise UserError(f"the study {study} of an earlier search exists; pass --resume to continue it, or --force to "
                        "start over")


def run(args: argparse.Namespace) -> int:
    # torch, transformers and optuna load only once the arguments are known to be good
    from infer.selfsd.search import SearchConfig  # lazy: torch and optuna, once the flags are good
    from infer.selfsd.study import holding_search, study_path_for

    # Everything that can be checked without the model is checked first.
    cfg = SearchConfig(objective=args.objective, trials=args.trials, skip_ratio=args.skip_ratio, seed=args.seed,
                       timeout=args.timeout, sampler=args.sampler, n_prompts=args.n,
                       max_new_tokens=args.max_new_tokens, num_draft=args.num_draft, cost=args.cost,
                       warm_start=not args.no_warm_start, speed_reference=args.speed_reference,
                       draft_vocab=args.draft_vocab, paper=args.paper, iterations=args.iterations)
    if args.out.suffix != ".json":
        raise UserError(f"--out {args.out} should be a .json file")
    study = args.study or study_path_for(args.out)
    _check_resume(args, study)
    check_output_file(args.out, "--out", force=args.force or args.resume,
                      inputs=(("--data", args.data), ("--draft-vocab", args.draft_vocab)))
    check_distinct(("--out", args.out), ("--study", args.study))
    if args.study is not None:  # an existing study is continued (--resume) or started over (--force)
        check_output_file(args.study, "--study", force=True, inputs=(("--data", args.data),))
    with holding_search(args.out, None if cfg.paper else study):  # a second search into them meanwhile: refused
        return _search(args, cfg, study)


def _search(args: argparse.Namespace, cfg, study: Path) -> int:
    """The search, its outputs' locks held: the calibration prompts, the model, the trials, the summary."""
    from infer.loading import load_resolved  # lazy: transformers, when the command runs
    from infer.selfsd.search import search_plan  # lazy: torch and optuna, when it runs

    items = load_prompts(args.data, cfg.n_prompts)
    if len(items) < cfg.n_prompts:
        print(f"layerskip: note: {args.data} has only {len(items)} prompts", file=sys.stderr)
    resolved = model_settings(args).resolve()

    model = load_resolved(resolved)
    # the search's one draft head, resolved with the tokenizer (a finetuned checkpoint keeps its base's counts)
    cfg.draft_vocab = resolve_draft_vocab_option(cfg.draft_vocab, model.runner, model.tokenizer) or "off"
    task = task_name(args.data)
    chat = use_chat_template(task, args.chat, model.tokenizer)
    prompts = [model.encode(item.prompt, chat) for item in items]
    limit = model.runner.spec.max_position_embeddings
    too_long = [it.id for it, ids in zip(items, prompts, strict=True) if len(ids) + cfg.max_new_tokens
                + cfg.num_draft + 2 > limit]
    if too_long:
        raise UserError(f"calibration prompts {too_long} are too long for the model's context of {limit} tokens")
    extra = {"data": args.data, "chat": chat, "threads": resolved.threads, "device": str(model.runner.device),
             "dtype": dtype_name(model.runner.dtype),
             "prompt_ids": [it.id for it in items]}
    if args.resume and not args.quiet:
        reused = " (its calibration is reused)" if cfg.objective == "model" else ""
        print(f"layerskip: resuming the study in {study}{reused}", file=sys.stderr, flush=True)
    elif not args.quiet:  # the calibration runs before the trials' progress bar appears
        print(f"layerskip: calibrating on {len(prompts)} prompts (the full model's outputs and the cost of a draft), "
              "then the trials", file=sys.stderr, flush=True)
    result, plan_file = search_plan(model.runner, prompts, cfg, args.out, task, study, fresh=args.force,
                                    progress=not args.quiet, extra=extra, lock=False)
    print(best_line(result, cfg), file=sys.stderr)
    where = "" if cfg.paper else f" (study: {study})"
    print(f"search took {plan_file.search['wall_time_s']}s{where}", file=sys.stderr)
    print(args.out)
    return 0


def best_line(result, cfg) -> str:
    """The search's result in one line: the plan, its objective in words, acceptance beside what was drafted."""
    m = result.attrs
    line = (f"best of {result.completed} trials (#{result.best_trial}): {result.plan.describe()}; "
            f"{objective_words(cfg, result.value)}")
    if "acceptance_rate" in m:
        drafted = f" ({m['drafted']}/{m['tokens']} tokens drafted)" if "drafted" in m else ""
        line += f", acceptance {m['acceptance_rate']:.2f}{drafted}, tokens/verify {m['tokens_per_verify']:.2f}"
    if "k" in m:
        line += f" (best replayed k={m['k']}, gamma={m['gamma']})"
    return line


def objective_words(cfg, value: float) -> str:
    """The best value in words: what the objective measures, and where a speed-up below 1 means slower."""
    slower = "; below 1: slower than plain decoding" if value < 1 else ""
    if cfg.objective == "model":
        return (f"expected speed-up {value:.3f}x over plain decoding (model objective: teacher-forced agreement and "
                f"draft cost{slower})")
    if cfg.speed_reference == "interleaved":
        return f"measured speed-up {value:.3f}x over plain decoding (speed objective{slower})"
    return f"{value:.1f} tokens/s (speed objective, raw tokens/s as Self-SD)"
