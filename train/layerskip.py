"""LayerSkip training: layer dropout + early-exit loss, continual pretraining or finetuning, full or LoRA.

Launch (any accelerate config from configs/, or plain python for one process):

    accelerate launch train/layerskip.py --config recipes/cpu-demo-stdlib.yaml [key.sub=value ...]
    python train/layerskip.py --config recipes/cpu-demo-stdlib.yaml optim.max_steps=10
    python train/layerskip.py --config recipes/X.yaml --resume        # continue from the newest checkpoint
    python train/layerskip.py --config recipes/X.yaml --overwrite     # delete the run in output_dir, start again
    python train/layerskip.py --help-config                           # every config key with its doc

``run_training`` below is the whole procedure, in steps (set up, resume, train, finish); the pieces it calls
live in train/: recipe and config, data and dedup, model and losses, schedules, optim, exit_eval, checkpoint,
tracking.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml
from tqdm.auto import tqdm

from layerskip_core.cli import Parser, run_main
from layerskip_core.errors import UserError
from layerskip_core.packages import cache_root
from train.checkpoint import (
    check_rng_states,
    clear_run,
    export_final,
    hold_run_folder,
    list_checkpoints,
    prepare_run_folder,
    read_state,
    save_checkpoint,
)
from train.config import TrainConfig
from train.console import (
    RELAUNCHED,
    check_launch,
    cpu_relaunch,
    eval_summary,
    interrupt_on_sigterm,
    launcher_command,
    resume_hint,
    sigterm_held,
)
from train.optim import RunningStats, lr_factor, make_optimizer, param_digest
from train.recipe import describe, dump_config, load_config, to_dict
from train.tracking import Tracker, truncate_metrics

if TYPE_CHECKING:  # heavy imports, made where a run is set up
    import torch
    from accelerate import Accelerator
    from transformers import PreTrainedTokenizerBase

    from train.adapter import AdapterLM  # type only: torch-heavy (see below)
    from train.data import BatchOrder, Dataset  # type only: torch-heavy (see below)
    from train.model import LayerSkipLM  # type only: torch-heavy (see below)

# torch, accelerate and the modules that import them (train.data, train.model, train.exit_eval) are
# imported inside the functions that use them, so --help, --help-config and a bad recipe answer at once.

PROG = "layerskip-train"


def log(msg: str) -> None:
    print(f"{PROG}: {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# Setup helpers
# --------------------------------------------------------------------------------------------


def make_accelerator(cfg: TrainConfig):
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and not torch.cuda.is_available():
        # Without this, CPU processes started by `accelerate launch` each train alone (world size 1).
        os.environ.setdefault("ACCELERATE_USE_CPU", "true")
    precision = cfg.optim.mixed_precision
    if precision == "auto":
        precision = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    # Layer dropout leaves whole layers unused on some steps: DDP must be told to look for them.
    ddp = DistributedDataParallelKwargs(find_unused_parameters=cfg.layer_dropout.p_max > 0)
    # ... and on a step where dropout skipped nothing, DDP warns about that flag on every rank: expected here.
    warnings.filterwarnings("ignore", message=".*find_unused_parameters=True was specified", category=UserWarning)
    accelerator = Accelerator(mixed_precision=precision, gradient_accumulation_steps=cfg.optim.grad_accum_steps,
                              kwargs_handlers=[ddp])
    if accelerator.num_processes != launched:
        raise UserError(f"{launched} processes were launched but accelerate sees {accelerator.num_processes}; "
                        "they would train unsynchronised (see configs/accelerate/cpu-ddp.yaml)")
    ds = accelerator.state.deepspeed_plugin
    check_zero_stage(cfg, None if ds is None else ds.zero_stage)
    if ds is not None:  # we pass no DataLoader to prepare(), so DeepSpeed must be told the batch geometry
        ds.deepspeed_config["train_micro_batch_size_per_gpu"] = cfg.optim.micro_batch_size
        ds.deepspeed_config["gradient_accumulation_steps"] = cfg.optim.grad_accum_steps
        ds.deepspeed_config["gradient_clipping"] = cfg.optim.max_grad_norm
    return accelerator


def check_zero_stage(cfg: TrainConfig, zero_stage: int | None) -> None:
    """Refuse what DeepSpeed ZeRO-3 does not train here: LoRA (merging needs whole weights) and layer dropout
    (ZeRO-3 gathers a layer's partitioned parameters in hooks around its forward and prefetches in the module
    order it recorded; a layer every row skips never runs, so that order changes from step to step and the
    layer gets no gradient to reduce; never run on GPUs in this project, so refused rather than trusted)."""
    if zero_stage != 3:
        return
    if cfg.lora.enabled:
        raise UserError("LoRA with DeepSpeed ZeRO-3 is not supported (merging needs whole weights); use ZeRO-2")
    if cfg.keep_final.kl_weight > 0:
        raise UserError("keep_final.kl_weight is not supported with DeepSpeed ZeRO-3 (its frozen copy of the start "
                        "and the fused head loss need whole weights); use ZeRO-2 or set keep_final.kl_weight=0")
    if cfg.layer_dropout.p_max > 0:
        raise UserError(f"layer dropout (layer_dropout.p_max={cfg.layer_dropout.p_max}) is not supported with "
                        "DeepSpeed ZeRO-3 (it partitions parameters and gathers them only for layers that run); "
                        "use configs/accelerate/deepspeed-zero2.yaml or fsdp2.yaml, or set layer_dropout.p_max=0")


def check_token_cache(cfg: TrainConfig) -> None:
    """The tokenisation cache folder must exist or be creatable (checked before any model loads)."""
    folder = Path(cfg.data.cache_dir).expanduser() if cfg.data.cache_dir else cache_root() / "tokens"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create the token cache folder {folder} ({e.strerror or e}); set data.cache_dir "
                        "(or LAYERSKIP_CACHE) to a writable folder") from None


def evaluate(run: Session) -> dict | None:
    """Per-exit validation metrics, each process taking a shard of the validation examples."""
    from train.exit_eval import exit_metrics  # lazy: torch; --help-config and a bad recipe answer at once

    accelerator, cfg, val = run.accelerator, run.cfg, run.dataset.val
    n = min(len(val), cfg.data.max_val_examples)
    if n == 0:
        return None
    model = accelerator.unwrap_model(run.wrapped)
    shard = list(range(accelerator.process_index, n, accelerator.num_processes))
    if cfg.adapter.enabled:
        from train.adapter import adapter_metrics  # lazy: torch; --help-config and a bad recipe answer at once

        return adapter_metrics(accelerator, model, val, shard, cfg.optim.micro_batch_size,
                               run.tokenizer.pad_token_id)
    exits = sorted(set(model.exits) | {model.num_layers})
    bar = tqdm(total=len(shard), desc="eval", leave=False, dynamic_ncols=True,
               disable=not (accelerator.is_main_process and cfg.logging.progress))
    with accelerator.autocast():
        m = exit_metrics(model, val, exits, cfg.optim.micro_batch_size, run.tokenizer.pad_token_id,
                         accelerator.device, indices=shard,
                         reduce=accelerator.reduce if accelerator.num_processes > 1 else None, on_batch=bar.update)
    bar.close()
    record = {"split": "val", "exit_loss": {str(e): v for e, v in m["loss"].items()},
              "exit_agreement": {str(e): v for e, v in m["agreement"].items()},
              "exit_accuracy": {str(e): v for e, v in m["accuracy"].items()}, "tokens": m["tokens"][model.num_layers]}
    if accelerator.is_main_process:
        tqdm.write(f"{PROG}: {eval_summary(record)}", file=sys.stderr)
    return record


# --------------------------------------------------------------------------------------------
# The training loop
# --------------------------------------------------------------------------------------------


@dataclass
class Session:
    """What one training run holds from setup to export."""

    cfg: TrainConfig
    """The resolved recipe."""
    accelerator: Accelerator
    """accelerate's handle on the processes, device and mixed precision."""
    wrapped: torch.nn.Module
    """The model as accelerate prepared it (DDP/DeepSpeed wrapper): forward and backward go through it."""
    model: LayerSkipLM | AdapterLM
    """The module inside ``wrapped``: layer counts, dropout rates, parameters."""
    optimizer: torch.optim.Optimizer
    """The optimiser as accelerate prepared it."""
    scheduler: torch.optim.lr_scheduler.LambdaLR
    """The learning-rate schedule (warm-up and decay, ``lr_factor``)."""
    dataset: Dataset
    """The tokenised, packed training and validation examples."""
    tokenizer: PreTrainedTokenizerBase
    """The model's tokenizer (saved beside every checkpoint)."""
    model_path: Path
    """The model folder the run started from."""
    order: BatchOrder
    """Which examples each (step, micro-batch, rank) takes."""
    tracker: Tracker | None = None
    step: int = 0
    tokens_seen: int = 0

    @property
    def out_dir(self) -> Path:
        return Path(self.cfg.checkpoint.output_dir)

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process


