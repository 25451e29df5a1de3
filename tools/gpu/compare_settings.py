"""The GPU comparison's sizes: the first lease's short form, the full comparison, and their tiny CPU rehearsals."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

CODE_TASK = "code_heldout"
"""The bench task of prompts cut from the recipe's held-out packages."""
TASKS = (CODE_TASK, "humaneval", "gsm8k")
"""Every bench task of the comparison, in order."""


@dataclass
class CompareSettings:
    """How large every step of the comparison is (``gpu_settings`` / ``dry_settings``)."""

    device: str
    """Where everything runs: ``cuda`` (``auto``) or ``cpu`` for the dry run."""
    dtype: str
    """Bench and quality dtype: ``bf16`` on the GPU, ``fp32`` in the dry run."""
    train_overrides: list[str]
    """Recipe overrides for the training run only (the dry run shrinks it to a couple of steps)."""
    data_overrides: list[str]
    """Recipe overrides for training, held-out prompts and evaluation alike (the same held-out split)."""
    eval_examples: int
    """Held-out blocks for the per-exit loss/agreement."""
    eval_batch: int
    """Batch size of the per-exit evaluation."""
    prompts: int
    """Bench prompts per task (held out)."""
    max_new_tokens: int
    """Bench tokens per generation."""
    repeats: int
    """Bench repeats (median tokens/s)."""
    trials: int
    """Self-SD search trials per model."""
    search_timeout: float
    """Stop starting search trials after this many seconds."""
    search_prompts: int
    """Calibration prompts of the search."""
    search_tokens: int
    """Tokens per calibration prompt of the search."""
    humaneval_items: int | None
    """HumanEval problems for the prompt loss (None: all 164)."""
    gsm8k_items: int | None
    """GSM8K sample questions for the answer accuracy (None: all)."""
    gsm8k_tokens: int
    """Greedy tokens per GSM8K answer."""
    gsm8k_batch: int
    """GSM8K questions generated together (left-padded)."""
    drafters: list[str] = field(default_factory=list)
    """Bench drafter specs (``{plan}`` is the per-model Self-SD plan)."""
    peers: list[str] = field(default_factory=list)
    """Bench peer specs."""
    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    """Bench tasks, in order."""
    quality: bool = True
    """Measure HumanEval loss and GSM8K accuracy (needs the carried prompt sets)."""
    search: bool = True
    """Search a Self-SD plan per model (needs optuna)."""


EARLY_EXITS = ["early_exit:E=12:k=3", "early_exit:E=16:k=3", "early_exit:E=24:k=2", "early_exit:E=16:k=3:adaptive=true"]
"""The first GPU run's best E/k after training (12/3, 16/3, 24/2), and the adaptive gate at 16/3."""
COMPARED_AT = {"dynamic_exit": "verify_slope=0.02", "self_sd": "plan={plan}"}
"""What a drafter is compared at beyond its defaults: dynamic exit with the verification cost slope of a GPU in bf16,
where extra verified rows are nearly free (measured: docs/RESULTS.md), instead of the CPU's default slope; Self-SD
with the plan searched for each model on the device ({plan})."""
SEARCHED = ("self_sd", "swift")
"""The drafters that need a searched plan or optuna (skipped, with a note, where neither is there)."""


def compared(early_exits: list[str]) -> list[str]:
    """Every registered drafter as the comparison benches it: plain decoding, early exit at ``early_exits``, every
    other at its defaults with ``COMPARED_AT``'s options, so a drafter the registry adds is compared at once."""
    from infer.drafters import DRAFTERS  # local: torch, after gpu_compare's flags are checked

    first = ("autoregressive", "early_exit")
    rest = [f"{name}:{COMPARED_AT[name]}" if name in COMPARED_AT else name for name in DRAFTERS if name not in first]
    return [first[0], *early_exits, *rest]


def searched(spec: str) -> bool:
    """Whether drafter ``spec`` needs a searched plan or optuna (``SEARCHED``)."""
    return spec.split(":")[0] in SEARCHED


def gpu_settings() -> CompareSettings:
    """The real run: sized for about 8 minutes of one H200 (train ~2-3 min, the rest evaluation and bench)."""
    return CompareSettings(device="auto", dtype="bf16", train_overrides=[], data_overrides=[], eval_examples=64,
                           eval_batch=16, prompts=8, max_new_tokens=48, repeats=2, trials=40, search_timeout=40.0,
                           search_prompts=4, search_tokens=32, humaneval_items=None, gsm8k_items=None, gsm8k_tokens=256,
                           gsm8k_batch=50,
                           drafters=compared(EARLY_EXITS),
                           peers=["hf_generate", "hf_early_exit:E=12:k=3", "hf_static"])  # the compiled peer last


def first_settings() -> CompareSettings:
    """The first lease's form, one device command of <= 5 minutes: a short training, the per-exit evaluation, one task
    (held-out code), four prompts, the early exits against autoregressive and uncompiled ``generate`` (no compiled
    peer, no search, no HumanEval/GSM8K quality)."""
    return CompareSettings(device="auto", dtype="bf16", train_overrides=["optim.max_steps=60"], data_overrides=[],
                           eval_examples=16, eval_batch=16, prompts=4, max_new_tokens=48, repeats=1, trials=0,
                           search_timeout=0.0, search_prompts=0, search_tokens=0, humaneval_items=None,
                           gsm8k_items=None, gsm8k_tokens=0, gsm8k_batch=1,
                           drafters=["autoregressive", *EARLY_EXITS[:3]], peers=["hf_generate"], tasks=[CODE_TASK],
                           quality=False, search=False)


def tiny_settings(form: CompareSettings) -> CompareSettings:
    """``form`` shrunk to a CPU check of the wiring: ``dry_settings`` with the form's tasks, steps and kinds of peer."""
    dry = dry_settings()
    kinds = {x.split(":")[0] for x in form.peers}
    return replace(dry, tasks=form.tasks, quality=form.quality, search=form.search,
                   drafters=dry.drafters if form.search else [d for d in dry.drafters if not searched(d)],
                   peers=[x for x in dry.peers if x.split(":")[0] in kinds])


def form_settings(form: str, cuda: bool) -> CompareSettings:
    """The settings of ``--form`` (first | full) on a GPU, or their tiny CPU version."""
    settings = first_settings() if form == "first" else gpu_settings()
    return settings if cuda else tiny_settings(settings)


def dry_settings() -> CompareSettings:
    """The same pipeline on CPU in fp32, as small as it goes: checks wiring, measures nothing."""
    return CompareSettings(device="cpu", dtype="fp32",
                           train_overrides=["optim.max_steps=2", "optim.micro_batch_size=1", "optim.warmup_steps=0",
                                     "optim.mixed_precision='no'", "logging.log_every=1", "threads=1"],
                           data_overrides=["data.block_size=64", "data.max_val_examples=2",
                                    "data.sources.0.max_documents=150"],
                           eval_examples=2, eval_batch=2, prompts=1, max_new_tokens=6, repeats=1, trials=2,
                           search_timeout=20.0, search_prompts=1, search_tokens=4, humaneval_items=2, gsm8k_items=2,
                           gsm8k_tokens=8, gsm8k_batch=2,
                           drafters=compared(["early_exit:E={e1}:k=2", "early_exit:E={e2}:k=2:adaptive=true"]),
                           peers=["hf_generate", "hf_early_exit:E={e1}:k=2", "hf_static"])
