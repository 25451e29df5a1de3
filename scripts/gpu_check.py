"""One command, one run on a GPU machine: exactness, host syncs, forward costs, decoding speed against `transformers`,
training.

    python3 scripts/gpu_check.py                                  # a GPU machine: the full run (<= 400 s budget)
    python3 scripts/gpu_check.py --device cpu                     # tiny shapes, a few tokens, seconds (CI)

Runs from a bare checkout (importing ``lease`` puts the checkout on ``sys.path``). Results go to ``--out``, else
``$OUT`` (the folder that comes back from a device lease), else ``runs/gpu/``: ``gpu_check.json``, rewritten after
every part and every shape (a command killed during the 7B compile keeps the smaller shapes), ``GPU.md`` (the result
block) and ``TRAINING.md`` (the training table). ``--budget-s`` is the run's own wall budget: nothing new starts
after it, so it ends with results. A missing optional package (``lease.OPTIONAL``) is a note, not a failure.

Parts, in order (a part that raises is recorded under ``errors`` and the run goes on):

1. exact: logits of our runner vs `transformers` on two tiny seeded models (Llama, Qwen2) in fp32
   and bf16 (``parity_max_abs`` is the fp32 maximum); the one-row vs many-row logit spread of those
   models on the device (fp32 and bf16, the check's executor and eager: ``infer.measure.exactness.measure_spread``);
   greedy output of every drafter vs ``autoregressive`` on the device in fp32 (SWIFT with token trees),
   each mismatch classified with the drafter's own verification argmax and the fp32 runner's measured
   rounding (``infer.measure.exactness``): on CUDA only mismatches beyond a tie flip fail (cuBLAS is not
   batch-invariant, fp32 included), on a CPU every mismatch fails; one seeded sampled generation per
   drafter, which must complete.
2. syncs: host syncs per draft-verify cycle of every drafter (``infer.measure.syncs.measure_decode``) on a tiny
   model in fp32, with the targets they are held to (reported, never failing the run).
3. train: ``train_bench.train_check`` (training step speed/memory and an end-to-end
   train -> save -> decode check, with a byte-level tokenizer built in code unless ``--tokenizer-dir``).
4. shapes: random-init SmolLM2-135M, Llama-3.2-1B-like and Llama-2-7B-like models in bf16
   (``--tiny``: 4-layer stand-ins of each): ms per full one-token forward; v(T) = cost of
   verifying T tokens / one token, T = 1..32; c(E) = cost of a draft step through layers [0, E) +
   norm + head / one full forward, E = L/4, L/2, 3L/4; CUDA kernels per forward and the attention
   kernels' names (torch's profiler); our autoregressive and ``early_exit`` (E = L/4, k = 4) tokens/s
   with the early exit's draft and verify step times (CUDA events), and the static forwards built and
   CUDA graphs captured in warm-up and in timed runs (timed runs must capture none); the bf16 spread at
   that shape; our peak memory with the transformers model off the device; the peers ``hf_generate``
   (dynamic cache), ``hf_early_exit`` (transformers' assistant at E = L/4) and ``hf_static`` (static
   cache; compiled by transformers on CUDA, its compiles inside the timed runs counted; not started
   within ``COMPILE_RESERVE_S`` of the budget: skipped with a note).

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
from dataclasses import asdict, dataclass, field
from pathlib import Path

import lease  # first: puts the checkout on sys.path (a bare checkout on a GPU image)
import torch
import transformers
from transformers import GenerationConfig, LlamaConfig

from infer.drafters import build_drafter
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
from layerskip_core.cli import check_output_dir, run_main
from layerskip_core.device import resolve_device
from layerskip_core.settings import RunSettings, resolve_compile

BEGIN, END = "<!-- gpu_check:begin -->", "<!-- gpu_check:end -->"
RESULT_FILE = "gpu_check.json"
"""The result, rewritten after every part and every shape."""
TINY_MODELS = (("llama", 0), ("qwen2", 1))
"""The tiny seeded models of the exactness part: (kind, seed)."""
SWIFT_TREES = {"context_window": 4, "tree": True, "adaptive": False, "remember": "off"}
"""SWIFT settings that verify token trees from the first cycles (no fallback gate, nothing remembered)."""
SAMPLING = SamplingConfig(temperature=0.8, top_p=0.95, seed=0)
"""The seeded sampled generation each drafter must complete."""
FULL_BUDGET_S = 400.0
"""Default wall budget of a full (GPU) run: no part, shape or peer starts after it, and no ``hf_static`` peer (the one
transformers compiles) starts within ``COMPILE_RESERVE_S`` of it. Estimated on an H200 (not yet measured): parts 1-3
and our decoding at the three shapes about 2.5 minutes, the dynamic-cache and assistant peers about 30 s, each
static-cache compile 30-90 s; a piece started just before the budget can overrun it by its own length (a 7B compile:
about 90 s), so the command line's ``timeout`` is set 2 minutes above it (docs/GPU.md)."""
COMPILE_RESERVE_S = 90.0
"""Seconds of budget an ``hf_static`` peer (a torch.compile) needs left to start."""


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
        """A 4-layer stand-in with the same name and tying, small enough for a CPU in seconds."""
        return Shape(self.name, 4, 64, 4, 2 if self.kv_heads < self.heads else 4, 128, 320, self.tied, self.rope_theta)


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

    @classmethod
    def for_run(cls, tiny: bool, budget_s: float | None = None) -> Settings:
        if tiny:
            return cls(True, 8, 8, 1, (1, 2, 4, 8), (2, 3, 4, 8), (9,), budget_s or 0.0)
        return cls(False, 32, 64, 3, tuple(range(1, 33)), tuple(range(2, 33)), (5, 9, 14),
                   FULL_BUDGET_S if budget_s is None else budget_s)


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
    """Skipped pieces and other remarks, in order (also printed under the table)."""

    @property
    def executor(self) -> str:
        """The executor the check decodes with: CUDA graphs on CUDA, their uncaptured static forwards elsewhere."""
        return "graphs" if self.device.type == "cuda" else "static"

    @property
    def compile(self) -> bool:
        """Whether the static forwards compile (``layerskip_core.settings``' default: on CUDA)."""
        return resolve_compile(None, self.device)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def over_budget(self, reserve: float = 0.0) -> bool:
        """Whether fewer than ``reserve`` seconds of the wall budget are left."""
        return lease.Budget(self.settings.budget_s, self.started).over(reserve)


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


