"""Training speed and memory of LayerSkip on one device, and an end-to-end train -> save -> decode check.

    python -m tools.bench.train_bench --device cuda [--tokenizer-dir <model folder>] [--json out.json]
    python -m tools.bench.train_bench --device cpu --tiny            # seconds; what CI runs

:func:`train_check` times :class:`train.model.LayerSkipLM` steps driven directly (forward, backward,
AdamW on fp32 master weights, bf16 autocast on CUDA; random-init weights; median of 3 steps after a
warm-up step) at two shapes, SmolLM2-135M with 16 x 1024 tokens and a Llama-3.2-1B-like model with
4 x 1024, for these variants: plain (final loss only), layer dropout ``p_max`` 0.2 and 0.5 with the
``exp`` depth scale (per sample, and 0.2 also ``granularity: batch``), early exits at L/4, L/2, 3L/4
(``scale: linear``), dropout 0.2 + those exits, and the exits under a rotational curriculum (R=2).
Then it trains a random-init 135M-shape model for 12 steps with ``train/layerskip.py`` (bf16 on CUDA),
and loads the saved checkpoint with :class:`infer.model.runner.Runner` on the same device to decode a few
tokens. :func:`update_training_doc` writes the result table into docs/TRAINING.md.

The end-to-end run needs nothing from a model cache or the network: without ``--tokenizer-dir`` its
tokenizer is ``tools.seeded_models.byte_tokenizer`` (built in code) and its data the Python standard
library's source files. Importing this module needs only torch, transformers, tokenizers and the
standard library; the training loop and the runner are imported inside the functions that use them.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LlamaConfig

from layerskip_core.cli import Parser, write_result
from layerskip_core.device import resolve_device
from layerskip_core.errors import UserError
from tools.doc_sections import GPU_TRAINING, write_section
from tools.seeded_models import byte_tokenizer
from tools.seeded_models import random_model as seeded_random_model
from train.config import EarlyExitConfig, LayerDropoutConfig

NOT_RUN = "Not yet run on a GPU."
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}
"""Dense bf16 peak FLOP/s by GPU name fragment, for MFU (None for other devices)."""


@dataclass
class Shape:
    """A model shape and the micro-batch it is timed with."""

    name: str
    config: dict
    batch: int
    block: int


SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                    rope_theta=100000.0, tie_word_embeddings=True, rms_norm_eps=1e-5)
LLAMA_32_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                   num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                   rope_theta=500000.0, tie_word_embeddings=True, rms_norm_eps=1e-5)
TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)


def shapes(tiny: bool) -> list[Shape]:
    if tiny:
        return [Shape("tiny-4L 2x32", TINY, 2, 32)]
    return [Shape("SmolLM2-135M 16x1024", SMOLLM2_135M, 16, 1024),
            Shape("Llama-3.2-1B-like 4x1024", LLAMA_32_1B, 4, 1024)]


def variants(num_layers: int) -> dict[str, tuple[LayerDropoutConfig, EarlyExitConfig]]:
    """The timed configurations, keyed by the result field they produce (``plain`` is the reference)."""
    L = num_layers
    exits = sorted({max(1, L // 4), max(1, L // 2), max(1, 3 * L // 4)} - {L})
    ee = dict(exits=exits, scale="linear")
    return {
        "plain": (LayerDropoutConfig(), EarlyExitConfig()),
        "dropout": (LayerDropoutConfig(p_max=0.2, scale="exp"), EarlyExitConfig()),
        "dropout05": (LayerDropoutConfig(p_max=0.5, scale="exp"), EarlyExitConfig()),
        "dropout_batch": (LayerDropoutConfig(p_max=0.2, scale="exp", granularity="batch"), EarlyExitConfig()),
        "exits": (LayerDropoutConfig(), EarlyExitConfig(**ee)),
        "dropout_exits": (LayerDropoutConfig(p_max=0.2, scale="exp"), EarlyExitConfig(**ee)),
        "rotational": (LayerDropoutConfig(), EarlyExitConfig(**ee, curriculum="rotational", rotation=2)),
    }


def step_flops(config: dict, tokens: int, block: int) -> float:
    """Model FLOPs of one plain training step (forward + backward = 3x forward; causal attention halved)."""
    d, L, V, ff = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"], config["intermediate_size"]
    kv = d * config["num_key_value_heads"] // config["num_attention_heads"]
    per_layer = d * d * 2 + d * kv * 2 + 3 * d * ff  # q, o, k, v, gate/up/down weights
    matmul = 2 * tokens * (L * per_layer + V * d)  # forward multiply-adds of the weights and the LM head
    attention = 2 * tokens * L * block * d  # QK^T and PV, causal: half of 2 * 2 * T * d per token per layer
    return 3.0 * (matmul + attention)


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def random_model(config: dict, device: torch.device, seed: int = 0):
    """A random-init Llama with SDPA attention, fp32 weights (the master copy AdamW updates)."""
    return seeded_random_model(LlamaConfig(**config, attn_implementation="sdpa", use_cache=False), device,
                               torch.float32, seed).train()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_variant(model, dropout: LayerDropoutConfig, early_exit: EarlyExitConfig, ids: torch.Tensor,
                 optimizer, device: torch.device, repeats: int) -> tuple[float, float | None, float]:
    """(median seconds per step, peak GB or None, measured fraction of skipped layer rows)."""
    from train.model import LayerSkipLM  # lazy: importing this script loads no training model code

    lm = LayerSkipLM(model, dropout, early_exit, max_steps=1000, seed=0).train()
    bf16 = device.type == "cuda"
    times, skipped = [], 0.0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for rep in range(repeats + 1):  # rep 0 warms up (kernels, optimizer state)
        sync(device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            out = lm(ids, ids, step=500 + rep, micro=0)
        out["loss"].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        if rep:
            times.append(time.perf_counter() - t0)
            skipped += float(out["skipped"].sum()) / (ids.shape[0] * lm.num_layers * repeats)
    peak = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
    return statistics.median(times), peak, skipped


def bench_shape(shape: Shape, device: torch.device, repeats: int = 3) -> dict:
    """Tokens/s of every variant at one shape, as ratios to plain, plus peak memory and MFU."""
    model = random_model(shape.config, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape.config["vocab_size"], (shape.batch, shape.block), generator=gen).to(device)
    tokens = shape.batch * shape.block
    secs, peaks, skipped = {}, {}, {}
    for name, (dropout, early_exit) in variants(shape.config["num_hidden_layers"]).items():
        secs[name], peaks[name], skipped[name] = time_variant(model, dropout, early_exit, ids, optimizer, device,
                                                              repeats)
    plain = secs["plain"]
    out = {"plain_tok_s": tokens / plain}
    out.update({f"{name}_rel": plain / s for name, s in secs.items() if name != "plain"})
    out.update(plain_peak_gb=peaks["plain"], exits_peak_gb=peaks["exits"],
               dropout_exits_peak_gb=peaks["dropout_exits"],
               dropout_skipped=skipped["dropout"], dropout05_skipped=skipped["dropout05"],
               step_s={name: s for name, s in secs.items()})
    peak = peak_flops(device)
    out["mfu"] = step_flops(shape.config, tokens, shape.block) / plain / peak if peak else None
    del model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


# --------------------------------------------------------------------------------------------
# End to end: train/layerskip.py for 12 steps, then the runner decodes with the saved checkpoint
# --------------------------------------------------------------------------------------------


def make_random_checkpoint(folder: Path, config: dict, tokenizer_dir: str | None = None) -> Path:
    """A random-init model of ``config``'s shape with the tokenizer of ``tokenizer_dir`` (None: the byte-level
    tokenizer built in code), as a HF folder."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir) if tokenizer_dir else byte_tokenizer()
    cfg = dict(config, vocab_size=max(config["vocab_size"], len(tokenizer)))
    model = random_model(cfg, torch.device("cpu"))
    eos = tokenizer.eos_token_id
    model.config.bos_token_id, model.config.eos_token_id = tokenizer.bos_token_id, eos
    model.config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


