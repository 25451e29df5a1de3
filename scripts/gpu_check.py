"""One command for a GPU machine with a time limit: the headline numbers first, then the rest in falling order of value.

    python3 scripts/gpu_check.py                                  # a GPU machine: the full run (240 s budget)
    python3 scripts/gpu_check.py --device cpu                     # tiny stand-in shapes, a few tokens (CI)
    python3 scripts/gpu_check.py --device cpu --compile-backend eager   # the same with compiled steps (graph counts)

Runs from a bare checkout (importing ``lease`` puts the checkout on ``sys.path``). Results go to ``--out``, else
``$OUT`` (a results folder that comes back from a batch job or a remote machine), else ``runs/gpu/``:
``gpu_check.json``, rewritten after every piece (a run cut at any point keeps everything finished before it),
``GPU.md`` (the result block) and ``TRAINING.md`` (the training table). ``--budget-s`` is the run's wall budget and
each part has its own (``PART_BUDGETS_S``): a piece that would start past either is cut with a note, so the run
ends with results. A missing optional package (``lease.OPTIONAL``) is a note, not a failure.

Parts, in falling order of value (a part that raises is recorded under ``errors`` and the run goes on; each records
its start offset, seconds, budget and dynamo graph compiles under ``parts``):

a. shapes: random-init SmolLM2-135M, Llama-3.2-1B-like and Llama-2-7B-like models in bf16 (on a CPU, fp32 4-layer
   stand-ins named "stand-in for ..."), each in turn: our plain decoding (compiled and captured on CUDA) tokens/s,
   then ``transformers`` compiled static-cache ``generate`` (``hf_static``) on the same model, then ms per full
   forward, v(T) (verifying T tokens / one token) and c(E) (a draft through layers [0, E) + head / one full
   forward, E = L/4, L/2, 3L/4), then kernels per forward (the profiler over the compiled forward run uncaptured,
   never over a graph replay, beside the eager forward's count; at least one kernel per layer is checked); at the
   first shape every drafter's per-cycle cost (draft and verify ms per cycle, tokens per cycle); on CUDA the bf16
   one-row vs many-row spread. Static forwards built, graphs captured and compiles in the timed runs are counted
   (must be 0).
b. greedy: every drafter's fp32 greedy output vs ``autoregressive`` on the tiny seeded Llama, on the check's
   executor and on eager, each mismatch classified with the drafter's own verification argmax and the fp32
   runner's measured rounding (``infer.measure.exactness``): on CUDA only mismatches beyond a tie flip fail
   (cuBLAS is not batch-invariant, fp32 included), on a CPU every mismatch fails.
c. checks: one seeded sampled generation per drafter (must complete); host syncs per draft-verify cycle of every
   drafter (``infer.measure.syncs``) with the targets they are held to (reported, never failing the run).
d. train: ``train_bench.train_check`` (training step speed/memory and an end-to-end train -> save -> decode check).
e. rest: logits of our runner vs ``transformers`` on both tiny models (fp32, bf16), their one-row vs many-row
   spread, greedy identity on the tiny Qwen2, and the uncompiled ``generate`` peers at the shapes (dynamic cache,
   transformers' early-exit assistant).

Decoding runs under ``torch.no_grad()`` throughout (the engine's grad mode), and every runner of one model
geometry and dtype shares its compiled steps (``infer.compiled.StepCache``): the whole run compiles each step
kind once per geometry, ``compiles`` in the JSON counts them.

Only torch, transformers, tokenizers, safetensors, numpy, pyyaml and tqdm are needed: no model cache, no network;
accelerate, peft, optuna, datasets, wandb, gguf and deepspeed are optional.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import re
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import lease  # first: puts the checkout on sys.path (a bare checkout on a GPU image)
import torch
import transformers
from transformers import GenerationConfig, LlamaConfig

from infer.compiled import BACKENDS, StepCache
from infer.drafters import DRAFTERS, build_drafter
from infer.engine import DecodeConfig, Engine
from infer.measure.exactness import (
    DivergenceJudge,
    decode_verified,
    measure_rounding,
    measure_spread,
    spread_prompts,
)
from infer.measure.seeded_models import random_model, tiny_model
from infer.measure.syncs import measure_decode
from infer.measure.timing import timed_generate
from infer.plan import LayerPlan, PlanFile
from infer.runner import Runner
from infer.sampling import SamplingConfig, TreeShape
from layerskip_cli.args import add_run_flags
from layerskip_core.cli import Parser, check_output_dir, finite_float, run_main
from layerskip_core.device import resolve_device
from layerskip_core.settings import RunSettings, resolve_compile

BEGIN, END = "<!-- gpu_check:begin -->", "<!-- gpu_check:end -->"
RESULT_FILE = "gpu_check.json"
"""The result, rewritten after every piece."""
TINY_MODELS = (("llama", 0), ("qwen2", 1))
"""The tiny seeded models: (kind, seed); the first is the greedy part's, the second the rest's."""
SWIFT_TREES = {"context_window": 4, "tree": True, "adaptive": False, "remember": "off"}
"""SWIFT settings that verify token trees from the first cycles (no fallback gate, nothing remembered)."""
SAMPLING = SamplingConfig(temperature=0.8, top_p=0.95, seed=0)
"""The seeded sampled generation each drafter must complete."""
FULL_BUDGET_S = 240.0
"""Default wall budget of a full (GPU) run: no piece starts after it. A piece started just before it can overrun it by
its own length (a 7B static-cache compile: about 90 s, estimated), so a job's time limit should sit about 2 minutes
above it (docs/GPU.md)."""
PART_BUDGETS_S = {"shapes": 150.0, "greedy": 25.0, "checks": 20.0, "train": 20.0, "rest": 25.0}
"""Each part's own wall budget on a GPU (seconds from the part's start; no new piece of it starts after it). They
rest on estimates, not measurements on a GPU (docs/GPU.md, "Budgets"): per shape a random init, our warm-up with
its two compiles and the captures, the static-cache compile of transformers (30-90 s), about 10 s of timing."""
COMPILE_RESERVE_S = 60.0
"""Seconds of a part's budget an ``hf_static`` peer (a torch.compile by transformers) needs left to start."""