def run_training(cfg: TrainConfig, on_step: Callable[[int], None] | None = None, overwrite: bool = False) -> dict:
    """Train according to ``cfg``; return a summary. ``on_step(step)`` runs after each optimiser step.

    ``overwrite`` deletes a previous run's files from ``checkpoint.output_dir`` first; without it a
    folder holding another run is refused unless this run resumes it. A training running into the same
    folder is refused (``hold_run_folder``).
    """
    with hold_run_folder(cfg):  # one training per output folder, for its whole life
        return _train(cfg, on_step, overwrite)


def _train(cfg: TrainConfig, on_step: Callable[[int], None] | None, overwrite: bool) -> dict:
    import torch  # torch-heavy modules load here (see the note at the imports)

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    resume_from = prepare_run_folder(cfg, overwrite)  # checked before the model loads: a bad folder fails fast
    check_token_cache(cfg)
    accelerator = make_accelerator(cfg)
    run = set_up(cfg, accelerator)  # model and data load before anything is deleted: a bad path deletes nothing
    accelerator.wait_for_everyone()  # every process has checked the folder and loaded before it changes
    if accelerator.is_main_process and overwrite:
        clear_run(Path(cfg.checkpoint.output_dir))
        log(f"--overwrite: deleted the previous run in {cfg.checkpoint.output_dir}")
    accelerator.wait_for_everyone()
    if resume_from is not None:
        resume(run, resume_from)
    start_tracking(run)
    train_steps(run, on_step)
    return finish(run)


