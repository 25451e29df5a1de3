"""Resolving a drafter spec's files and names against a loaded model: the draft head and the skip plan.

Each drafter's ``resolve`` (``infer.drafters.base.Drafter.resolve``) uses these once per spec; the frozen
``DraftInputs`` it returns go to the drafter's constructor as they are.
"""

from __future__ import annotations

from pathlib import Path

import torch

from infer import kernels
from infer.assets.auto_vocab import auto_counts
from infer.model.plan import LayerPlan, PlanFile, check_depth
from infer.model.quant_weights import HEAD_SCHEME, QUANT_DTYPES, check_widths, quantized
from infer.model.runner import DraftHead, Runner
from layerskip_core.device import DTYPE_NAMES
from layerskip_core.draft_vocab import AUTO, DraftVocab, resolve_draft_vocab_option
from layerskip_core.errors import UserError


def draft_head(spec, runner: Runner, tokenizer=None, auto: str | None = None) -> DraftHead | None:
    """The draft head of ``spec``: the vocabulary it was given as an object, else its ``draft_vocab`` option (a
    size, file, 'auto' or 'off': ``layerskip_core.draft_vocab.resolve_draft_vocab_option``) for ``runner``'s model,
    in its ``draft_dtype``. ``auto``: what the option 'auto' stands for here (an exit adapter's trained size),
    default the top ``AUTO_SIZE`` of the shipped counts, or of counts built once from the model's own generations
    for a large vocabulary without shipped ones (``infer.assets.auto_vocab``)."""
    option = spec.config.draft_vocab
    if auto is not None and str(option).strip().lower() == AUTO:
        option = auto
    if spec.vocab is None and str(option).strip().lower() == AUTO:
        auto_counts(runner, tokenizer)  # a large vocabulary without shipped counts: built once, kept in the cache
    vocab = spec.vocab if spec.vocab is not None else resolve_draft_vocab_option(option, runner, tokenizer)
    return head_of(runner, vocab, draft_dtype(spec.config.draft_dtype, runner),
                   draft_quant(spec.config.draft_dtype, runner))


def draft_quant(option: str, runner: Runner | None = None) -> str | None:
    """The quantized draft dtype ``option`` names ('int8', 'int4'), or None for a float one; with ``runner``, one
    that cannot run there is refused in one line (off the CPU; int4 groups that do not divide a width)."""
    if option not in QUANT_DTYPES:
        return None
    if runner is not None:
        if runner.device.type != "cpu":
            raise UserError(f"draft dtype {option}: quantized drafts run on the CPU kernel only, the model is on "
                            f"{runner.device}; use --draft-dtype bf16, fp16 or model there")
        check_widths(runner.layers, option)
    return option


def draft_runner(option: str, runner: Runner, end: int | None = None) -> Runner:
    """What a draft runs its layers [0, ``end``) on: ``runner`` itself for a float draft dtype, else its quantized copy
    (``infer.model.quant_weights.quantized``: made once per runner, dtype and end)."""
    quant = draft_quant(option, runner)
    return runner if quant is None else quantized(runner, quant, end)


def draft_dtype(option: str, runner: Runner) -> torch.dtype:
    """The dtype of the weights only drafts read (``DraftVocabOption.draft_dtype``) on ``runner``: 'auto' is bf16
    where the model runs fp32 on the CPU's eager executor with a kernel that has native bf16 dot products, else the
    model's dtype (the static and graph executors, CUDA's path, keep it); int8 and int4 compute in the model's dtype
    (their weights: ``draft_quant``)."""
    if option == "model" or draft_quant(option, runner) is not None:
        return runner.dtype
    if option == AUTO:
        native = (runner.dtype == torch.float32 and runner.device.type == "cpu" and runner.executor == "eager"
                  and kernels.supports(runner.kernel, torch.bfloat16))
        return torch.bfloat16 if native else runner.dtype
    return getattr(torch, DTYPE_NAMES[option])  # an explicit name, checked by the option


def head_of(runner: Runner, vocab: DraftVocab | None, dtype: torch.dtype | None = None,
            quant: str | None = None) -> DraftHead | None:
    """The runner's draft head over ``vocab``'s ids (None: the full head) in ``dtype`` (default the model's), or
    quantized for the draft dtype ``quant`` (the full head too: a quantized draft reads a quantized copy of every
    row); refused for another vocabulary size."""
    if vocab is None and quant is not None:
        return runner.draft_head(range(runner.spec.vocab_size), runner.dtype, HEAD_SCHEME[quant])
    if vocab is None:
        return None
    if vocab.vocab_size != runner.spec.vocab_size:
        raise UserError(f"the draft vocabulary is for a {vocab.vocab_size}-token vocabulary; the model has "
                        f"{runner.spec.vocab_size}")
    return runner.draft_head(vocab.ids, dtype, None if quant is None else HEAD_SCHEME[quant])


def load_plan(path: str | Path, runner: Runner) -> PlanFile:
    """Load a plan file and refuse it unless it was made for ``runner``'s model (its depth too)."""
    plan_file = PlanFile.load(Path(path).expanduser())
    plan_file.check_model(runner.identity(), str(path))
    return plan_file


def given_plan(plan: LayerPlan, runner: Runner) -> LayerPlan:
    """A plan given as an object, refused unless it has the model's depth."""
    check_depth(plan, runner.num_layers)
    return plan


def plan_head(runner: Runner, plan_file: PlanFile, dtype: torch.dtype | None = None,
              quant: str | None = None) -> DraftHead | None:
    """The draft head a plan file records (the one its search scored plans with), in ``dtype`` or quantized for the
    draft dtype ``quant``: None for the full head."""
    ids = plan_file.draft_ids
    if ids is None and quant is not None:  # the full head, as a quantized draft reads it: a quantized copy
        ids = range(runner.spec.vocab_size)
    if ids is None:
        return None
    if max(ids) >= runner.spec.vocab_size:
        raise UserError(f"the plan's draft head has token ids beyond the model's {runner.spec.vocab_size}")
    return runner.draft_head(ids, dtype, None if quant is None else HEAD_SCHEME[quant])