@dataclass(frozen=True)
class Shape:
    """A Llama-family model shape timed with random-init weights."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    rope_theta: float = 10000.0

    def config(self) -> LlamaConfig:
        return LlamaConfig(vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
                           num_hidden_layers=self.layers, num_attention_heads=self.heads,
                           num_key_value_heads=self.kv_heads, max_position_embeddings=4096,
                           tie_word_embeddings=self.tied, rope_theta=self.rope_theta, bos_token_id=1,
                           eos_token_id=2, pad_token_id=2)

    def tiny(self) -> Shape:
        """A 4-layer stand-in, named as one (not with the real model's name), with the same tying and grouping."""
        return Shape(f"stand-in for {self.name}", 4, 64, 4, 2 if self.kv_heads < self.heads else 4, 128, 320,
                     self.tied, self.rope_theta)


SHAPES = (
    Shape("SmolLM2-135M", 30, 576, 9, 3, 1536, 49152, True, 100000.0),
    Shape("Llama-3.2-1B-like", 16, 2048, 32, 8, 8192, 128256, True, 500000.0),
    Shape("Llama-2-7B-like", 32, 4096, 32, 32, 11008, 32000, False),
)


@dataclass(frozen=True)
class Settings:
    """How much the run measures: full on a GPU, tiny on a CPU."""

    tiny: bool
    """4-layer stand-ins of the shapes and a few tokens."""
    prompt_len: int
    """Prompt tokens of the timed decoding."""
    new_tokens: int
    """Tokens per timed generation (the exactness part generates twice as many on a CPU)."""
    repeats: int
    """Timed generations per measurement (median)."""
    verify_sizes: tuple[int, ...]
    """T of the verification cost v(T)."""
    spread_sizes: tuple[int, ...]
    """T of the one-row vs many-row spread."""
    spread_prompt_lengths: tuple[int, ...]
    """Lengths of the seeded prompts the spread is measured after."""
    budget_s: float
    """Wall budget in seconds: nothing new starts after it (0 = no budget)."""
    part_budgets_s: dict = field(default_factory=dict)
    """Each part's own budget in seconds from its start (a missing part or 0 = none)."""

    @classmethod
    def for_run(cls, tiny: bool, budget_s: float | None = None) -> Settings:
        if tiny:
            return cls(True, 8, 8, 1, (1, 2, 4, 8), (2, 3, 4, 8), (9,), budget_s or 0.0)
        return cls(False, 32, 64, 3, tuple(range(1, 33)), tuple(range(2, 33)), (5, 9, 14),
                   FULL_BUDGET_S if budget_s is None else budget_s, dict(PART_BUDGETS_S))


@dataclass
class Run:
    """What one check run carries from part to part."""

    device: torch.device
    """Where everything runs."""
    settings: Settings
    """How much it measures."""
    started: float = field(default_factory=time.perf_counter)
    """perf_counter() at the start."""
    notes: list[str] = field(default_factory=list)
    """Cut pieces and other remarks, in order (also printed under the table)."""
    backend: str | None = None
    """The compile backend of our static forwards (None: not compiled)."""
    result: dict = field(default_factory=dict)
    """The result so far (``save`` writes it)."""
    saver: Callable[[dict], None] | None = None
    """Writes the result (after every piece)."""
    part_name: str | None = None
    """The part running now."""
    part_started: float = 0.0
    """perf_counter() at its start."""

    def __post_init__(self):
        self.steps = StepCache(self.backend or "inductor")
        """Compiled steps shared by every runner of one geometry, dtype and device in this run."""
        self.graphs_at_start = lease.compile_count()
        """Dynamo's graph count when the run started."""

    @property
    def executor(self) -> str:
        """The executor the check decodes with: CUDA graphs on CUDA, their uncaptured static forwards elsewhere."""
        return "graphs" if self.device.type == "cuda" else "static"

    @property
    def compile(self) -> StepCache | bool:
        """What runners get as ``compile``: the run's shared ``StepCache`` when compiling, else False."""
        return self.steps if self.backend else False

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def over_budget(self, reserve: float = 0.0) -> bool:
        """Whether fewer than ``reserve`` seconds are left of the run's budget or of the running part's."""
        if lease.Budget(self.settings.budget_s, self.started).over(reserve):
            return True
        part = self.settings.part_budgets_s.get(self.part_name or "", 0.0)
        return lease.Budget(part, self.part_started).over(reserve)

    def cut(self, piece: str, reserve: float = 0.0) -> bool:
        """True (with a note saying so) when ``piece`` must not start: the budget, less ``reserve``, is spent."""
        if not self.over_budget(reserve):
            return False
        part = self.settings.part_budgets_s.get(self.part_name or "", 0.0)
        self.notes.append(f"{piece} cut: under {reserve:.0f} s left of the {self.settings.budget_s:.0f} s run budget "
                          f"or of part {self.part_name}'s {part:.0f} s (at {self.elapsed():.0f} s)")
        return True

    def save(self) -> None:
        self.result["seconds"] = self.elapsed()
        self.result["compiles"] = compile_counts(self)
        if self.saver is not None:
            self.saver(self.result)


def compile_counts(run: Run) -> dict:
    """Dynamo graphs compiled in this process (``transformers``' static-cache compiles included) and ours (the
    shared steps): in all and per step set (runners of one geometry, dtype and device share one)."""
    return {"dynamo_graphs": lease.compile_count() - run.graphs_at_start,
            "ours": run.steps.compiles, "per_step_set": run.steps.counts(), "backend": run.backend}


# --------------------------------------------------------------------------- helpers
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


COUNTS = ("builds", "captures", "compiles")
"""What the static executor counts (``StaticExecutor.counts``): forwards built, CUDA graphs captured, compiles."""


def graph_counts(runner: Runner) -> dict[str, int]:
    """The static executor's counts so far (zeros on the eager executor)."""
    return runner.static.counts() if runner.static is not None else dict.fromkeys(COUNTS, 0)


@dataclass
class GraphTally:
    """What the static executor built, captured and compiled, in warm-ups and in timed runs."""

    warmup: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))
    timed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))

    def add(self, before: dict[str, int], warm: dict[str, int], after: dict[str, int]) -> None:
        for key in COUNTS:
            self.warmup[key] += warm[key] - before[key]
            self.timed[key] += after[key] - warm[key]


def timed(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 2,
          runner: Runner | None = None, tally: GraphTally | None = None) -> float:
    """Median seconds of ``fn`` after ``warmup`` calls (which build static forwards and capture CUDA graphs);
    with ``runner`` and ``tally``, what was built and captured in each phase is added to ``tally``."""
    before = graph_counts(runner) if runner is not None else None
    for _ in range(warmup):
        fn()
    warm = graph_counts(runner) if runner is not None else None
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    if runner is not None and tally is not None:
        tally.add(before, warm, graph_counts(runner))
    return statistics.median(times)


def prompt_ids(vocab: int, length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=g).tolist()


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def error_text(e: BaseException) -> str:
    """One line: the exception and where it was raised."""
    where = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    at = f" at {Path(where.filename).name}:{where.lineno}" if where else ""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}{at}"


def tiny_runner(run: Run, kind: str, seed: int, dtype: torch.dtype, executor: str) -> Runner:
    return Runner.from_model(tiny_model(kind, seed, device=run.device), dtype=dtype, executor=executor,
                             compile=run.compile if executor != "eager" else False)


def note_fallback(run: Run, runner: Runner, where: str, executor: str | None = None) -> None:
    """Note a runner that left its executor (default the check's; a CUDA graph capture failed: it decodes eagerly
    since)."""
    if runner.executor != (executor or run.executor):
        run.notes.append(f"{where}: the runner fell back from {run.executor} to {runner.executor} (a CUDA graph "
                         "capture failed; see the warning on stderr)")


# --------------------------------------------------------------------------- exactness
def parity(device: torch.device) -> dict[str, float]:
    """Max |runner logits - transformers logits| over a 16-token prompt, per tiny model and dtype (eager)."""
    out = {}
    for kind, seed in TINY_MODELS:
        for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            model = tiny_model(kind, seed, device=device).to(dtype)
            runner = Runner.from_model(model, dtype=dtype)
            ids = torch.tensor(prompt_ids(320, 16, seed), device=device)  # (T,)
            ref = model(ids[None]).logits[0].float()  # (T, V)
            ours_ = runner.forward(runner.new_cache(32), ids).float()  # (T, V)
            out[f"{kind}/{name}"] = float((ref - ours_).abs().max())
            del model, runner
    return out