Decode = Callable[[Path, torch.device, torch.dtype, list[int], int], list[int]]
"""``decode(model_dir, device, dtype, prompt_ids, n) -> n greedy token ids`` from a saved checkpoint."""


def hf_decode(model_dir: Path, device: torch.device, dtype: torch.dtype, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding with transformers (the default; tools/gpu/gpu_check.py passes the inference runner)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False)
    return out[0, len(prompt):].tolist()


def end_to_end(device: torch.device, tiny: bool, tokenizer_dir: str | None, workdir: Path,
               decode: Decode = hf_decode) -> dict:
    """Train 12 steps with train/layerskip.py, reload the final checkpoint with ``decode`` and decode 6 tokens
    (``tokenizer_dir`` None: the byte-level tokenizer, so no model cache or network is needed)."""
    from train.layerskip import main as train_main  # lazy: importing this script loads no training loop

    start = make_random_checkpoint(workdir / "init", TINY if tiny else SMOLLM2_135M, tokenizer_dir)
    block, micro = (32, 2) if tiny else (1024, 8)
    bf16 = device.type == "cuda"
    argv = [f"model.name_or_path={start}", "data.sources=[{type: stdlib, max_documents: 40}]",
            f"data.block_size={block}", "data.max_val_examples=4", f"data.cache_dir={workdir / 'tokens'}",
            "optim.max_steps=12", f"optim.micro_batch_size={micro}", "optim.grad_accum_steps=1", "optim.lr=3e-4",
            "optim.warmup_steps=2", f"optim.mixed_precision='{'bf16' if bf16 else 'no'}'",
            "layer_dropout.p_max=0.2", f"early_exit.exits=[{2 if tiny else 8},{3 if tiny else 16}]",
            "early_exit.scale=linear", "logging.log_every=4", "logging.eval_every=0", "logging.progress=false",
            f"checkpoint.output_dir={workdir / 'run'}", "checkpoint.save_every=0"]
    t0 = time.perf_counter()
    env_cpu = os.environ.get("ACCELERATE_USE_CPU")
    if device.type == "cpu":
        os.environ["ACCELERATE_USE_CPU"] = "true"  # train on the CPU even where a GPU exists
    try:
        rc = train_main(argv)
    finally:
        if env_cpu is None:
            os.environ.pop("ACCELERATE_USE_CPU", None)
        else:
            os.environ["ACCELERATE_USE_CPU"] = env_cpu
    result = {"rc": rc, "train_s": time.perf_counter() - t0}
    final = workdir / "run" / "final"
    if rc != 0 or not final.is_dir():
        return {**result, "ok": False, "error": f"training exited {rc}; final checkpoint: {final.is_dir()}"}
    tokens = decode(final, device, torch.bfloat16 if bf16 else torch.float32, [1, 2, 3, 4, 5], 6)
    metrics = Path(workdir / "run" / "metrics.jsonl")
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()
              if '"loss"' in line and '"split"' not in line] if metrics.exists() else []
    ok = bool(losses) and all(x == x and abs(x) < 1e4 for x in losses) and len(tokens) == 6
    return {**result, "ok": ok, "losses": losses, "decoded": tokens, "final_dir_files": sorted(os.listdir(final))}


