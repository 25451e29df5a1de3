"""One command, one run on a GPU machine: exactness, forward costs, decoding speed against `transformers`, training.

    python scripts/gpu_check.py                                   # a GPU machine: the full run (< 5 min, one H200)
    python scripts/gpu_check.py --device cpu --out /tmp/gpu-check # tiny shapes, a few tokens, seconds (CI)

Parts, in order (each writes its numbers into the result; a missing optional package skips only
its part, with a note):

1. exact: logits of our runner vs `transformers` on two tiny seeded models (Llama, Qwen2) in fp32
   and bf16 (``parity_max_abs`` is the fp32 maximum); greedy output of every drafter vs
   ``autoregressive`` on the device in fp32, where it must be identical.
2. shapes: random-init SmolLM2-135M, Llama-3.2-1B-like and Llama-2-7B-like models in bf16
   (``--tiny``: 4-layer stand-ins of each): ms per full one-token forward; v(T) = cost of
   verifying T tokens / one token, T = 1..32; c(E) = cost of a draft step through layers [0, E) +
   norm + head / one full forward, E = L/4, L/2, 3L/4; our autoregressive and ``early_exit``
   (E = L/4, k = 4) tokens/s with the early exit's draft and verify step times; the peers
   ``hf_generate`` (dynamic cache), ``hf_static`` (static cache; compiled by transformers on CUDA)
   and ``hf_early_exit`` (transformers' assistant at E = L/4).
3. train: ``train.gpu_bench.train_check`` (training step speed/memory and an end-to-end
   train -> save -> decode check) when that module imports.

It writes ``OUT/gpu/latest.json`` and the table between ``<!-- gpu_check:begin -->`` and
``<!-- gpu_check:end -->`` in ``OUT/GPU.md`` (``OUT`` = docs/ by default), and the training table
into ``OUT/TRAINING.md``. Only torch, transformers, accelerate, peft, tokenizers, safetensors, numpy,
pyyaml and tqdm are needed.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers
from transformers import GenerationConfig, LlamaConfig

from core.cli import check_output_dir, run_main
from core.device import resolve_device
from core.seeded_models import random_model, tiny_model
from infer.bench import git_commit
from infer.drafters import build_drafter
from infer.engine import Engine
from infer.engine import GenerationConfig as OurGenerationConfig
from infer.exactness import classify_divergence
from infer.plan import LayerPlan, PlanFile
from infer.runner import Runner

BEGIN, END = "<!-- gpu_check:begin -->", "<!-- gpu_check:end -->"
REPO = Path(__file__).resolve().parent.parent


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
    prompt_len: int
    new_tokens: int
    repeats: int
    verify_sizes: tuple[int, ...]

    @classmethod
    def for_run(cls, tiny: bool) -> Settings:
        if tiny:
            return cls(True, 8, 8, 1, (1, 2, 4, 8))
        return cls(False, 32, 64, 3, tuple(range(1, 33)))


# --------------------------------------------------------------------------- helpers
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 2) -> float:
    """Median seconds of ``fn`` (after ``warmup`` calls, so CUDA graphs are captured before timing)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def prompt_ids(vocab: int, length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=g).tolist()


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- 1. exactness
def parity(device: torch.device) -> dict[str, float]:
    """Max |runner logits - transformers logits| over a 16-token prompt, per tiny model and dtype."""
    out = {}
    for kind, seed in (("llama", 0), ("qwen2", 1)):
        for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            model = tiny_model(kind, seed, device=device).to(dtype)
            runner = Runner.from_model(model, dtype)
            ids = torch.tensor(prompt_ids(320, 16, seed), device=device)  # (T,)
            with torch.no_grad():
                ref = model(ids[None]).logits[0].float()  # (T, V)
                ours = runner.forward(runner.new_cache(32), ids).float()  # (T, V)
            out[f"{kind}/{name}"] = float((ref - ours).abs().max())
            del model, runner
    return out