def spread_cases(run: Run) -> list[tuple[str, int, torch.dtype, str]]:
    """(kind, seed, dtype, executor) of the spread: fp32 on the check's executor and eager, bf16 eager (the compiled
    bf16 spread is measured at the real shapes, part a: a tiny bf16 model would compile twice more)."""
    return [(kind, seed, dtype, executor) for kind, seed in TINY_MODELS
            for dtype, executor in ((torch.float32, run.executor), (torch.float32, "eager"),
                                    (torch.bfloat16, "eager"))]


def spreads(run: Run) -> dict[str, dict]:
    """The one-row vs many-row spread of the tiny models on the device (``spread_cases``)."""
    out = {}
    s = run.settings
    for kind, seed, dtype, executor in spread_cases(run):
        runner = tiny_runner(run, kind, seed, dtype, executor)
        prompts = spread_prompts(runner.spec.vocab_size, s.spread_prompt_lengths, seed)
        found = measure_spread(runner, prompts, s.spread_sizes)
        found["per_size"] = {str(T): v for T, v in found["per_size"].items()}
        out[f"{kind}/{found['dtype']}/{executor}"] = found
        if executor == run.executor:
            note_fallback(run, runner, f"spread ({kind}, {found['dtype']})")
    return out


def registered_options(runner: Runner, plan: Path, E: int) -> dict[str, dict]:
    """Options that make every registered drafter draft (``infer.drafters.DRAFTERS``), drafting from exit ``E`` or
    under the skip plan file ``plan``; a drafter added to the registry without an entry here fails the check at
    once, so the GPU check never skips one."""
    options = {
        "autoregressive": {},
        "early_exit": {"exit_layer": E, "num_draft": 3},
        "dynamic_exit": {"exits": "/".join(str(x) for x in sorted({max(1, E // 2), E})), "num_draft": 3,
                         "min_speedup": 0, "adaptive": False,
                         "observe_every": 1, "calibrate": False},  # always drafts, choices from counts
        "self_sd": {"plan": str(plan), "num_draft": 4},
        "swift": dict(SWIFT_TREES),
    }
    missing = sorted(set(DRAFTERS) - set(options))
    if missing:
        raise RuntimeError(f"gpu_check has no drafting options for the registered drafter(s) {missing}: add them to "
                           "registered_options")
    return options


def drafter_specs(runner: Runner, folder: Path, adapter: Path | None = None) -> dict[str, tuple[str, dict]]:
    """Every registered drafter but autoregressive, with settings that make it draft on a 4-layer model, key ->
    (drafter, options): self_sd gets a small plan file, swift verifies token trees, and early exit also drafts
    through ``adapter`` (an exit adapter file for this model, ``tiny_adapter``) where one is given."""
    L = runner.num_layers
    plan = folder / f"plan-{runner.fingerprint[:8]}.json"
    PlanFile(LayerPlan(L, skip_attn=frozenset({L - 2}), skip_mlp=frozenset({L - 1})), runner.identity(),
             source="gpu_check").save(plan)
    specs = {name: (name, options) for name, options in registered_options(runner, plan, L // 2).items()
             if name != "autoregressive"}
    if adapter is not None:
        specs["early_exit_adapter"] = ("early_exit", {"adapter": str(adapter), "num_draft": 3})
    return specs


def tiny_adapter(run: Run, kind: str, seed: int, folder: Path) -> Path | None:
    """An exit adapter file for the tiny model (its plain exit at L/2 with seeded noise: a stand-in for a trained
    one), so the adapter's layer is decoded, compiled and captured like the model's; None, with a note, where the
    training code cannot be imported."""
    try:
        from train.adapter import AdapterLM
        from train.config import AdapterConfig
    except ImportError as e:
        run.notes.append(f"exit adapter skipped ({e.name or e} not installed)")
        return None
    model = tiny_model(kind, seed, device=run.device)
    lm = AdapterLM(model, AdapterConfig(enabled=True, exit_layer=model.config.num_hidden_layers // 2))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lm.adapter.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen).to(p.device, p.dtype))
    path = folder / f"adapter-{kind}-{seed}.safetensors"
    lm.save(path, {"source": "gpu_check"})
    return path


def outcome_counts(outcomes: list) -> dict[str, int]:
    """Verifications of one generation: how many, how many verified a tree (not a chain), and how many accepted a
    path that is not a prefix of the draft (its KV rows were compacted)."""
    counts = {"verifications": len(outcomes), "trees": 0, "compactions": 0}
    for outcome in outcomes:
        parents = outcome.draft.parents if outcome.draft is not None else None
        counts["trees"] += parents is not None and not TreeShape(parents).is_chain
        counts["compactions"] += outcome.path != list(range(len(outcome.path)))
    return counts


def decode_counting(engine: Engine, prompt: list[int], gen: DecodeConfig,
                    generator: torch.Generator | None = None) -> tuple[list[int], dict]:
    """Tokens of one generation and its ``outcome_counts``."""
    tokens, _, outcomes = decode_verified(engine, prompt, gen, generator)
    return tokens, outcome_counts(outcomes)


def greedy_identity(run: Run, new_tokens: int, models=TINY_MODELS[:1],
                    executors: tuple[str, ...] | None = None) -> dict:
    """Every drafter's fp32 greedy output vs autoregressive on the device, per tiny model and executor (default: the
    check's and eager), each mismatch classified with the drafter's own verification argmax and the rounding of the
    one-row path against an fp32 full-sequence recomputation (``infer.measure.exactness``; recorded per runner)."""
    detail: dict[str, dict] = {}
    gen = DecodeConfig(max_new_tokens=new_tokens, stop_at_eos=False)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        for kind, seed in models:
            adapter = tiny_adapter(run, kind, seed, Path(tmp)) if kind == "llama" else None  # the adapter's layer
            for executor in executors or (run.executor, "eager"):
                runner = tiny_runner(run, kind, seed, torch.float32, executor)
                detail |= {f"{kind}/{executor}/{name}": d for name, d in identity_runs(run, runner, seed, gen,
                                                                                        Path(tmp), adapter).items()}
                note_fallback(run, runner, f"greedy identity ({kind})", executor)
                del runner
                free(run.device)
    return identity_totals(detail)


def identity_runs(run: Run, runner: Runner, seed: int, gen: DecodeConfig, folder: Path,
                  adapter: Path | None = None) -> dict[str, dict]:
    """Each drafter's greedy runs on three seeded prompts against the autoregressive references, judged."""
    rounding = measure_rounding(runner, prompts=spread_prompts(320, run.settings.spread_prompt_lengths, seed))
    judge = DivergenceJudge(runner, gen, rounding["max_abs"])
    prompts = [prompt_ids(320, n, seed + n) for n in (5, 9, 14)]
    plain = Engine(runner, build_drafter("autoregressive", runner))
    refs = [plain.generate(p, gen).tokens for p in prompts]
    detail = {}
    for key, (name, options) in drafter_specs(runner, folder, adapter).items():
        try:
            engine = Engine(runner, build_drafter(name, runner, options))
        except ImportError as e:
            run.notes.append(f"greedy identity: {key} skipped ({e.name or e} not installed)")
            continue
        outs, counts = [], {"verifications": 0, "trees": 0, "compactions": 0}
        for p in prompts:
            tokens, verified, outcomes = decode_verified(engine, p, gen)
            outs.append((tokens, verified))
            counts = {k: counts[k] + c for k, c in outcome_counts(outcomes).items()}
        engine.close()
        wrong = [asdict(judge.classify(p, ref, out, verified))
                 for p, ref, (out, verified) in zip(prompts, refs, outs, strict=True) if out != ref]
        flips = sum(d["tie_flip"] for d in wrong)
        failures_ = len(wrong) - flips if run.device.type == "cuda" else len(wrong)
        detail[key] = {"rounding": rounding["max_abs"], "runs": len(prompts), "mismatches": len(wrong),
                        "tie_flips": flips, "failures": failures_, "divergences": wrong, **counts}
        run.save()
    return detail


def identity_totals(detail: dict[str, dict], prefix: str = "greedy") -> dict:
    total = {k: sum(d[k] for d in detail.values()) for k in ("mismatches", "tie_flips", "failures", "runs")}
    swift = [d for k, d in detail.items() if k.endswith("/swift")]
    return {f"{prefix}_fp32_mismatches": total["mismatches"], f"{prefix}_fp32_tie_flips": total["tie_flips"],
            f"{prefix}_fp32_failures": total["failures"], f"{prefix}_runs": total["runs"], f"{prefix}_detail": detail,
            f"{prefix}_swift_trees": sum(d["trees"] for d in swift),
            f"{prefix}_swift_compactions": sum(d["compactions"] for d in swift)}


def sampled(run: Run, new_tokens: int) -> dict[str, dict]:
    """One seeded sampled generation per drafter on the tiny Llama (fp32, the check's executor): it must complete
    with ``new_tokens`` tokens (no exactness claim: a drafter's sampled output is equal in distribution only)."""
    runner = tiny_runner(run, "llama", 0, torch.float32, run.executor)
    gen = DecodeConfig(max_new_tokens=new_tokens, stop_at_eos=False, sampling=SAMPLING)
    out = {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        specs = {"autoregressive": ("autoregressive", {})} | drafter_specs(runner, Path(tmp))
        for key, (name, options) in specs.items():
            try:
                engine = Engine(runner, build_drafter(name, runner, options))
                tokens, counts = decode_counting(engine, prompt_ids(320, 9, 3), gen)
                engine.close()
                out[key] = {"tokens": len(tokens), "ok": len(tokens) == new_tokens, **counts}
            except Exception as e:  # recorded, and fails the run
                out[key] = {"ok": False, "error": error_text(e)}
    note_fallback(run, runner, "sampling")
    return out


# --------------------------------------------------------------------------- syncs
SYNC_TARGETS = {
    "early_exit": ("per_cycle <= 1", lambda s: s["per_cycle"] <= 1.0),
    "self_sd": ("per_cycle <= draft_steps_per_cycle + 2", lambda s: s["per_cycle"] <= s["draft_steps_per_cycle"] + 2),
    "swift": ("per_cycle <= draft_steps_per_cycle + 2", lambda s: s["per_cycle"] <= s["draft_steps_per_cycle"] + 2),
}
"""Host syncs each drafter is held to (reported in the result; they do not fail the run)."""


def syncs(run: Run, new_tokens: int) -> dict:
    """Host syncs per cycle of every drafter, greedy, on the tiny Llama in fp32 on the check's executor (after a
    warm-up, so nothing is built while counting), and the targets."""
    runner = tiny_runner(run, "llama", 0, torch.float32, run.executor)
    gen = DecodeConfig(max_new_tokens=new_tokens, stop_at_eos=False)
    prompt = prompt_ids(320, 12, 7)
    out, targets = {}, {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        specs = drafter_specs(runner, Path(tmp))
        L = runner.num_layers
        for key, name, options in (("autoregressive", "autoregressive", {}),
                                   ("early_exit", "early_exit", {"exit_layer": L // 2, "num_draft": 4}),
                                   ("early_exit_confidence", "early_exit",
                                    {"exit_layer": L // 2, "num_draft": 4, "confidence": 0.5}),
                                   *((k, *specs[k]) for k in ("dynamic_exit", "self_sd", "swift"))):
            try:
                engine = Engine(runner, build_drafter(name, runner, options))
                engine.warm_up([prompt], gen)
                m = measure_decode(engine, prompt, gen)
                engine.close()
            except Exception as e:  # a drafter that cannot be measured here must not hide the others
                run.notes.append(f"syncs: {key} not measured ({error_text(e)})")
                continue
            out[key] = {k: float(m[k]) for k in ("per_cycle", "per_token", "draft_steps_per_cycle",
                                                 "update_per_cycle")} | {"cycles": m["cycles"], "tokens": m["tokens"]}
            if key in SYNC_TARGETS:
                rule, check = SYNC_TARGETS[key]
                targets[key] = {"target": rule, "met": bool(check(out[key]))}
    note_fallback(run, runner, "syncs")
    return {"syncs": out, "sync_targets": targets}


# --------------------------------------------------------------------------- shapes
DRAFT_VOCAB = 8192
"""Token ids of the reduced-vocabulary draft head whose c(E) is measured beside the full head's."""


@contextmanager
def uncaptured(runner: Runner):
    """Static forwards run as they are inside (compiled, not replayed as CUDA graphs): what a kernel count profiles,
    since CUPTI on CUDA 13.0 reports the kernels of a graph replay wrongly."""
    static = runner.static
    capture = static.capture if static is not None else False
    if static is not None:
        static.capture = False
    try:
        yield
    finally:
        if static is not None:
            static.capture = capture


def kernel_count(fn: Callable[[], object], device: torch.device) -> dict:
    """Kernels one call of ``fn`` launches: CUDA kernels through the profiler (``lease.kernel_profile``); on a CPU a
    stand-in, the top-level operators (``infer.compiled.count_kernels``), so the check's plumbing runs there too."""
    if device.type == "cuda":
        return lease.kernel_profile(fn, device)
    from infer.compiled import count_kernels

    fn()
    return {"kernels_per_forward": count_kernels(fn, device), "attention_kernels": [],
            "kernel_note": "CPU stand-in: top-level operators, a compiled region counted once"}


def kernels(runner: Runner, P: int, span: Callable[[int, int], Callable[[], object]], device: torch.device) -> dict:
    """Kernels per one-token forward: the static forward uncaptured (compiled where the run compiles) and the eager
    forward, with the check that the static count is at least one kernel per layer (a lower count means the
    profiler missed kernels)."""
    L = runner.num_layers
    with uncaptured(runner):
        found = kernel_count(span(1, L), device)
    one = torch.tensor([10], device=device)  # (1,)
    eager = kernel_count(lambda: runner.forward(runner.new_cache(P + 2), one), device)
    n = found["kernels_per_forward"]
    found |= {"kernels_per_layer": None if n is None else n / L, "kernels_counted_on": "uncaptured static forward",
              "kernels_per_forward_eager": eager["kernels_per_forward"],
              "attention_kernels_eager": eager["attention_kernels"],
              "kernels_at_least_one_per_layer": None if n is None else n >= L}
    return found


def forward_costs(runner: Runner, settings: Settings, device: torch.device, tally: GraphTally) -> dict:
    """ms of a one-token full forward, v(T) for T in ``verify_sizes``, c(E) at E = L/4, L/2, 3L/4 with the full LM
    head and with a ``DRAFT_VOCAB``-token draft head (``c_vocab``; random ids: speed does not depend on which), and
    the kernel counts (``kernels``), in a pooled cache (the capacity the decoding uses, so its static forwards and
    graphs serve both)."""
    L, P = runner.num_layers, settings.prompt_len
    cache = runner.take_cache(P + max(settings.verify_sizes) + 8)
    context = torch.tensor(prompt_ids(runner.spec.vocab_size, P, 0), device=device)  # (P,)
    runner.forward(cache, context)
    repeats = 3 if settings.tiny else 10
    V = runner.spec.vocab_size
    head = runner.draft_head(torch.randperm(V, generator=torch.Generator().manual_seed(0))[:min(DRAFT_VOCAB, V // 4)])

    def span(T: int, end: int, vocab=None) -> Callable[[], object]:
        ids = torch.arange(10, 10 + T, device=device)  # (T,)

        def step():
            cache.rollback(P)
            return runner.span(cache, runner.embed(ids), list(range(P, P + T)), 0, end, logits=True, vocab=vocab)
        return step

    try:
        full = {T: timed(span(T, L), device, repeats, runner=runner, tally=tally) for T in settings.verify_sizes}
        exits = sorted({max(1, round(L * f)) for f in (0.25, 0.5, 0.75)})
        draft = {E: timed(span(1, E), device, repeats, runner=runner, tally=tally) for E in exits}
        small = {E: timed(span(1, E, head), device, repeats, runner=runner, tally=tally) for E in exits}
        counted = kernels(runner, P, span, device)
    finally:
        runner.release_cache(cache)
    return {"ms_forward": 1000 * full[1], "v": {str(T): t / full[1] for T, t in full.items()},
            "c": {str(E): t / full[1] for E, t in draft.items()},
            "c_vocab": {str(E): t / full[1] for E, t in small.items()}, "draft_vocab": head.size, **counted}


def shape_drafters(runner: Runner, folder: Path) -> dict[str, tuple[str, dict]]:
    """Every registered drafter whose per-cycle cost is measured at a shape: key -> (name, options). Self-SD skips
    alternate sublayers of the back half (a plan file for this model), SWIFT verifies token trees, early and dynamic
    exit draft from E = L/4 (dynamic_exit choosing between L/8 and L/4)."""
    L = runner.num_layers
    plan = folder / f"plan-{runner.fingerprint[:8]}.json"
    PlanFile(LayerPlan(L, skip_attn=frozenset(range(L // 2, L, 2)), skip_mlp=frozenset(range(L // 2 + 1, L, 2))),
             runner.identity(), source="gpu_check").save(plan)
    options = registered_options(runner, plan, max(1, L // 4))
    options["early_exit"] = options["early_exit"] | {"num_draft": 4}
    return {name: (name, opts) for name, opts in options.items()}


def decode_speed(engine: Engine, prompt: list[int], settings: Settings, tally: GraphTally) -> dict:
    """tokens/s (median of repeats after ``Engine.warm_up``, which builds every static forward and captures every
    CUDA graph the timed runs use), and per cycle: draft and verify ms (``step_times``), tokens, drafted tokens."""
    gen = DecodeConfig(max_new_tokens=settings.new_tokens, stop_at_eos=False)
    runner = engine.runner
    before = graph_counts(runner)
    engine.warm_up([prompt], gen)
    warm = graph_counts(runner)
    results = [engine.generate(prompt, gen) for _ in range(settings.repeats)]
    tally.add(before, warm, graph_counts(runner))
    s = results[-1].stats
    cycles = max(1, s.verify_calls)
    return {"tok_s": statistics.median(r.stats.tokens_per_second for r in results),
            "tokens_per_cycle": s.new_tokens / cycles, "drafted_per_cycle": s.drafted / cycles,
            "acceptance": s.acceptance_rate, **step_times(engine, prompt, gen)}


def step_times(engine: Engine, prompt: list[int], gen: DecodeConfig) -> dict:
    """ms of drafting and of verifying per cycle of one more generation, from CUDA events on CUDA
    (``infer.measure.timing``; the engine's own split is taken without a device sync) and perf_counter elsewhere."""
    s = timed_generate(engine, prompt, gen)[0].stats
    cycles = max(1, s.verify_calls)
    return {"draft_ms_per_cycle": 1000 * s.draft_time / cycles, "verify_ms_per_cycle": 1000 * s.verify_time / cycles,
            "step_timer": "cuda events" if engine.runner.device.type == "cuda" else "perf_counter"}


def drafter_costs(run: Run, runner: Runner, prompt: list[int], tally: GraphTally, into: dict) -> None:
    """Every drafter's decoding speed and per-cycle cost at this shape, into ``into`` (saved after each)."""
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        for key, (name, options) in shape_drafters(runner, Path(tmp)).items():
            if run.cut(f"drafter cost {key}"):
                continue
            try:
                engine = Engine(runner, build_drafter(name, runner, options))
                into[key] = decode_speed(engine, prompt, run.settings, tally)
                engine.close()
            except Exception as e:  # one drafter that cannot run here must not hide the others
                into[key] = {"error": error_text(e)}
            run.save()


def peer_generate(model, prompt: list[int], run: Run, key: str, kwargs: dict) -> dict:
    """One ``transformers`` generate variant on ``model``: tokens/s (median) after warm-up, and the compiles inside
    its timed runs (``hf_static`` is compiled by transformers on CUDA). A failure is a note."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # generate() warns about its assistant's and the static cache's kwargs
    settings, device = run.settings, run.device
    x = torch.tensor([prompt], device=device)  # (1, P)
    mask = torch.ones_like(x)
    model.generation_config.eos_token_id = None  # random weights: run to max_new_tokens like ours
    gen = GenerationConfig(max_new_tokens=settings.new_tokens, min_new_tokens=settings.new_tokens,
                           do_sample=False, eos_token_id=None, pad_token_id=0, **kwargs)

    def call():
        return model.generate(x, attention_mask=mask, generation_config=gen)[0].tolist()
    try:
        for _ in range(2 if kwargs.get("cache_implementation") else 1):  # warm-up: the full prompt and length
            call()
        compiles = lease.compile_count()
        seconds = timed(call, device, settings.repeats, warmup=0)
        out = {key: settings.new_tokens / seconds, key.replace("_tok_s", "_compiles_in_timed"):
               lease.compile_count() - compiles}
    except Exception as e:  # a peer transformers cannot run here (or out of memory) must not hide the others
        run.notes.append(f"{model.config.num_hidden_layers}-layer shape: {key} failed ({error_text(e)})")
        out = {}
    free(device)
    return out


PEERS_REST = {"hf_dynamic_tok_s": {}, "hf_early_exit_tok_s": {"num_assistant_tokens": 4}}
"""The uncompiled transformers peers of part e: dynamic cache, the early-exit assistant (at E = L/4)."""


def peak_gb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def shape_model(shape: Shape, run: Run):
    """(the shape used, its random-init transformers model on the device, dtype): bf16 on CUDA, fp32 stand-ins on a
    CPU."""
    shape = shape.tiny() if run.settings.tiny else shape
    dtype = torch.bfloat16 if run.device.type == "cuda" else torch.float32
    return shape, random_model(shape.config(), run.device, dtype), dtype


def measure_shape(shape: Shape, run: Run, first: bool, result: dict) -> None:
    """One shape's pieces in falling order of value, into ``result`` (saved after each): our plain decoding, the
    compiled static-cache ``generate``, the forward costs and kernel counts, (``first``) every drafter's per-cycle
    cost, the bf16 spread (CUDA)."""
    settings, device = run.settings, run.device
    shape, model, dtype = shape_model(shape, run)
    runner = Runner.from_model(model, dtype=dtype, executor=run.executor, compile=run.compile)
    model.to("cpu")  # our peak memory without the peer's weights
    free(device)
    reset_peak(device)
    prompt = prompt_ids(shape.vocab, settings.prompt_len, 1)
    result |= {"layers": shape.layers, "dtype": str(dtype).removeprefix("torch."), "executor": runner.executor}
    tally = GraphTally()
    E = max(1, runner.num_layers // 4)
    ar = decode_speed(Engine(runner, build_drafter("autoregressive", runner)), prompt, settings, tally)
    result |= {"ours_ar_tok_s": ar["tok_s"], "ours_ar_verify_ms": ar["verify_ms_per_cycle"],
               "peak_gb_ours": peak_gb(device)}
    record_tally(result, tally)
    run.save()
    model.to(device)
    if not run.cut(f"{shape.name}: hf_static", COMPILE_RESERVE_S):
        reset_peak(device)
        result |= peer_generate(model, prompt, run, "hf_static_tok_s", {"cache_implementation": "static"})
        result["peak_gb_peers"] = peak_gb(device)
        run.save()
    del model
    free(device)
    if not run.cut(f"{shape.name}: forward costs"):
        result |= forward_costs(runner, settings, device, tally)
        record_tally(result, tally)
        run.save()
    if first:
        drafter_costs(run, runner, prompt, tally, result.setdefault("drafters", {"E": E}))
        record_tally(result, tally)
    if dtype == torch.bfloat16 and not run.cut(f"{shape.name}: bf16 spread"):
        prompts = spread_prompts(shape.vocab, settings.spread_prompt_lengths)
        result["spread_bf16"] = measure_spread(runner, prompts, settings.spread_sizes)["max_abs"]
    note_fallback(run, runner, shape.name)
    result["executor_after"] = runner.executor
    run.save()


def record_tally(result: dict, tally: GraphTally) -> None:
    result["static"] = asdict(tally)
    result |= {f"{key}_in_timed": n for key, n in tally.timed.items()}  # builds, captures, compiles


def rest_peers(run: Run, names: list[str] | None) -> dict:
    """Part e's transformers peers at every shape (the model built again), saved after each."""
    shapes = run.result.setdefault("shapes", {})
    for shape in SHAPES:
        if names and shape.name not in names or run.cut(f"{shape.name}: uncompiled peers"):
            continue
        used, model, _ = shape_model(shape, run)
        E = max(1, used.layers // 4)
        for key, kwargs in PEERS_REST.items():
            extra = {"assistant_early_exit": E} if "early_exit" in key else {}
            shapes.setdefault(used.name, {}).update(peer_generate(model, prompt_ids(used.vocab, run.settings.prompt_len,
                                                                                    1), run, key, kwargs | extra))
            run.save()
        del model
        free(run.device)
    return {}


# --------------------------------------------------------------------------- training
@torch.no_grad()
def runner_decode(model_dir: Path, device: torch.device, dtype: torch.dtype, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens from a trained checkpoint through our runner (eager: this checks the checkpoint,
    not the CUDA-graph capture, which part b covers)."""
    runner = Runner.from_pretrained(model_dir, dtype=dtype, device=device, executor="eager")
    cache = runner.new_cache(len(prompt) + n + 1)
    tokens = [int(runner.forward(cache, torch.tensor(prompt, device=runner.device))[-1].argmax())]
    while len(tokens) < n:
        tokens.append(int(runner.forward(cache, torch.tensor(tokens[-1:], device=runner.device))[-1].argmax()))
    return tokens


def optional_in(error: str) -> str | None:
    """The optional package (``lease.OPTIONAL``) a recorded error says is missing, if any."""
    found = re.search(r"No module named '([\w.]+)'|requires? (?:the )?`?(\w+)`? (?:library|package)", error)
    name = found and (found.group(1) or found.group(2)).split(".")[0].lower()
    return name if name in lease.OPTIONAL else None


def training(run: Run, tokenizer_dir: str | None, out: Path) -> dict:
    try:
        from train_bench import train_check, update_training_doc
    except ImportError as e:
        run.notes.append(f"training part skipped: {e}")
        return {}
    result = train_check(str(run.device), tiny=run.settings.tiny, tokenizer_dir=tokenizer_dir, decode=runner_decode)
    missing = optional_in(result.get("train_e2e", {}).get("error", ""))
    if result.get("e2e_ok") is False and missing:  # an image without accelerate: a note, not a failure
        run.notes.append(f"end-to-end training check skipped: {missing} is not installed")
        result["e2e_ok"] = None
    doc = out / "TRAINING.md"
    if not doc.exists():
        doc.write_text("<!-- gpu_check:train:begin -->\n<!-- gpu_check:train:end -->\n")
    try:
        update_training_doc(result, str(doc))
    except ValueError as e:
        run.notes.append(f"training table not written: {e}")
    return result


# --------------------------------------------------------------------------- report
def failures(result: dict) -> list[str]:
    """Why the run fails (empty: it passes): fp32 greedy mismatches beyond tie flips, a sampled generation that
    did not complete, the end-to-end training check, a part that raised."""
    ex = result.get("exact", {})
    out = [f"{ex[f'{p}_fp32_failures']} fp32 greedy mismatch(es)" for p in ("greedy", "greedy_rest")
           if ex.get(f"{p}_fp32_failures")]
    out += [f"sampled generation of {name} did not complete" for name, s in ex.get("sampling", {}).items()
            if not s.get("ok")]
    if result.get("e2e_ok") is False:
        out.append("the end-to-end training check failed")
    out += [f"part {name} raised {text}" for name, text in result.get("errors", {}).items()]
    return out


def _num(d: dict, key: str, spec: str = ".0f") -> str:
    return "–" if d.get(key) is None else format(d[key], spec)


def sizes_text(sizes: list[int]) -> str:
    """'2..32' for a contiguous range, else the sizes listed."""
    if len(sizes) > 2 and sizes == list(range(sizes[0], sizes[-1] + 1)):
        return f"{sizes[0]}..{sizes[-1]}"
    return ", ".join(str(T) for T in sizes)


def exact_lines(ex: dict, spread_sizes: list[int]) -> list[str]:
    lines = []
    for p, what in (("greedy", "tiny Llama, every executor"), ("greedy_rest", "tiny Qwen2")):
        if f"{p}_runs" in ex:
            lines.append(f"Greedy fp32 output of the drafters vs autoregressive ({what}): {ex[f'{p}_fp32_mismatches']} "
                         f"mismatch(es) in {ex[f'{p}_runs']} runs, {ex[f'{p}_fp32_tie_flips']} tie flip(s), "
                         f"{ex[f'{p}_fp32_failures']} failure(s); SWIFT verified {ex[f'{p}_swift_trees']} token "
                         f"trees ({ex[f'{p}_swift_compactions']} compacted paths).")
    sampling = ex.get("sampling", {})
    if sampling:
        done = [n for n, s in sampling.items() if s.get("ok")]
        lines.append(f"Sampled generations completed: {len(done)} of {len(sampling)} ({', '.join(done) or 'none'}).")
    if "parity_max_abs" in ex:
        lines.append(f"Runner vs transformers logits max |diff| {ex['parity_max_abs']:.2e} (fp32).")
    if ex.get("spread"):
        lines += ["", f"One-row vs many-row spread (max |logit difference|, T = {sizes_text(spread_sizes)}):", "",
                  "| model/dtype/executor | spread |", "|---|---:|"]
        lines += [f"| {k} | {v['max_abs']:.3g} |" for k, v in ex["spread"].items()]
    return lines


def sync_lines(result: dict) -> list[str]:
    s, targets = result.get("syncs", {}), result.get("sync_targets", {})
    if not s:
        return []
    lines = ["", "Host syncs (tiny model, fp32, greedy):", "",
             "| drafter | per cycle | per token | draft steps / cycle | in update / cycle | target |",
             "|---|---:|---:|---:|---:|---|"]
    for name, m in s.items():
        t = targets.get(name)
        goal = "–" if t is None else f"{t['target']}: {'met' if t['met'] else 'NOT met'}"
        lines.append(f"| {name} | {m['per_cycle']:.2f} | {m['per_token']:.2f} | {m['draft_steps_per_cycle']:.2f} | "
                     f"{m['update_per_cycle']:.2f} | {goal} |")
    return lines


def shape_row(name: str, s: dict) -> str:
    first = lambda d: d[min(d, key=int)] if d else None  # noqa: E731  (c at the smallest E: L/4)
    c, c_vocab = first(s.get("c", {})), first(s.get("c_vocab", {}))
    ratio = s["ours_ar_tok_s"] / s["hf_static_tok_s"] if s.get("hf_static_tok_s") and s.get("ours_ar_tok_s") else None
    v = s.get("v", {})
    cells = [name, _num(s, "ours_ar_tok_s"), _num(s, "hf_static_tok_s"), "–" if ratio is None else f"{ratio:.2f}x",
             _num(s, "ms_forward", ".2f"), _num(v, "2", ".2f"), _num(v, "8", ".2f"), _num(v, "32", ".2f"),
             "–" if c is None else f"{c:.2f}", "–" if c_vocab is None else f"{c_vocab:.2f}",
             _num(s, "kernels_per_layer", ".1f"), _num(s, "kernels_per_forward_eager"),
             _num(s, "hf_dynamic_tok_s"), _num(s, "hf_early_exit_tok_s")]
    return "| " + " | ".join(cells) + " |"


def shape_lines(shapes: dict) -> list[str]:
    lines = ["", "| shape | ours AR tok/s | HF static tok/s | AR / HF static | ms/forward | v(2) | v(8) | v(32) | "
             "c(L/4) | c(L/4), 8K draft vocab | kernels/layer | eager kernels/forward | HF dynamic | HF early exit |",
             "|---|" + "---:|" * 13]
    notes = []
    for name, s in shapes.items():
        if "error" in s:
            notes.append(f"{name} failed: {s['error']}")
        lines.append(shape_row(name, s))
        if s.get("captures_in_timed") or s.get("builds_in_timed") or s.get("compiles_in_timed"):
            notes.append(f"{name}: the timed runs captured {s['captures_in_timed']} CUDA graph(s), built "
                         f"{s['builds_in_timed']} static forward(s) and compiled {s.get('compiles_in_timed', 0)} "
                         "time(s) (should be 0: warm-up missed a shape)")
        if s.get("kernels_at_least_one_per_layer") is False:
            notes.append(f"{name}: fewer kernels than layers counted: the profiler missed kernels")
    for name, s in shapes.items():
        if s.get("drafters"):
            lines += ["", f"Per-cycle cost of each drafter at the {name} shape (E = {s['drafters']['E']}):", "",
                      "| drafter | tok/s | tokens / cycle | drafted / cycle | draft ms / cycle | verify ms / cycle |",
                      "|---|---:|---:|---:|---:|---:|"]
            lines += [f"| {k} | " + (f"failed: {d['error']} | | | | |" if "error" in d else
                                     f"{d['tok_s']:.0f} | {d['tokens_per_cycle']:.2f} | {d['drafted_per_cycle']:.2f} | "
                                     f"{d['draft_ms_per_cycle']:.2f} | {d['verify_ms_per_cycle']:.2f} |")
                      for k, d in s["drafters"].items() if k != "E"]
    return lines + [f"\nNote: {n}" for n in notes]


def part_lines(result: dict) -> list[str]:
    parts = result.get("parts", {})
    c = result.get("compiles", {})
    line = "; ".join(f"{name} {p.get('seconds', 0):.0f} s from {p['start_s']:.0f} s, {p.get('compiles', 0)} compile(s)"
                     + (" (cut)" if p.get("cut") else "") for name, p in parts.items())
    return ["", f"Parts: {line}. Dynamo graphs compiled: {c.get('dynamo_graphs', 0)} in all, {c.get('ours', 0)} of "
            f"them ours ({c.get('backend') or 'not compiled'})."] if parts else []


def markdown(result: dict) -> str:
    """The GPU.md block: machine, versions, commit, command, the shapes, exactness, syncs, parts."""
    lines = [f"Device: {result['device']}; torch {result['torch']}, transformers {result['transformers']}; "
             f"commit {result['commit']}; {result['date']}{' (tiny stand-in shapes)' if result['tiny'] else ''}; "
             f"{result.get('seconds', 0):.0f} s.", "", f"```\n{result['command']}\n```"]
    lines += shape_lines(result.get("shapes", {}))
    if "exact" in result:
        lines += [""] + exact_lines(result["exact"], result.get("settings", {}).get("spread_sizes", []))
    lines += sync_lines(result)
    lines += part_lines(result)
    for note in result["notes"]:
        lines.append(f"\nNote: {note}")
    for why in failures(result):
        lines.append(f"\nFAILED: {why}")
    return "\n".join(lines)


def update_doc(path: Path, block: str) -> None:
    """Replace the text between the markers (appending them to a page that lacks them)."""
    text = path.read_text(encoding="utf-8") if path.is_file() else "# GPU results\n"
    new = f"{BEGIN}\n{block}\n{END}"
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    text = pattern.sub(lambda _: new, text, count=1) if pattern.search(text) else text.rstrip() + f"\n\n{new}\n"
    path.write_text(text, encoding="utf-8")


# --------------------------------------------------------------------------- the run
def part(name: str, fn: Callable[[], dict], run: Run, into: str | None = None, grad: bool = False) -> None:
    """Run one part under its own budget (``PART_BUDGETS_S``): its numbers merge into the result (or its ``into``
    section; an exception is recorded under ``errors``); its start offset, seconds, budget and dynamo graph compiles
    go under ``parts``; the result is saved. Parts run under ``torch.no_grad()``, the engine's grad mode (``grad``:
    with grad, for training)."""
    result = run.result
    record = {"start_s": round(run.elapsed(), 2), "budget_s": run.settings.part_budgets_s.get(name, 0.0)}
    result.setdefault("parts", {})[name] = record
    if lease.Budget(run.settings.budget_s, run.started).over():
        run.notes.append(f"part {name} cut: the {run.settings.budget_s:.0f} s run budget was spent "
                         f"({run.elapsed():.0f} s)")
        record |= {"seconds": 0.0, "compiles": 0, "cut": True}
        run.save()
        return
    t0, graphs = time.perf_counter(), lease.compile_count()
    run.part_name, run.part_started = name, t0
    try:
        with torch.set_grad_enabled(grad):
            found = fn()
        (result.setdefault(into, {}) if into else result).update(found)
    except Exception as e:  # one part's failure must not lose the others' numbers
        missing = lease.optional_missing(e)
        if missing:  # an optional package this image lacks: a note, not a failure
            run.notes.append(f"part {name} skipped: {missing} is not installed")
        else:
            result.setdefault("errors", {})[name] = error_text(e)
            print(f"gpu_check: part {name} failed:\n{traceback.format_exc()}", file=sys.stderr)
    free(run.device)  # after the except clause: the exception's frames (and their tensors) are gone by now
    record |= {"seconds": round(time.perf_counter() - t0, 2), "compiles": lease.compile_count() - graphs,
               "cut": any(n.startswith(("part " + name + " cut",)) or f"of part {name}'s" in n for n in run.notes)}
    run.part_name = None
    run.save()


def parity_part(run: Run) -> dict:
    par = parity(run.device)
    return {"parity_max_abs": max(v for k, v in par.items() if k.endswith("fp32")), "parity": par,
            "tf32": torch.backends.cuda.matmul.allow_tf32}


def shapes_part(run: Run, names: list[str] | None) -> dict:
    """Every shape in turn (the result saved after each piece); a shape that fails records its error and the next
    one runs."""
    shapes = run.result.setdefault("shapes", {})
    first = True
    for shape in SHAPES:
        if names and shape.name not in names:
            continue
        label = shape.tiny().name if run.settings.tiny else shape.name
        if run.cut(f"shape {label}"):
            continue
        found = shapes.setdefault(label, {})
        try:
            measure_shape(shape, run, first, found)
        except Exception as e:  # out of memory, ...: the next shape still runs
            found["error"] = error_text(e)
        first = False
        free(run.device)
        run.save()
    return {}


def rest_part(run: Run, names: list[str] | None, new_tokens: int) -> dict:
    """Part e: parity and spreads of the tiny models, greedy identity on the second one, the uncompiled peers."""
    exact = run.result.setdefault("exact", {})
    if not run.cut("parity"):
        exact |= parity_part(run)
        run.save()
    if not run.cut("spread"):
        exact["spread"] = spreads(run)
        run.save()
    if not run.cut("greedy identity on the second tiny model"):
        found = greedy_identity(run, new_tokens, TINY_MODELS[1:], (run.executor,))
        exact |= identity_totals(found["greedy_detail"], "greedy_rest")
        run.save()
    rest_peers(run, names)
    return {}


def head(args: argparse.Namespace, run: Run, tiny: bool) -> dict:
    settings = run.settings
    return {"device": torch.cuda.get_device_name(run.device) if run.device.type == "cuda" else "cpu",
            "torch": torch.__version__, "transformers": transformers.__version__, "commit": lease.commit(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": "python scripts/gpu_check.py " + " ".join(shlex.quote(a) for a in args.argv),
            "tiny": tiny, "executor": run.executor, "threads": torch.get_num_threads(),
            "settings": asdict(settings) | {"verify_sizes": list(settings.verify_sizes),
                                            "spread_sizes": list(settings.spread_sizes),
                                            "spread_prompt_lengths": list(settings.spread_prompt_lengths)},
            "complete": False, "notes": run.notes}


def check(args: argparse.Namespace, save: Callable[[dict], None]) -> dict:
    device = resolve_device(args.device)
    tiny = args.tiny or device.type == "cpu"
    if device.type == "cpu":
        torch.set_num_threads(1)  # tiny ops gain nothing from threads, and on a busy machine their spin-waits stall
    backend = args.compile_backend or ("inductor" if resolve_compile(None, device) else None)
    run = Run(device, Settings.for_run(tiny, args.budget_s), backend=backend, saver=save)
    run.result = head(args, run, tiny)
    new_tokens = run.settings.new_tokens * (2 if tiny else 1)
    if importlib.util.find_spec("optuna") is None:
        run.notes.append("optuna not installed: swift's Bayesian step is random search")
    run.save()
    part("shapes", lambda: shapes_part(run, args.shapes), run)
    part("greedy", lambda: greedy_identity(run, new_tokens), run, into="exact")
    part("checks", lambda: checks_part(run, new_tokens, 32 if tiny else 64), run)
    if not args.skip_train:
        part("train", lambda: training(run, args.tokenizer_dir, args.out), run, grad=True)
    part("rest", lambda: rest_part(run, args.shapes, new_tokens), run)
    run.result["complete"] = True
    run.result["failures"] = failures(run.result)
    return run.result


def checks_part(run: Run, new_tokens: int, sync_tokens: int) -> dict:
    """Part c: one sampled generation per drafter, then the host syncs per cycle."""
    if not run.cut("sampling"):
        run.result.setdefault("exact", {})["sampling"] = sampled(run, new_tokens)
        run.save()
    return {} if run.cut("syncs") else syncs(run, sync_tokens)


def run_check(args: argparse.Namespace) -> int:
    args.out = lease.out_dir(args.out)
    check_output_dir(args.out, "--out", writes=(RESULT_FILE,), force=args.force)  # + GPU.md and TRAINING.md
    args.out.mkdir(parents=True, exist_ok=True)
    latest = args.out / RESULT_FILE

    def save(result: dict) -> None:
        lease.write_json(latest, result)

    result = check(args, save)
    save(result)
    block = markdown(result)
    update_doc(args.out / "GPU.md", block)
    print(block)
    print(f"wrote {latest} and {args.out / 'GPU.md'} in {result['seconds']:.0f}s", file=sys.stderr)
    for why in result["failures"]:
        print(f"gpu_check: FAILED: {why}", file=sys.stderr)
    return 1 if result["failures"] else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = Parser(description=__doc__.split("\n\n")[0])
    add_run_flags(p, skip=("dtype", "executor", "threads"))  # --device, declared once for every command
    p.set_defaults(device=RunSettings().device)  # its flag's value when not given (the help shows it)
    p.add_argument("--tiny", action="store_true", help="4-layer stand-ins and a few tokens (implied on a CPU)")
    p.add_argument("--out", type=Path, default=None, help=f"folder for {RESULT_FILE}, GPU.md (the result block) and "
                   "TRAINING.md (the training table) (default: $OUT when set, else runs/gpu/)")
    p.add_argument("--force", action="store_true", help=f"write over an earlier run's {RESULT_FILE} in --out")
    p.add_argument("--shapes", type=lambda s: [x.strip() for x in s.split(",") if x.strip()], default=None,
                   help=f"only these shapes (comma-separated): {', '.join(s.name for s in SHAPES)}")
    p.add_argument("--skip-train", action="store_true", help="skip the training part")
    p.add_argument("--tokenizer-dir", default=None, help="training end-to-end check: a model folder whose tokenizer "
                   "to use (default: a byte-level tokenizer built in code, so no model cache is needed)")
    p.add_argument("--budget-s", type=finite_float, default=None, metavar="SECONDS",
                   help="wall budget: no piece starts after it; each part also has its own budget, and an hf_static "
                   f"peer (a torch.compile) needs {COMPILE_RESERVE_S:.0f} s of its part's left (default: "
                   f"{FULL_BUDGET_S:.0f} on a GPU, none with tiny shapes; 0 = none)")
    p.add_argument("--compile-backend", choices=BACKENDS, default=None,
                   help="compile our static forwards with this torch.compile backend (default: inductor on CUDA, "
                   "no compiling on a CPU; 'eager' traces and counts graphs in seconds: a rehearsal)")
    args = p.parse_args(argv)
    args.argv = argv
    return run_main("gpu_check", lambda: run_check(args))


if __name__ == "__main__":
    sys.exit(main())