def set_up(cfg: TrainConfig, accelerator) -> Session:
    """Model (+ LoRA) in the LayerSkip forward, optimiser and schedule prepared by accelerate, data tokenised once
    (main process first, then from the cache)."""
    import torch

    from train.data import BatchOrder, build_dataset  # lazy: torch; --help-config and a bad recipe answer at once
    from train.model import LayerSkipLM, add_lora, load_model  # lazy: torch; --help-config answers at once

    with accelerator.main_process_first():
        hf_model, tokenizer, model_path = load_model(cfg.model.name_or_path, cfg.model.dtype,
                                                     cfg.model.attn_implementation)
        dataset = build_dataset(cfg.data, tokenizer, model_path,
                                log=log if accelerator.is_main_process else lambda _: None)
    if cfg.lora.enabled:
        hf_model = add_lora(hf_model, cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.target_modules)
    if cfg.adapter.enabled:  # the frozen model trains an exit adapter (train/adapter.py)
        from train.adapter import AdapterLM, draft_vocab_ids  # lazy: torch; --help-config answers at once

        vocab = draft_vocab_ids(hf_model, tokenizer, cfg.adapter)
        model = AdapterLM(hf_model.to(accelerator.device), cfg.adapter, vocab)
    else:
        model = LayerSkipLM(hf_model, cfg.layer_dropout, cfg.early_exit, cfg.optim.max_steps, cfg.seed,
                            cfg.model.gradient_checkpointing, cfg.keep_final)  # reachable inside the DDP wrapper
    optimizer = make_optimizer(model, cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg))
    wrapped, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(scheduler)
    order = BatchOrder(len(dataset.train), cfg.optim.micro_batch_size, cfg.optim.grad_accum_steps,
                       accelerator.num_processes, cfg.seed)
    return Session(cfg, accelerator, wrapped, model, optimizer, scheduler, dataset, tokenizer, model_path, order)


