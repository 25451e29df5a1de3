"""The GPU check's exactness parts on tiny seeded models: runner vs transformers logits, the one-row vs many-row
spread, every drafter's fp32 greedy output against autoregressive (each mismatch judged), one sampled generation
per drafter, and host syncs per cycle."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from infer.decode.acceptance import TreeShape
from infer.decode.engine import DecodeConfig, Engine
from infer.drafters import build_drafter
from infer.measure.exactness import DivergenceJudge, decode_verified, measure_rounding, measure_spread, spread_prompts
from infer.model.runner import Runner
from infer.model.sampling import SamplingConfig
from layerskip_core.errors import UserError
from tools.gpu.drafters import drafter_specs, sync_specs, sync_target
from tools.gpu.run import Run, error_text, free
from tools.seeded_models import tiny_model
from tools.syncs import measure_decode

TINY_MODELS = (("llama", 0), ("qwen2", 1))
"""The tiny seeded models: (kind, seed); the first is the greedy part's, the second the rest's."""
SAMPLING = SamplingConfig(temperature=0.8, top_p=0.95, seed=0)
"""The seeded sampled generation each drafter must complete."""
AdapterFor = Callable[[Run, str, int, Path], "Path | None"]
"""(run, model kind, seed, folder) -> an exit adapter file for that tiny model, or None."""


def prompt_ids(vocab: int, length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=g).tolist()


def tiny_runner(run: Run, kind: str, seed: int, dtype: torch.dtype, executor: str) -> Runner:
    return Runner.from_model(tiny_model(kind, seed, device=run.device), dtype=dtype, executor=executor,
                             compile=run.compile if executor != "eager" else False)


def note_fallback(run: Run, runner: Runner, where: str, executor: str | None = None) -> None:
    """Note a runner that left its executor (default the check's; a CUDA graph capture failed: it decodes eagerly
    since)."""
    if runner.executor != (executor or run.executor):
        run.notes.append(f"{where}: the runner fell back from {run.executor} to {runner.executor} (a CUDA graph "
                         "capture failed; see the warning on stderr)")


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


def outcome_counts(outcomes: list) -> dict[str, int]:
    """Verifications of one generation: how many, how many verified a tree (not a chain), and how many accepted a
    path that is not a prefix of the draft (its KV rows were compacted)."""
    counts = {"verifications": len(outcomes), "trees": 0, "compactions": 0}
    for outcome in outcomes:
        parents = outcome.draft.parents if outcome.draft is not None else None
        counts["trees"] += parents is not None and not TreeShape(parents).is_chain
        counts["compactions"] += outcome.path != list(range(len(outcome.path)))
    return counts


def greedy_identity(run: Run, new_tokens: int, models=TINY_MODELS[:1], executors: tuple[str, ...] | None = None,
                    adapter_for: AdapterFor | None = None) -> dict:
    """Every drafter's fp32 greedy output vs autoregressive on the device, per tiny model and executor (default: the
    check's and eager), each mismatch classified with the drafter's own verification argmax and the rounding of the
    one-row path against an fp32 full-sequence recomputation (``infer.measure.exactness``; recorded per runner);
    early exit also through the tiny Llama's exit adapter from ``adapter_for``, where one is given."""
    detail: dict[str, dict] = {}
    gen = DecodeConfig(max_new_tokens=new_tokens, stop_at_eos=False)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        for kind, seed in models:
            adapter = adapter_for(run, kind, seed, Path(tmp)) if adapter_for and kind == "llama" else None
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
                tokens, _, outcomes = decode_verified(engine, prompt_ids(320, 9, 3), gen)
                engine.close()
                out[key] = {"tokens": len(tokens), "ok": len(tokens) == new_tokens, **outcome_counts(outcomes)}
            except Exception as e:  # recorded, and fails the run
                out[key] = {"ok": False, "error": error_text(e)}
    note_fallback(run, runner, "sampling")
    return out


def quant_case(run: Run, new_tokens: int) -> dict:
    """Quantized drafts (issue 64 item 9) where the check runs: on the CPU (the rehearsal) ``quant_self`` drafts and
    its greedy output equals plain decoding; elsewhere (CUDA: no weight-only route is wired to the runner) building
    it is refused with one line. ``ok`` False fails the run."""
    runner = tiny_runner(run, "llama", 0, torch.float32, run.executor)
    expected = "drafts" if runner.device.type == "cpu" else "refused"
    out = {"device": str(runner.device), "expected": expected}
    try:
        drafter = build_drafter("quant_self", runner, {"num_draft": 3})
    except UserError as e:
        return out | {"ok": expected == "refused" and "\n" not in str(e), "message": str(e)}
    gen, prompt = DecodeConfig(max_new_tokens=new_tokens, stop_at_eos=False), prompt_ids(320, 9, 5)
    plain = Engine(runner, build_drafter("autoregressive", runner)).generate(prompt, gen).tokens
    result = Engine(runner, drafter).generate(prompt, gen)
    same = result.tokens == plain
    return out | {"ok": expected == "drafts" and same, "message": "" if same else "greedy output differs from plain",
                  "drafted": result.stats.drafted}


def syncs(run: Run, new_tokens: int) -> dict:
    """Host syncs per cycle of every drafter, greedy, on the tiny Llama in fp32 on the check's executor (after a
    warm-up, so nothing is built while counting), and the targets."""
    runner = tiny_runner(run, "llama", 0, torch.float32, run.executor)
    gen = DecodeConfig(max_new_tokens=new_tokens, stop_at_eos=False)
    prompt = prompt_ids(320, 12, 7)
    out, targets = {}, {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        for key, (name, options) in sync_specs(runner, Path(tmp)).items():
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
            if sync_target(key) is not None:
                rule, check = sync_target(key)
                targets[key] = {"target": rule, "met": bool(check(out[key]))}
    note_fallback(run, runner, "syncs")
    return {"syncs": out, "sync_targets": targets}


@torch.no_grad()
def runner_decode(model_dir: Path, device: torch.device, dtype: torch.dtype, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens from a trained checkpoint through our runner (eager: this checks the checkpoint, not the
    CUDA-graph capture, which the greedy part covers)."""
    runner = Runner.from_pretrained(model_dir, dtype=dtype, device=device, executor="eager")
    cache = runner.new_cache(len(prompt) + n + 1)
    tokens = [int(runner.forward(cache, torch.tensor(prompt, device=runner.device))[-1].argmax())]
    while len(tokens) < n:
        tokens.append(int(runner.forward(cache, torch.tensor(tokens[-1:], device=runner.device))[-1].argmax()))
    return tokens