def tiny_runner(kind: str, seed: int, device: torch.device, dtype: torch.dtype, executor: str) -> Runner:
    return Runner.from_model(tiny_model(kind, seed, device=device), dtype=dtype, executor=executor,
                             compile=resolve_compile(None, device))


def note_fallback(run: Run, runner: Runner, where: str) -> None:
    """Note a runner that left the check's executor (a CUDA graph capture failed: it decodes eagerly since)."""
    if runner.executor != run.executor:
        run.notes.append(f"{where}: the runner fell back from {run.executor} to {runner.executor} (a CUDA graph "
                         "capture failed; see the warning on stderr)")


# --------------------------------------------------------------------------- 1. exactness
def parity(device: torch.device) -> dict[str, float]:
    """Max |runner logits - transformers logits| over a 16-token prompt, per tiny model and dtype."""
    out = {}
    for kind, seed in TINY_MODELS:
        for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            model = tiny_model(kind, seed, device=device).to(dtype)
            runner = Runner.from_model(model, dtype=dtype)
            ids = torch.tensor(prompt_ids(320, 16, seed), device=device)  # (T,)
            with torch.no_grad():
                ref = model(ids[None]).logits[0].float()  # (T, V)
                ours = runner.forward(runner.new_cache(32), ids).float()  # (T, V)
            out[f"{kind}/{name}"] = float((ref - ours).abs().max())
            del model, runner
    return out


def spreads(run: Run) -> dict[str, dict]:
    """The one-row vs many-row spread of the tiny models on the device: fp32 and bf16, check executor and eager."""
    out = {}
    s = run.settings
    for kind, seed in TINY_MODELS:
        for dtype in (torch.float32, torch.bfloat16):
            for executor in (run.executor, "eager"):
                runner = tiny_runner(kind, seed, run.device, dtype, executor)
                prompts = spread_prompts(runner.spec.vocab_size, s.spread_prompt_lengths, seed)
                found = measure_spread(runner, prompts, s.spread_sizes)
                found["per_size"] = {str(T): v for T, v in found["per_size"].items()}
                out[f"{kind}/{found['dtype']}/{executor}"] = found
                if executor == run.executor:
                    note_fallback(run, runner, f"spread ({kind}, {found['dtype']})")
    return out