def resume(run: Session, folder: Path) -> None:
    """Model, optimiser, schedule and every process's RNG from ``folder``; metrics after its step are dropped.

    The state file is checked first; a damaged weight, optimizer or RNG file is one line (the process then ends,
    nothing on disk changed yet), not accelerate's traceback."""
    state = read_state(folder)
    check_rng_states(folder)  # accelerate skips an unreadable one with a log line: the run would not be the same
    try:
        run.accelerator.load_state(str(folder))
    except Exception as e:  # torch.load, safetensors and accelerate raise many kinds for a damaged file
        raise UserError(f"cannot resume from {folder}: a checkpoint file is damaged or cut off ({type(e).__name__}: "
                        f"{' '.join(str(e).split())[:200]}); resume from an earlier checkpoint "
                        "(checkpoint.resume=<its folder>) or start again with --overwrite") from None
    run.step, run.tokens_seen = state["step"], state["tokens"]
    if run.main:
        truncate_metrics(run.out_dir / "metrics.jsonl", state.get("metrics_lines"), run.step)  # no repeated steps
        log(f"resumed from {folder} at step {run.step}")


def start_tracking(run: Session) -> None:
    """Open the metrics log, save the resolved config, announce the run, and evaluate at step 0 if asked."""
    cfg, world = run.cfg, run.accelerator.num_processes
    run.tracker = Tracker(run.out_dir, run.main, cfg.logging.wandb, cfg.logging.wandb_project, cfg.logging.run_name,
                          to_dict(cfg))
    if run.main:
        run.out_dir.mkdir(parents=True, exist_ok=True)
        dump_config(cfg, run.out_dir / "config.yaml")
        n_train = sum(p.numel() for p in run.wrapped.parameters() if p.requires_grad)
        tokens_per_step = cfg.optim.micro_batch_size * cfg.optim.grad_accum_steps * world * cfg.data.block_size
        log(f"{run.model_path.name}: {run.model.num_layers} layers, {n_train / 1e6:.1f}M trainable parameters; "
            f"{run.dataset.meta['train_tokens']:,} training tokens in {len(run.dataset.train)} examples, "
            f"{len(run.dataset.val)} validation examples; {cfg.optim.max_steps} steps of <= {tokens_per_step:,} "
            f"tokens on {world} process(es)")
    if cfg.logging.eval_at_start and run.step == 0:
        run.tracker.log({"step": 0, **(evaluate(run) or {})})


def train_steps(run: Session, on_step: Callable[[int], None] | None) -> None:
    """Optimiser steps up to ``optim.max_steps``: accumulate, step, then log, evaluate and save on schedule."""
    cfg = run.cfg
    run.wrapped.train()
    stats = RunningStats(run.model.num_layers)
    bar = tqdm(total=cfg.optim.max_steps, initial=run.step, disable=not (run.main and cfg.logging.progress),
               desc="train", dynamic_ncols=True)
    try:  # closed however the loop ends, so a Ctrl-C's --resume hint prints below the bar, not inside it
        while run.step < cfg.optim.max_steps:
            for micro in range(cfg.optim.grad_accum_steps):
                micro_step(run, stats, micro)
            if not run.accelerator.optimizer_step_was_skipped:
                run.scheduler.step()
            run.step += 1
            bar.update(1)
            log_now = run.step % cfg.logging.log_every == 0 or run.step == cfg.optim.max_steps
            if log_now or (cfg.checkpoint.save_every and run.step % cfg.checkpoint.save_every == 0):
                check_finite(run, stats)  # before anything is logged or saved from these steps
            if log_now:
                lr = cfg.optim.lr * lr_factor(run.step - 1, cfg)  # the lr the last step used
                rec = stats.record(run.step, lr, run.model.rates(run.step - 1), run.accelerator.num_processes)
                rec.update(tokens=run.tokens_seen, epoch=round(run.order.epoch(run.step), 4))
                run.tracker.log(rec)
                bar.set_postfix(loss=f"{rec['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}")
                stats = RunningStats(run.model.num_layers)
            if cfg.logging.eval_every and run.step % cfg.logging.eval_every == 0 and run.step < cfg.optim.max_steps:
                run.tracker.log({"step": run.step, **(evaluate(run) or {})})
            if cfg.checkpoint.save_every and run.step % cfg.checkpoint.save_every == 0:
                with sigterm_held():
                    save_checkpoint(run.accelerator, cfg, run.step, {"tokens": run.tokens_seen,
                                                                     "metrics_lines": run.tracker.lines})
            if on_step is not None:
                on_step(run.step)
    finally:
        bar.close()