# --------------------------------------------------------------------------------------------
# Public entry points (tools/gpu/gpu_check.py calls these two)
# --------------------------------------------------------------------------------------------


def train_check(device: str, tiny: bool = False, tokenizer_dir: str | None = None,
                decode: Decode = hf_decode) -> dict:
    """Training speed/memory table and the end-to-end check on ``device`` (``tiny``: CPU-sized shapes).

    Returns ``{"train": {NAME: {"plain_tok_s", "dropout_rel", "dropout05_rel", "dropout_batch_rel",
    "exits_rel", "dropout_exits_rel", "rotational_rel", "plain_peak_gb", "exits_peak_gb", "mfu", ...}},
    "e2e_ok": bool, "train_e2e": {...}, "train_meta": {...}}``; ratios are tokens/s relative to plain
    (above 1 = faster), peak memory is ``None`` off CUDA, ``mfu`` is ``None`` for unknown devices.
    """
    import transformers

    dev = torch.device(device)
    table = {shape.name: bench_shape(shape, dev) for shape in shapes(tiny)}
    with tempfile.TemporaryDirectory(prefix="layerskip-e2e-") as tmp:
        try:
            e2e = end_to_end(dev, tiny, tokenizer_dir, Path(tmp), decode)
        except Exception as exc:  # the table is still worth reporting; the failure is recorded
            e2e = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    meta = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type,
            "torch": torch.__version__, "transformers": transformers.__version__,
            "precision": "bf16 autocast, fp32 master weights" if dev.type == "cuda" else "fp32",
            "timing": "median of 3 steps after 1 warm-up step", "date": time.strftime("%Y-%m-%d", time.gmtime())}
    return {"train": table, "e2e_ok": bool(e2e.get("ok")), "train_e2e": e2e, "train_meta": meta}