def drafter_specs(runner: Runner, folder: Path) -> dict[str, dict]:
    """Every drafter with settings that make it draft on a 4-layer model (self_sd gets a small plan file)."""
    L = runner.num_layers
    plan = folder / f"plan-{runner.fingerprint[:8]}.json"
    PlanFile(LayerPlan(L, skip_attn=frozenset({L - 2}), skip_mlp=frozenset({L - 1})), runner.identity(),
             source="gpu_check").save(plan)
    return {
        "early_exit": {"exit_layer": L // 2, "num_draft": 3},
        "self_sd": {"plan": str(plan), "num_draft": 4},
        "swift": {"context_window": 4},
    }


def greedy_identity(device: torch.device, new_tokens: int, notes: list[str]) -> tuple[int, int, dict]:
    """(mismatches, runs, per-drafter detail): every drafter's fp32 greedy output vs autoregressive."""
    mismatches = runs = 0
    detail: dict[str, dict] = {}
    gen = OurGenerationConfig(max_new_tokens=new_tokens, stop_at_eos=False)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        for kind, seed in (("llama", 0), ("qwen2", 1)):
            runner = Runner.from_model(tiny_model(kind, seed, device=device), torch.float32)
            prompts = [prompt_ids(320, n, seed + n) for n in (5, 9, 14)]
            plain = Engine(runner, build_drafter("autoregressive", runner))
            refs = [plain.generate(p, gen).tokens for p in prompts]
            for name, options in drafter_specs(runner, Path(tmp)).items():
                try:
                    engine = Engine(runner, build_drafter(name, runner, options))
                except ImportError as e:  # e.g. swift's optimiser needs optuna
                    notes.append(f"greedy identity: {name} skipped ({e.name or e} not installed)")
                    continue
                outs = [engine.generate(p, gen).tokens for p in prompts]
                wrong = [asdict(classify_divergence(runner, p, ref, out))
                         for p, ref, out in zip(prompts, refs, outs, strict=True) if out != ref]
                detail[f"{kind}/{name}"] = {"runs": len(prompts), "mismatches": len(wrong), "divergences": wrong}
                mismatches += len(wrong)
                runs += len(prompts)
    return mismatches, runs, detail


# --------------------------------------------------------------------------- 2. shapes
def forward_costs(runner: Runner, settings: Settings, device: torch.device) -> dict:
    """ms of a one-token full forward, v(T) for T in ``verify_sizes``, c(E) at E = L/4, L/2, 3L/4."""
    L, P = runner.num_layers, settings.prompt_len
    cache = runner.new_cache(P + max(settings.verify_sizes) + 8)
    context = torch.tensor(prompt_ids(runner.spec.vocab_size, P, 0), device=device)  # (P,)
    runner.forward(cache, context)
    repeats = 3 if settings.tiny else 10

    def span(T: int, end: int) -> Callable[[], object]:
        ids = torch.arange(10, 10 + T, device=device)  # (T,)

        def step():
            cache.rollback(P)
            return runner.span(cache, runner.embed(ids), list(range(P, P + T)), 0, end, logits=True)
        return step

    full = {T: timed(span(T, L), device, repeats) for T in settings.verify_sizes}
    exits = sorted({max(1, round(L * f)) for f in (0.25, 0.5, 0.75)})
    draft = {E: timed(span(1, E), device, repeats) for E in exits}
    return {"ms_forward": 1000 * full[1], "v": {str(T): t / full[1] for T, t in full.items()},
            "c": {str(E): t / full[1] for E, t in draft.items()}}


def ours(runner: Runner, prompt: list[int], settings: Settings) -> dict:
    """Our autoregressive and early-exit (E = L/4, k = 4) tokens/s, median of repeats after a warm-up."""
    gen = OurGenerationConfig(max_new_tokens=settings.new_tokens, stop_at_eos=False)
    E = max(1, runner.num_layers // 4)
    out = {}
    for key, name, options in (("ours_ar", "autoregressive", {}),
                               ("ours_early_exit", "early_exit", {"exit_layer": E, "num_draft": 4})):
        engine = Engine(runner, build_drafter(name, runner, options))
        engine.generate(prompt, gen)  # warm-up: kernels chosen, graphs captured
        results = [engine.generate(prompt, gen) for _ in range(settings.repeats)]
        out[f"{key}_tok_s"] = statistics.median(r.stats.tokens_per_second for r in results)
        if name == "early_exit":
            s = results[-1].stats
            forwards = int(s.drafter.get("draft_forwards", 0)) or max(1, s.drafted)
            out["ours_early_exit_draft_ms"] = 1000 * s.draft_time / forwards
            out["ours_early_exit_verify_ms"] = 1000 * s.verify_time / max(1, s.verify_calls)
            out["ours_early_exit_acceptance"] = s.acceptance_rate
            out["early_exit_E"] = E
    return out


def peers(model, prompt: list[int], settings: Settings, device: torch.device) -> dict:
    """transformers generate on the same model object: dynamic cache, static cache, early-exit assistant."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # generate() warns about its assistant's and the static cache's kwargs
    x = torch.tensor([prompt], device=device)  # (1, P)
    mask = torch.ones_like(x)
    model.generation_config.eos_token_id = None  # random weights: run to max_new_tokens like ours
    E = max(1, model.config.num_hidden_layers // 4)
    variants = {"hf_dynamic_tok_s": {}, "hf_static_tok_s": {"cache_implementation": "static"},
                "hf_early_exit_tok_s": {"assistant_early_exit": E, "num_assistant_tokens": 4}}
    out = {}
    for key, kwargs in variants.items():
        gen = GenerationConfig(max_new_tokens=settings.new_tokens, min_new_tokens=settings.new_tokens,
                               do_sample=False, eos_token_id=None, pad_token_id=0, **kwargs)

        def call(gen=gen):
            with torch.no_grad():
                return model.generate(x, attention_mask=mask, generation_config=gen)[0].tolist()
        seconds = timed(call, device, settings.repeats, warmup=2 if kwargs.get("cache_implementation") else 1)
        out[key] = settings.new_tokens / seconds
    return out


def measure_shape(shape: Shape, settings: Settings, device: torch.device, notes: list[str]) -> dict:
    if settings.tiny:
        shape = shape.tiny()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_model(shape.config(), device, dtype)
    runner = Runner.from_model(model, dtype)
    prompt = prompt_ids(shape.vocab, settings.prompt_len, 1)
    result = {"layers": shape.layers, "dtype": str(dtype).removeprefix("torch."), "executor": runner.executor}
    result |= forward_costs(runner, settings, device)
    result |= ours(runner, prompt, settings)
    del runner
    free(device)
    try:
        result |= peers(model, prompt, settings, device)
    except Exception as e:  # a peer that transformers cannot run here must not hide our numbers
        notes.append(f"{shape.name}: transformers peers failed ({type(e).__name__}: {e})")
    del model
    free(device)
    return result


# --------------------------------------------------------------------------- 3. training
def runner_decode(model_dir: Path, device: torch.device, dtype: torch.dtype, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens from a trained checkpoint through our runner (eager: this checks the checkpoint,
    not the CUDA-graph capture, which part 1 covers)."""
    runner = Runner.from_pretrained(model_dir, dtype=dtype, device=device, executor="eager")
    cache = runner.new_cache(len(prompt) + n + 1)
    tokens = [int(runner.forward(cache, torch.tensor(prompt, device=runner.device))[-1].argmax())]
    while len(tokens) < n:
        tokens.append(int(runner.forward(cache, torch.tensor(tokens[-1:], device=runner.device))[-1].argmax()))
    return tokens


def training(device: torch.device, tiny: bool, tokenizer_dir: str | None, out: Path, notes: list[str]) -> dict:
    try:
        from train.gpu_bench import train_check, update_training_doc
    except ImportError as e:
        notes.append(f"training part skipped: {e}")
        return {}
    result = train_check(str(device), tiny=tiny, tokenizer_dir=tokenizer_dir, decode=runner_decode)
    doc = out / "TRAINING.md"
    if not doc.exists():
        doc.write_text("<!-- gpu_check:train:begin -->\n<!-- gpu_check:train:end -->\n")
    try:
        update_training_doc(result, str(doc))
    except ValueError as e:
        notes.append(f"training table not written: {e}")
    return result


# --------------------------------------------------------------------------- report
def markdown(result: dict) -> str:
    """The GPU.md block: machine, versions, commit, command, then one row per shape."""
    ex = result["exact"]
    lines = [f"Device: {result['device']}; torch {result['torch']}, transformers {result['transformers']}; "
             f"commit {result['commit']}; {result['date']}{' (tiny shapes)' if result['tiny'] else ''}.",
             "", f"```\n{result['command']}\n```", "",
             f"Exactness: runner vs transformers logits max |diff| {ex['parity_max_abs']:.2e} (fp32); greedy "
             f"fp32 mismatches of the drafters vs autoregressive: {ex['greedy_fp32_mismatches']} of "
             f"{ex['greedy_runs']} runs.", "",
             "| shape | ms/forward | v(2) | v(8) | v(32) | c(L/4) | ours AR tok/s | ours early exit tok/s | "
             "HF dynamic | HF static | HF early exit | AR / HF static |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def num(d: dict, key: str, spec: str = ".0f") -> str:
        return "–" if d.get(key) is None else format(d[key], spec)

    for name, s in result["shapes"].items():
        if "error" in s:
            lines.append(f"| {name} | failed: {s['error']} |" + " |" * 10)
            continue
        c = s["c"][min(s["c"], key=int)]
        ratio = s["ours_ar_tok_s"] / s["hf_static_tok_s"] if s.get("hf_static_tok_s") else None
        lines.append(f"| {name} | {s['ms_forward']:.2f} | {num(s['v'], '2', '.2f')} | {num(s['v'], '8', '.2f')} | "
                     f"{num(s['v'], '32', '.2f')} | {c:.2f} | {num(s, 'ours_ar_tok_s')} | "
                     f"{num(s, 'ours_early_exit_tok_s')} | {num(s, 'hf_dynamic_tok_s')} | "
                     f"{num(s, 'hf_static_tok_s')} | {num(s, 'hf_early_exit_tok_s')} | "
                     f"{'–' if ratio is None else f'{ratio:.2f}x'} |")
    for note in result["notes"]:
        lines.append(f"\nNote: {note}")
    return "\n".join(lines)


def update_doc(path: Path, block: str) -> None:
    """Replace the text between the markers (appending them to a page that lacks them)."""
    text = path.read_text(encoding="utf-8") if path.is_file() else "# GPU results\n"
    new = f"{BEGIN}\n{block}\n{END}"
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    text = pattern.sub(lambda _: new, text, count=1) if pattern.search(text) else text.rstrip() + f"\n\n{new}\n"
    path.write_text(text, encoding="utf-8")


def check(args: argparse.Namespace) -> dict:
    device = resolve_device(args.device)
    tiny = args.tiny or device.type == "cpu"
    settings = Settings.for_run(tiny)
    notes: list[str] = []
    t0 = time.perf_counter()
    par = parity(device)
    mismatches, runs, detail = greedy_identity(device, settings.new_tokens * (2 if tiny else 1), notes)
    exact = {"parity_max_abs": max(v for k, v in par.items() if k.endswith("fp32")), "parity": par,
             "greedy_fp32_mismatches": mismatches, "greedy_runs": runs, "greedy_detail": detail}
    shapes = {}
    for shape in SHAPES:
        if args.shapes and shape.name not in args.shapes:
            continue
        try:
            shapes[shape.name] = measure_shape(shape, settings, device, notes)
        except torch.cuda.OutOfMemoryError as e:
            shapes[shape.name] = {"error": f"out of memory: {e}"}
            free(device)
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "transformers": transformers.__version__, "commit": git_commit() or "?",
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "command": "python scripts/gpu_check.py " + " ".join(shlex.quote(a) for a in args.argv),
              "tiny": tiny, "settings": vars(settings) | {"verify_sizes": list(settings.verify_sizes)},
              "exact": exact, "shapes": shapes, "notes": notes}
    if not args.skip_train:
        result |= training(device, tiny, args.tokenizer_dir, args.out, notes)
    result["seconds"] = time.perf_counter() - t0
    return result


def run(args: argparse.Namespace) -> int:
    check_output_dir(args.out, "--out")  # gpu/latest.json, GPU.md and TRAINING.md go there
    (args.out / "gpu").mkdir(parents=True, exist_ok=True)
    result = check(args)
    (args.out / "gpu" / "latest.json").write_text(json.dumps(result, indent=1) + "\n")
    block = markdown(result)
    update_doc(args.out / "GPU.md", block)
    print(block)
    print(f"wrote {args.out / 'gpu' / 'latest.json'} and {args.out / 'GPU.md'} in {result['seconds']:.0f}s",
          file=sys.stderr)
    mism = result["exact"]["greedy_fp32_mismatches"]
    return 1 if mism or (result.get("e2e_ok") is False) else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda or cuda:N")
    p.add_argument("--tiny", action="store_true", help="4-layer stand-ins and a few tokens (implied on a CPU)")
    p.add_argument("--out", type=Path, default=REPO / "docs", help="docs folder: writes gpu/latest.json, GPU.md and "
                   "the TRAINING.md table (default: the repository's docs/)")
    p.add_argument("--shapes", type=lambda s: [x.strip() for x in s.split(",") if x.strip()], default=None,
                   help=f"only these shapes (comma-separated): {', '.join(s.name for s in SHAPES)}")
    p.add_argument("--skip-train", action="store_true", help="skip the training part")
    p.add_argument("--tokenizer-dir", default=None, help="training end-to-end check: a model folder whose tokenizer "
                   "to use (default: the fetched default model when present)")
    args = p.parse_args(argv)
    args.argv = argv
    if args.tokenizer_dir is None:
        from core.models import default_model_dir, is_model_dir

        args.tokenizer_dir = str(default_model_dir()) if is_model_dir(default_model_dir()) else None
    return run_main("gpu_check", lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