def check_finite(run: Session, stats: RunningStats, evaluation: dict | None = None) -> None:
    """Stop the run in one line, saving nothing from these steps, when the loss since the last check, a weight or an
    ``evaluation``'s loss is not finite (NaN or infinity: a diverged step, or settings that overflow); every process
    decides alike."""
    import torch

    loss = stats.loss.to(run.accelerator.device)
    losses = [v for key in ("exit_loss", "adapter_loss") for v in (evaluation or {}).get(key, {}).values()]
    if not all(math.isfinite(v) for v in losses):
        loss = loss + torch.tensor(float("nan"), device=loss.device)  # the held-out loss says so
    bad = (~torch.isfinite(loss)).float().reshape(1)
    for p in run.model.parameters():
        if p.requires_grad:
            bad += (~torch.isfinite(p.detach())).any().float()
    if run.accelerator.num_processes > 1:
        bad = run.accelerator.reduce(bad, reduction="sum")
    if float(bad) > 0:
        what = "a weight is not finite" if torch.isfinite(loss) else f"the loss is {float(loss):g}"
        raise UserError(f"training diverged by step {run.step}: {what} (NaN or infinity); stopped before saving "
                        "anything from here (no final model). Lower optim.lr or the loss weights "
                        "(keep_final.kl_weight, early_exit.e_scale), or resume from an earlier checkpoint "
                        "(checkpoint.resume=<its folder>)")


def micro_step(run: Session, stats: RunningStats, micro: int) -> None:
    """Forward and backward of one micro-batch; the optimiser steps on the last of the accumulation."""
    accelerator, cfg = run.accelerator, run.cfg
    batch = run.dataset.train.batch(run.order.indices(run.step, micro, accelerator.process_index),
                                    run.tokenizer.pad_token_id)
    input_ids = batch["input_ids"].to(accelerator.device)  # (B, T)
    labels = batch["labels"].to(accelerator.device)  # (B, T)
    with accelerator.accumulate(run.wrapped):  # no gradient sync until the last micro-batch
        with accelerator.autocast():
            out = run.wrapped(input_ids, labels, step=run.step, micro=micro)
        accelerator.backward(out["loss"])  # divided by grad_accum_steps inside
        if accelerator.sync_gradients and cfg.optim.max_grad_norm > 0:
            stats.grad_norm = accelerator.clip_grad_norm_(run.wrapped.parameters(), cfg.optim.max_grad_norm)
        run.optimizer.step()  # a no-op until sync_gradients
        run.optimizer.zero_grad(set_to_none=True)
    stats.add(out, rows=input_ids.shape[0], tokens=input_ids.numel())
    run.tokens_seen += int((batch["labels"][:, 1:] != -100).sum()) * accelerator.num_processes  # CPU: no sync


def finish(run: Session) -> dict:
    """Final evaluation, the replicas' parameter digests (several processes), the exported ``final/`` folder."""
    final_eval = evaluate(run)
    check_finite(run, RunningStats(run.model.num_layers), final_eval)  # a step's overflow shows in the weights now
    if final_eval:
        run.tracker.log({"step": run.step, **final_eval})
    if run.accelerator.num_processes > 1:  # replicas must be identical after DDP; record one digest per rank
        from accelerate.utils import gather_object

        digests = gather_object([param_digest(run.model)])
        run.tracker.log({"step": run.step, "param_digest": digests})
        if run.main and len(set(digests)) > 1:
            log(f"warning: parameters differ across ranks: {digests}")
    final_dir = save_final(run) if run.cfg.checkpoint.save_final else None
    run.tracker.close()
    return {"step": run.step, "tokens": run.tokens_seen, "final_dir": final_dir, "eval": final_eval,
            "model": run.wrapped, "accelerator": run.accelerator}


