"""The GPU check's model shapes (random-init weights at real sizes, or 4-layer stand-ins on a CPU): our plain
decoding against transformers' generate, forward costs v(T) and c(E), kernels per forward, and every drafter's
per-cycle cost."""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig

from infer.decode.engine import DecodeConfig, Engine
from infer.drafters import build_drafter
from infer.measure.exactness import measure_spread, spread_prompts
from infer.measure.timing import timed_generate
from infer.model.program import Program, Rows
from infer.model.runner import Runner
from tools.gpu.counts import GraphTally, compile_count, graph_counts, kernels, timed
from tools.gpu.drafters import shape_drafters
from tools.gpu.exact import note_fallback, prompt_ids
from tools.gpu.run import Run, Settings, error_text, free
from tools.seeded_models import random_model

COMPILE_RESERVE_S = 60.0
"""Seconds of a part's budget an ``hf_static`` peer (a torch.compile by transformers) needs left to start."""


@dataclass(frozen=True)
class Shape:
    """A Llama-family model shape timed with random-init weights."""

    name: str
    """The name the results show (a real model's, or "stand-in for ..." for its tiny version)."""
    layers: int
    """Decoder layers L."""
    hidden: int
    """Hidden size d."""
    heads: int
    """Attention heads."""
    kv_heads: int
    """Key/value heads (grouped-query attention when fewer than ``heads``)."""
    intermediate: int
    """MLP intermediate size I."""
    vocab: int
    """Vocabulary size V."""
    tied: bool
    """Whether the LM head shares the embedding's weights."""
    rope_theta: float = 10000.0
    """RoPE base."""

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


DRAFT_VOCAB = 8192
"""Token ids of the reduced-vocabulary draft head whose c(E) is measured beside the full head's."""


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

        program = Program(0, end, logits=True, vocab=vocab)

        def step():
            cache.rollback(P)
            return runner.run(program, Rows.one(cache, runner.embed(ids), list(range(P, P + T))))
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
        compiles = compile_count()
        seconds = timed(call, device, settings.repeats, warmup=0)
        out = {key: settings.new_tokens / seconds, key.replace("_tok_s", "_compiles_in_timed"):
               compile_count() - compiles}
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