def drafter_specs(runner: Runner, folder: Path) -> dict[str, dict]:
    """Every drafter with settings that make it draft on a 4-layer model (self_sd gets a small plan file, swift
    verifies token trees)."""
    L = runner.num_layers
    plan = folder / f"plan-{runner.fingerprint[:8]}.json"
    PlanFile(LayerPlan(L, skip_attn=frozenset({L - 2}), skip_mlp=frozenset({L - 1})), runner.identity(),
             source="gpu_check").save(plan)
    return {
        "early_exit": {"exit_layer": L // 2, "num_draft": 3},
        "self_sd": {"plan": str(plan), "num_draft": 4},
        "swift": dict(SWIFT_TREES),
    }


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


def greedy_identity(run: Run, new_tokens: int) -> dict:
    """Every drafter's fp32 greedy output vs autoregressive on the device, each mismatch classified with the drafter's
    own verification argmax and the rounding of the one-row path against an fp32 full-sequence recomputation
    (``infer.measure.exactness``; recorded per model)."""
    detail: dict[str, dict] = {}
    totals = {"mismatches": 0, "tie_flips": 0, "failures": 0, "runs": 0}
    gen = DecodeConfig(max_new_tokens=new_tokens, stop_at_eos=False)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        for kind, seed in TINY_MODELS:
            runner = tiny_runner(kind, seed, run.device, torch.float32, run.executor)
            rounding = measure_rounding(runner, prompts=spread_prompts(320, run.settings.spread_prompt_lengths, seed))
            judge = DivergenceJudge(runner, gen, rounding["max_abs"])
            prompts = [prompt_ids(320, n, seed + n) for n in (5, 9, 14)]
            plain = Engine(runner, build_drafter("autoregressive", runner))
            refs = [plain.generate(p, gen).tokens for p in prompts]
            for name, options in drafter_specs(runner, Path(tmp)).items():
                try:
                    engine = Engine(runner, build_drafter(name, runner, options))
                except ImportError as e:
                    run.notes.append(f"greedy identity: {name} skipped ({e.name or e} not installed)")
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
                failures = len(wrong) - flips if run.device.type == "cuda" else len(wrong)
                detail[f"{kind}/{name}"] = {"rounding": rounding["max_abs"], "runs": len(prompts),
                                            "mismatches": len(wrong), "tie_flips": flips, "failures": failures,
                                            "divergences": wrong, **counts}
                totals = {"mismatches": totals["mismatches"] + len(wrong), "tie_flips": totals["tie_flips"] + flips,
                          "failures": totals["failures"] + failures, "runs": totals["runs"] + len(prompts)}
            note_fallback(run, runner, f"greedy identity ({kind})")
            del runner
            free(run.device)
    return {"greedy_fp32_mismatches": totals["mismatches"], "greedy_fp32_tie_flips": totals["tie_flips"],
            "greedy_fp32_failures": totals["failures"], "greedy_runs": totals["runs"], "greedy_detail": detail,
            "swift_trees": sum(d["trees"] for k, d in detail.items() if k.endswith("/swift")),
            "swift_compactions": sum(d["compactions"] for k, d in detail.items() if k.endswith("/swift"))}


def sampled(run: Run, new_tokens: int) -> dict[str, dict]:
    """One seeded sampled generation per drafter on the tiny Llama (fp32, the check's executor): it must complete
    with ``new_tokens`` tokens (no exactness claim: a drafter's sampled output is equal in distribution only)."""
    runner = tiny_runner("llama", 0, run.device, torch.float32, run.executor)
    gen = DecodeConfig(max_new_tokens=new_tokens, stop_at_eos=False, sampling=SAMPLING)
    out = {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        specs = {"autoregressive": {}} | drafter_specs(runner, Path(tmp))
        for name, options in specs.items():
            try:
                engine = Engine(runner, build_drafter(name, runner, options))
                tokens, counts = decode_counting(engine, prompt_ids(320, 9, 3), gen)
                engine.close()
                out[name] = {"tokens": len(tokens), "ok": len(tokens) == new_tokens, **counts}
            except Exception as e:  # recorded, and fails the run
                out[name] = {"ok": False, "error": error_text(e)}
    note_fallback(run, runner, "sampling")
    return out


# --------------------------------------------------------------------------- 2. syncs
SYNC_TARGETS = {
    "early_exit": ("per_cycle <= 1", lambda s: s["per_cycle"] <= 1.0),
    "self_sd": ("per_cycle <= draft_steps_per_cycle + 2", lambda s: s["per_cycle"] <= s["draft_steps_per_cycle"] + 2),
    "swift": ("per_cycle <= draft_steps_per_cycle + 2", lambda s: s["per_cycle"] <= s["draft_steps_per_cycle"] + 2),
}
"""Host syncs each drafter is held to (reported in the result; they do not fail the run)."""


def syncs(run: Run, new_tokens: int) -> dict:
    """Host syncs per cycle of every drafter, greedy, on the tiny Llama in fp32 on the check's executor (after a
    warm-up, so nothing is built while counting), and the targets."""
    runner = tiny_runner("llama", 0, run.device, torch.float32, run.executor)
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
                                   ("self_sd", "self_sd", specs["self_sd"]), ("swift", "swift", specs["swift"])):
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


# --------------------------------------------------------------------------- 3. shapes
DRAFT_VOCAB = 8192
"""Token ids of the reduced-vocabulary draft head whose c(E) is measured beside the full head's."""


def forward_costs(runner: Runner, settings: Settings, device: torch.device, tally: GraphTally) -> dict:
    """ms of a one-token full forward, v(T) for T in ``verify_sizes``, c(E) at E = L/4, L/2, 3L/4 with the full LM
    head and with a ``DRAFT_VOCAB``-token draft head (``c_vocab``; random ids: speed does not depend on which), in
    a pooled cache (the capacity the decoding below uses, so its static forwards and graphs serve both)."""
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
        kernels = lease.kernel_profile(span(1, L), device)  # after the timings: on the forward they captured
        one = torch.tensor([10], device=device)  # (1,)
        eager = lease.kernel_profile(lambda: runner.forward(runner.new_cache(P + 2), one), device)  # the eager path
    finally:
        runner.release_cache(cache)
    per_layer = None if kernels["kernels_per_forward"] is None else kernels["kernels_per_forward"] / L
    kernels["kernels_per_forward_eager"] = eager["kernels_per_forward"]
    kernels["attention_kernels_eager"] = eager["attention_kernels"]
    return {"ms_forward": 1000 * full[1], "v": {str(T): t / full[1] for T, t in full.items()},
            "c": {str(E): t / full[1] for E, t in draft.items()},
            "c_vocab": {str(E): t / full[1] for E, t in small.items()}, "draft_vocab": head.size,
            **kernels, "kernels_per_layer": per_layer}


def ours(runner: Runner, prompt: list[int], settings: Settings, tally: GraphTally) -> dict:
    """Our autoregressive and early-exit (E = L/4, k = 4) tokens/s, median of repeats after ``Engine.warm_up``
    (which builds every static forward and captures every CUDA graph the timed runs use)."""
    gen = DecodeConfig(max_new_tokens=settings.new_tokens, stop_at_eos=False)
    E = max(1, runner.num_layers // 4)
    out = {}
    for key, name, options in (("ours_ar", "autoregressive", {}),
                               ("ours_early_exit", "early_exit", {"exit_layer": E, "num_draft": 4})):
        engine = Engine(runner, build_drafter(name, runner, options))
        before = graph_counts(runner)
        engine.warm_up([prompt], gen)
        warm = graph_counts(runner)
        results = [engine.generate(prompt, gen) for _ in range(settings.repeats)]
        tally.add(before, warm, graph_counts(runner))
        out[f"{key}_tok_s"] = statistics.median(r.stats.tokens_per_second for r in results)
        if name == "early_exit":
            out |= step_times(engine, prompt, gen)
            s = results[-1].stats
            out["ours_early_exit_acceptance"] = s.acceptance_rate
            out["early_exit_E"] = E
    return out


def step_times(engine: Engine, prompt: list[int], gen: DecodeConfig) -> dict:
    """ms per draft forward and per verification of one more generation, from CUDA events on CUDA
    (``infer.measure.timing``; the engine's own split is taken without a device sync) and perf_counter elsewhere."""
    s = timed_generate(engine, prompt, gen)[0].stats
    forwards = s.drafter.draft_forwards or max(1, s.drafted)
    return {"ours_early_exit_draft_ms": 1000 * s.draft_time / forwards,
            "ours_early_exit_verify_ms": 1000 * s.verify_time / max(1, s.verify_calls),
            "step_timer": "cuda events" if engine.runner.device.type == "cuda" else "perf_counter"}


def peer_variants(exit_layer: int) -> dict[str, dict]:
    """transformers' generate variants (result key -> generation kwargs), in the order they run: the static cache
    last, since on CUDA transformers compiles the model for it, the slowest thing the check does."""
    return {"hf_dynamic_tok_s": {},
            "hf_early_exit_tok_s": {"assistant_early_exit": exit_layer, "num_assistant_tokens": 4},
            "hf_static_tok_s": {"cache_implementation": "static"}}


def peers(model, prompt: list[int], run: Run) -> dict:
    """transformers generate on the same model object: dynamic cache, early-exit assistant, static cache. Each
    variant on its own (one that fails, or runs out of memory, is a note); the static cache (compiled by transformers
    on CUDA) not started once over the time budget."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # generate() warns about its assistant's and the static cache's kwargs
    settings, device = run.settings, run.device
    x = torch.tensor([prompt], device=device)  # (1, P)
    mask = torch.ones_like(x)
    model.generation_config.eos_token_id = None  # random weights: run to max_new_tokens like ours
    out = {}
    for key, kwargs in peer_variants(max(1, model.config.num_hidden_layers // 4)).items():
        reserve = COMPILE_RESERVE_S if kwargs.get("cache_implementation") == "static" else 0.0
        if run.over_budget(reserve):
            run.notes.append(f"{model.config.num_hidden_layers}-layer shape: {key} skipped (under {reserve:.0f} s "
                             f"left of the {settings.budget_s:.0f} s budget at {run.elapsed():.0f} s)")
            continue
        gen = GenerationConfig(max_new_tokens=settings.new_tokens, min_new_tokens=settings.new_tokens,
                               do_sample=False, eos_token_id=None, pad_token_id=0, **kwargs)

        def call(gen=gen):
            with torch.no_grad():
                return model.generate(x, attention_mask=mask, generation_config=gen)[0].tolist()
        try:
            for _ in range(2 if kwargs.get("cache_implementation") else 1):  # warm-up: the full prompt and length
                call()
            compiles = lease.compile_count()
            seconds = timed(call, device, settings.repeats, warmup=0)
            out[key] = settings.new_tokens / seconds
            out[key.replace("_tok_s", "_compiles_in_timed")] = lease.compile_count() - compiles
        except Exception as e:  # a peer that transformers cannot run here (or out of memory) must not hide the others
            run.notes.append(f"{model.config.num_hidden_layers}-layer shape: {key} failed ({error_text(e)})")
        free(device)
    return out


def peak_gb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None


def measure_shape(shape: Shape, run: Run) -> dict:
    """One shape: our forward costs and decoding with the transformers model moved off the device (``peak_gb_ours``
    is ours alone), then the peers on the same model moved back (``peak_gb_peers``)."""
    settings, device = run.settings, run.device
    if settings.tiny:
        shape = shape.tiny()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_model(shape.config(), device, dtype)
    runner = Runner.from_model(model, dtype=dtype, executor=run.executor, compile=run.compile)
    model.to("cpu")  # our peak memory without the peer's weights
    free(device)
    reset_peak(device)
    prompt = prompt_ids(shape.vocab, settings.prompt_len, 1)
    result = {"layers": shape.layers, "dtype": str(dtype).removeprefix("torch."), "executor": runner.executor}
    tally = GraphTally()
    result |= forward_costs(runner, settings, device, tally)
    result |= ours(runner, prompt, settings, tally)
    note_fallback(run, runner, shape.name)
    result["executor_after"] = runner.executor
    result["static"] = asdict(tally)
    result |= {f"{key}_in_timed": n for key, n in tally.timed.items()}  # builds, captures, compiles
    if runner.dtype != torch.bfloat16:  # the CPU's shapes run in fp32: the spread is measured in bf16 either way
        runner = Runner.from_model(model, dtype=torch.bfloat16, device=device, executor=run.executor,
                                   compile=run.compile)
    prompts = spread_prompts(shape.vocab, settings.spread_prompt_lengths)
    result["spread_bf16"] = measure_spread(runner, prompts, settings.spread_sizes)["max_abs"]
    result["peak_gb_ours"] = peak_gb(device)
    del runner
    free(device)
    model.to(device)
    reset_peak(device)
    result |= peers(model, prompt, run)
    result["peak_gb_peers"] = peak_gb(device)
    del model
    free(device)
    return result


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


# --------------------------------------------------------------------------- 4. training
def runner_decode(model_dir: Path, device: torch.device, dtype: torch.dtype, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens from a trained checkpoint through our runner (eager: this checks the checkpoint,
    not the CUDA-graph capture, which part 1 covers)."""
    runner = Runner.from_pretrained(model_dir, dtype=dtype, device=device, executor="eager")
    cache = runner.new_cache(len(prompt) + n + 1)
    tokens = [int(runner.forward(cache, torch.tensor(prompt, device=runner.device))[-1].argmax())]
    while len(tokens) < n:
        tokens.append(int(runner.forward(cache, torch.tensor(tokens[-1:], device=runner.device))[-1].argmax()))
    return tokens


def training(run: Run, tokenizer_dir: str | None, out: Path) -> dict:
    try:
        from train_bench import train_check, update_training_doc
    except ImportError as e:
        run.notes.append(f"training part skipped: {e}")
        return {}
    result = train_check(str(run.device), tiny=run.settings.tiny, tokenizer_dir=tokenizer_dir, decode=runner_decode)
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
    out = [f"{ex['greedy_fp32_failures']} fp32 greedy mismatch(es)"] if ex.get("greedy_fp32_failures") else []
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
    if "parity_max_abs" in ex:
        lines.append(f"Exactness: runner vs transformers logits max |diff| {ex['parity_max_abs']:.2e} (fp32).")
    if "greedy_runs" in ex:
        lines.append(f"Greedy fp32 output of the drafters vs autoregressive: {ex['greedy_fp32_mismatches']} "
                     f"mismatch(es) in {ex['greedy_runs']} runs, {ex['greedy_fp32_tie_flips']} tie flip(s), "
                     f"{ex['greedy_fp32_failures']} failure(s); SWIFT verified {ex['swift_trees']} token trees "
                     f"({ex['swift_compactions']} compacted paths).")
    sampling = ex.get("sampling", {})
    if sampling:
        done = [n for n, s in sampling.items() if s.get("ok")]
        lines.append(f"Sampled generations completed: {len(done)} of {len(sampling)} ({', '.join(done) or 'none'}).")
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


def shape_lines(shapes: dict) -> list[str]:
    lines = ["", "| shape | ms/forward | v(2) | v(8) | v(32) | c(L/4) | c(L/4), 8K draft vocab | ours AR tok/s | "
             "ours early exit tok/s | HF dynamic | HF static | HF early exit | AR / HF static |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    notes = []
    for name, s in shapes.items():
        if "error" in s:
            lines.append(f"| {name} | failed: {s['error']} |" + " |" * 11)
            continue
        c = s["c"][min(s["c"], key=int)]
        c_vocab = s.get("c_vocab", {}).get(min(s["c"], key=int))
        ratio = s["ours_ar_tok_s"] / s["hf_static_tok_s"] if s.get("hf_static_tok_s") else None
        lines.append(f"| {name} | {s['ms_forward']:.2f} | {_num(s['v'], '2', '.2f')} | {_num(s['v'], '8', '.2f')} | "
                     f"{_num(s['v'], '32', '.2f')} | {c:.2f} | {'–' if c_vocab is None else f'{c_vocab:.2f}'} | "
                     f"{_num(s, 'ours_ar_tok_s')} | "
                     f"{_num(s, 'ours_early_exit_tok_s')} | {_num(s, 'hf_dynamic_tok_s')} | "
                     f"{_num(s, 'hf_static_tok_s')} | {_num(s, 'hf_early_exit_tok_s')} | "
                     f"{'–' if ratio is None else f'{ratio:.2f}x'} |")
        if s.get("captures_in_timed") or s.get("builds_in_timed") or s.get("compiles_in_timed"):
            notes.append(f"{name}: the timed runs captured {s['captures_in_timed']} CUDA graph(s), built "
                         f"{s['builds_in_timed']} static forward(s) and compiled {s.get('compiles_in_timed', 0)} "
                         "time(s) (should be 0: warm-up missed a shape)")
    return lines + [f"\nNote: {n}" for n in notes]


def markdown(result: dict) -> str:
    """The GPU.md block: machine, versions, commit, command, exactness, syncs, then one row per shape."""
    lines = [f"Device: {result['device']}; torch {result['torch']}, transformers {result['transformers']}; "
             f"commit {result['commit']}; {result['date']}{' (tiny shapes)' if result['tiny'] else ''}; "
             f"{result.get('seconds', 0):.0f} s.", "", f"```\n{result['command']}\n```", ""]
    if "exact" in result:
        lines += exact_lines(result["exact"], result.get("settings", {}).get("spread_sizes", []))
    lines += sync_lines(result)
    lines += shape_lines(result.get("shapes", {}))
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
def part(name: str, fn: Callable[[], dict], result: dict, save: Callable[[dict], None], run: Run,
         into: str | None = None) -> None:
    """Run one part: its numbers merge into ``result`` (or its ``into`` section; an exception is recorded under
    ``errors``), its seconds into ``part_seconds``, and the result is saved so far."""
    if run.over_budget():
        run.notes.append(f"part {name} skipped: the {run.settings.budget_s:.0f} s budget was spent "
                         f"({run.elapsed():.0f} s)")
        save(result)
        return
    t0 = time.perf_counter()
    try:
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
    result.setdefault("part_seconds", {})[name] = time.perf_counter() - t0
    result["seconds"] = run.elapsed()
    save(result)


def parity_part(run: Run) -> dict:
    par = parity(run.device)
    return {"parity_max_abs": max(v for k, v in par.items() if k.endswith("fp32")), "parity": par,
            "tf32": torch.backends.cuda.matmul.allow_tf32, "spread": spreads(run)}


def shapes_part(run: Run, names: list[str] | None, result: dict, save: Callable[[dict], None]) -> dict:
    """Every shape in turn, ``result`` saved after each (a timeout in the 7B compile keeps the smaller shapes); a
    shape is not started once the budget is spent."""
    shapes = result.setdefault("shapes", {})
    for shape in SHAPES:
        if names and shape.name not in names:
            continue
        if run.over_budget():
            run.notes.append(f"shape {shape.name} skipped: the {run.settings.budget_s:.0f} s budget was spent")
            continue
        try:
            shapes[shape.name] = measure_shape(shape, run)
        except Exception as e:  # out of memory, ...: the next shape still runs
            shapes[shape.name] = {"error": error_text(e)}
        free(run.device)
        result["seconds"] = run.elapsed()
        save(result)
    return {"shapes": shapes}


def check(args: argparse.Namespace, save: Callable[[dict], None]) -> dict:
    device = resolve_device(args.device)
    tiny = args.tiny or device.type == "cpu"
    if device.type == "cpu":
        torch.set_num_threads(1)  # tiny ops gain nothing from threads, and on a busy machine their spin-waits stall
    run = Run(device, Settings.for_run(tiny, args.budget_s))
    settings = run.settings
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "transformers": transformers.__version__, "commit": lease.commit(),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "command": "python scripts/gpu_check.py " + " ".join(shlex.quote(a) for a in args.argv),
              "tiny": tiny, "executor": run.executor, "threads": torch.get_num_threads(),
              "settings": asdict(settings) | {"verify_sizes": list(settings.verify_sizes),
                                              "spread_sizes": list(settings.spread_sizes),
                                              "spread_prompt_lengths": list(settings.spread_prompt_lengths)},
              "complete": False, "notes": run.notes}
    new_tokens = settings.new_tokens * (2 if tiny else 1)
    if importlib.util.find_spec("optuna") is None:
        run.notes.append("optuna not installed: swift's Bayesian step is random search")
    part("parity", lambda: parity_part(run), result, save, run, into="exact")
    part("greedy", lambda: greedy_identity(run, new_tokens), result, save, run, into="exact")
    part("sampling", lambda: {"sampling": sampled(run, new_tokens)}, result, save, run, into="exact")
    part("syncs", lambda: syncs(run, 32 if tiny else 64), result, save, run)
    if not args.skip_train:  # before the shapes: it decides the exit code, their peers only inform
        part("train", lambda: training(run, args.tokenizer_dir, args.out), result, save, run)
    part("shapes", lambda: shapes_part(run, args.shapes, result, save), result, save, run)
    result["complete"] = True
    result["failures"] = failures(result)
    return result


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
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    p.add_argument("--budget-s", type=float, default=None, metavar="SECONDS",
                   help="wall budget: no part, shape or peer starts after it, no hf_static peer (a torch.compile) "
                   f"within {COMPILE_RESERVE_S:.0f} s of it (default: {FULL_BUDGET_S:.0f} on a GPU, none with tiny "
                   "shapes; 0 = none)")
    args = p.parse_args(argv)
    args.argv = argv
    return run_main("gpu_check", lambda: run_check(args))


if __name__ == "__main__":
    sys.exit(main())