def save_final(run: Session) -> Path:
    """The trained exit adapter's file, or the plain Hugging Face ``final/`` folder (LoRA merged)."""
    with sigterm_held():
        return _save_final(run)


def _save_final(run: Session) -> Path:
    if run.cfg.adapter.enabled:
        from train.adapter import save_adapter  # lazy: torch; --help-config and a bad recipe answer at once

        path = run.out_dir / "adapter.safetensors"
        save_adapter(run.accelerator, run.wrapped, run.cfg, path, run.tokens_seen, run.step)
        if run.main:
            log(f"exit adapter: {path}  (layerskip generate --drafter early_exit --adapter {path} ...)")
        return path
    final_dir = export_final(run.accelerator, run.wrapped, run.tokenizer, run.cfg, run.out_dir / "final")
    if run.main:
        log(f"final model: {final_dir}  (layerskip generate --model {final_dir} --drafter early_exit ...)")
    return final_dir


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def build_parser(prog: str = "train/layerskip.py") -> argparse.ArgumentParser:
    parser = Parser(prog=prog, description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="recipe YAML (recipes/*.yaml)")
    parser.add_argument("--resume", action="store_true", help="same as checkpoint.resume=auto")
    parser.add_argument("--overwrite", action="store_true",
                        help="delete a previous run in checkpoint.output_dir and start again from step 0")
    parser.add_argument("--help-config", action="store_true", help="list every config key with its documentation")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="dotted config overrides")
    return parser


def main(argv: list[str] | None = None, prog: str = "train/layerskip.py") -> int:
    """Train from the command line ``argv``; ``prog`` is how --help names the command."""
    args = build_parser(prog).parse_intermixed_args(argv)  # overrides may come before or after the flags
    return run_main(PROG, lambda: _run(args, sys.argv[1:] if argv is None else list(argv)))


def _relaunch_if_alone(argv: list[str]) -> None:
    """`accelerate launch --cpu --num_processes N` starts this one process alone: become the launch of the N
    synchronised CPU processes that was asked for (the process is replaced; nothing returns)."""
    relaunch = cpu_relaunch(os.environ, launcher_command(), Path(__file__).resolve(), argv)
    if relaunch is None:
        return
    log(f"`accelerate launch --cpu --num_processes {relaunch[5]}` started one process; running the "
        f"{relaunch[5]} synchronised CPU processes it asked for: ACCELERATE_USE_CPU=true accelerate launch "
        + " ".join(relaunch[3:]))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(relaunch[0], relaunch, os.environ | {"ACCELERATE_USE_CPU": "true", RELAUNCHED: "1"})


def _run(args: argparse.Namespace, argv: list[str]) -> int:
    if args.help_config:
        print("\n".join(describe()))
        return 0
    if args.config is None and not args.overrides:
        raise UserError("give a recipe: --config recipes/<name>.yaml (see --help-config for every key)")
    overrides = list(args.overrides) + (["checkpoint.resume=auto"] if args.resume else [])
    cfg = load_config(args.config, overrides)  # strict: fails here, before any model is loaded
    if args.print_config:
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
        return 0
    check_launch(os.environ, launcher_command(), has_gpu=lambda: __import__("torch").cuda.is_available())
    _relaunch_if_alone(argv)
    interrupt_on_sigterm()
    try:
        result = run_training(cfg, overwrite=args.overwrite)
    except KeyboardInterrupt:  # one line: the hint says "interrupted" (run_main would say it again)
        log(resume_hint(argv, cfg.checkpoint.output_dir, bool(list_checkpoints(cfg.checkpoint.output_dir))))
        return 130
    # Tear the process group down before the interpreter does: left to exit, a gloo rank could abort
    # ("terminate called without an active exception") after a run that had finished and saved.
    result["accelerator"].end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