def _x(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}x"


def _gb(v: float | None) -> str:
    return "–" if v is None else f"{v:.1f}"


def training_table(result: dict) -> str:
    """The Markdown block that goes between the markers (``NOT_RUN`` when there is no table)."""
    table = result.get("train") or {}
    if not table:
        return NOT_RUN
    meta = result.get("train_meta", {})
    lines = [f"Measured on {meta.get('device', '?')} ({meta.get('date', '?')}; torch {meta.get('torch', '?')}, "
             f"transformers {meta.get('transformers', '?')}; {meta.get('precision', '?')}; "
             f"{meta.get('timing', '?')}) by `train_bench.train_check`. Ratios are tokens/s relative to plain.",
             "",
             "| shape, batch | plain tok/s (MFU) | dropout 0.2 | dropout 0.5 | dropout 0.2, batch | 3 exits "
             "| dropout + exits | exits, rotational R=2 | peak GB plain → exits |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in table.items():
        mfu = f" ({100 * r['mfu']:.0f}%)" if r.get("mfu") else ""
        lines.append(f"| {name} | {r['plain_tok_s'] / 1e3:.1f}K{mfu} | {_x(r.get('dropout_rel'))} "
                     f"| {_x(r.get('dropout05_rel'))} | {_x(r.get('dropout_batch_rel'))} | {_x(r.get('exits_rel'))} "
                     f"| {_x(r.get('dropout_exits_rel'))} | {_x(r.get('rotational_rel'))} "
                     f"| {_gb(r.get('plain_peak_gb'))} → {_gb(r.get('exits_peak_gb'))} |")
    e2e = result.get("train_e2e", {})
    lines += ["", f"End to end (12 steps of `train/layerskip.py`, random-init 135M shape, then "
                  f"`infer.model.runner.Runner` decodes from the saved checkpoint): "
                  f"{'ok' if result.get('e2e_ok') else 'FAILED'}"
                  + (f" ({e2e['error']})" if e2e.get("error") else "") + "."]
    return "\n".join(lines)


def update_training_doc(result: dict, path: str) -> None:
    """Replace the text between the gpu_check:train markers of ``path`` with the table of ``result`` (a page
    without them is refused)."""
    write_section(Path(path), GPU_TRAINING, GPU_TRAINING.block(training_table(result)), append=False)


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU, seconds)")
    parser.add_argument("--tokenizer-dir", help="a model folder whose tokenizer the e2e run uses (default: a "
                        "byte-level tokenizer built in code)")
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--doc", help="also write the table into this Markdown file (e.g. docs/TRAINING.md)")
    args = parser.parse_args(argv)
    try:  # a device this machine lacks (or 'tpu') is one line, as every command says it, not a torch traceback
        args.device = str(resolve_device(args.device))
    except UserError as e:
        parser.error(str(e))
    result = train_check(args.device, args.tiny, args.tokenizer_dir)
    print(training_table(result))
    if args.json:
        write_result(Path(args.json), result)
    if args.doc:
        update_training_doc(result, args.doc)
    return 0 if result["e2e_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
