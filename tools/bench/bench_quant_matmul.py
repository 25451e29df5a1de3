"""Weight-only int8 / int4 matmul routes against a read probe of the same bytes (issue 64 item 2), and the
teacher-forced agreement of the default model with its linears quantized (``--agreement``).

Speed: for each matrix shape of the default model (SmolLM2-135M: fused q/k/v 960x576, o 576x576, fused gate/up
3072x576, down 576x1536, the LM head 49152x576 and an 8192-row draft head), activation dtype and T rows, every route
multiplies T rows by enough copies of the quantized matrix to read ``--sweep-mb`` (a sweep; copies, so each call
reads its matrix from beyond the caches as a draft step does), just after a probe (``torch.sum`` over an fp32 buffer
of the same number of bytes: one sequential read, which also evicts the last sweep). A round runs every route of a
case, each after its own probe; the ratio of a round is probe time / sweep time for the scheme's bytes (codes and
scales as ``infer.kernels.quant`` stores them, the same for every route of a scheme, so a route that holds more bytes
shows it), and the table gives medians over rounds: microseconds a call and that ratio (1.0: the route streams the
quantized bytes as fast as the probe reads them). "inv": whether row t of the T-row product is bitwise the 1-row one.

Routes: ``kernel`` (ours: infer/kernels/quant.cpp), ``aten_int8`` (``torch.ops.aten._weight_int8pack_mm``),
``aten_int4`` (``_weight_int4pack_mm_for_cpu`` on ``_convert_weight_to_int4pack_for_cpu``, zero points 0: our
symmetric grid), ``aten_dyn4`` (``_dyn_quant_matmul_4bit`` on ``_dyn_quant_pack_4bit_weight``: activations
quantized per row to int8, fp32 only), ``torchao_int8`` (torchao's ``Int8WeightOnlyConfig`` on an ``nn.Linear``,
where ``import torchao`` works), and ``float`` (today's fp32 / bf16 weights on the panel kernel, for scale).

    python -m tools.bench.bench_quant_matmul --threads 1 --rounds 7
    python -m tools.bench.bench_quant_matmul --agreement --model default
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from infer.kernels import quant
from layerskip_core.cli import Parser, parse_and_run

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576),
          "head8k": (8192, 576)}
"""The default model's matrices (N, K): what a draft step multiplies."""
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclasses.dataclass
class Route:
    """One way to multiply T rows by a quantized matrix: ``call(x, weights)`` on one copy of ``weights``."""

    name: str
    weights: tuple
    call: Callable
    held: int
    """Bytes the route's own packing holds."""


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def aten_routes(w: torch.Tensor, qw: quant.QuantWeight, dtype: torch.dtype) -> list[Route]:
    """torch's weight-only CPU routes on ``w``'s codes and scales (the grid of ``qw``)."""
    N, K = w.shape
    codes, scales = quant.codes_and_scales(w, qw.scheme)  # (N, K) int8, (N, K / group)
    if qw.scheme.bits == 8:
        s = scales.reshape(N).to(dtype)
        return [Route("aten_int8", (codes, s), lambda x, a: torch.ops.aten._weight_int8pack_mm(x, a[0], a[1]),
                      codes.nbytes + s.nbytes)]
    g = qw.scheme.group
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu((codes.int() + 8).contiguous(), 1)  # (N, K / 2)
    sz = torch.stack([scales.float().T, torch.zeros(K // g, N)], -1).to(dtype).contiguous()  # (K / g, N, 2)
    mm = torch.ops.aten._weight_int4pack_mm_for_cpu
    routes = [Route("aten_int4", (packed, sz), lambda x, a: mm(x, a[0], g, a[1]), packed.nbytes + sz.nbytes)]
    if dtype == torch.float32:
        u = (codes.to(torch.int16) + 8).to(torch.uint8)  # (N, K) in 0..15
        nib = (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous()  # (N, K / 2)
        dyn = torch.ops.aten._dyn_quant_pack_4bit_weight(nib, scales.float().contiguous(), None, g, K, N)
        routes.append(Route("aten_dyn4", (dyn,), lambda x, a: torch.ops.aten._dyn_quant_matmul_4bit(x, a[0], g, K, N),
                            dyn.nbytes))
    return routes


def torchao_route(w: torch.Tensor, dtype: torch.dtype) -> list[Route]:
    """torchao's int8 weight-only linear, where torchao imports (its CPU int4 path is ``aten_int4``)."""
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError:
        return []
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=dtype)
    lin.weight.data.copy_(w)
    quantize_(lin, Int8WeightOnlyConfig())
    return [Route("torchao_int8", (lin,), lambda x, a: a[0](x), w.shape[0] * (w.shape[1] + 4))]


def float_route(w: torch.Tensor, dtype: torch.dtype) -> list[Route]:
    """The float matrix on today's panel kernel (F.linear where it is not built)."""
    from infer import kernels

    module, wd = kernels.load(), w.to(dtype)
    if module is not None and module.path() == "avx512" and kernels.supports(module, dtype):
        p = module.pack_panels(wd)
        return [Route("float", (p,), lambda x, a: module.panel_matmul(x, a[0], w.shape[0]), p.nbytes)]
    return [Route("float", (wd,), lambda x, a: F.linear(x, a[0]), wd.nbytes)]


def routes_for(w: torch.Tensor, scheme: str, dtype: torch.dtype, names: set[str]) -> tuple[int, list[Route]]:
    """The scheme's bytes and every route of ``names`` for ``w`` quantized by ``scheme`` in ``dtype``."""
    qw = quant.quantize(w, scheme, "rows")
    kern = quant.quantize(w, scheme)
    routes = [Route("kernel", (kern,), lambda x, a: quant.matmul(x, a[0]), kern.nbytes)]
    routes += aten_routes(w, qw, dtype)
    if scheme == "int8":
        routes += torchao_route(w, dtype)
    routes += float_route(w, dtype) if "float" in names else []
    return qw.nbytes, [r for r in routes if r.name in names]


def invariant(route: Route, x: torch.Tensor) -> bool:
    y = route.call(x, route.weights)
    return all(torch.equal(route.call(x[t:t + 1], route.weights)[0], y[t]) for t in range(x.shape[0]))


def measure_case(w: torch.Tensor, scheme: str, dtype: torch.dtype, sizes: list[int], args) -> list[dict]:
    """Every route of one (shape, scheme, dtype) over ``sizes``, rounds interleaved: rows for the table."""
    nbytes, routes = routes_for(w, scheme, dtype, set(args.routes))
    copies = max(1, int(args.sweep_mb * 2**20 // nbytes))
    probe = torch.ones(copies * nbytes // 4)
    sets = {r.name: [tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in r.weights) for _ in range(copies)]
            for r in routes}
    gen = torch.Generator().manual_seed(0)
    xs = {T: torch.randn(T, w.shape[1], generator=gen).to(dtype) for T in sizes}
    times = {(r.name, T): [] for r in routes for T in sizes}
    probes = {(r.name, T): [] for r in routes for T in sizes}
    for _ in range(args.rounds):
        for T in sizes:
            for r in routes:
                probes[r.name, T].append(_timed(probe.sum))
                times[r.name, T].append(_timed(lambda r=r, T=T: [r.call(xs[T], c) for c in sets[r.name]]))
    rows = []
    for r in routes:
        rows.append({"route": r.name, "held_mb": r.held / 2**20, "inv": invariant(r, xs[max(sizes)]),
                     "us": {T: min(times[r.name, T]) / copies * 1e6 for T in sizes},
                     "ratio": {T: min(probes[r.name, T]) / min(times[r.name, T]) for T in sizes},
                     "median": {T: statistics.median(p / t for p, t in zip(probes[r.name, T], times[r.name, T],
                                                                           strict=True)) for T in sizes}})
    return rows


def run_speed(args) -> None:
    sizes = args.sizes
    cells = " | ".join(f"T={T} us (ratio; median)" for T in sizes)
    print(f"| shape | scheme | x | route | MB held | inv | {cells} |")
    print("|---|---|---|---|---|---|" + "---|" * len(sizes))
    for shape in args.shapes:
        N, K = SHAPES[shape]
        w = torch.randn(N, K, generator=torch.Generator().manual_seed(N + K)) * 0.05
        for scheme in args.schemes:
            for dname in args.dtypes:
                for row in measure_case(w, scheme, DTYPES[dname], sizes, args):
                    cells = " | ".join(f"{row['us'][T]:.0f} ({row['ratio'][T]:.2f}; {row['median'][T]:.2f})"
                                       for T in sizes)
                    print(f"| {shape} {N}x{K} | {scheme} | {dname} | {row['route']} | {row['held_mb']:.2f} | "
                          f"{'yes' if row['inv'] else 'no'} | {cells} |", flush=True)


# --------------------------------------------------------------------------- teacher-forced agreement
def asymmetric(w: torch.Tensor, group: int) -> torch.Tensor:
    """``w`` (N, K) on an asymmetric int4 grid (scale and minimum per group of ``group`` k): the layout of the
    default model's source (Q4_1, groups of 32) and not one ``infer.kernels.quant`` offers; measured beside it."""
    N, K = w.shape
    b = w.float().reshape(N, K // group, group)
    low, high = b.amin(-1, keepdim=True), b.amax(-1, keepdim=True)
    scale = torch.where(high > low, (high - low) / 15, torch.ones_like(high))
    return (torch.round((b - low) / scale).clamp(0, 15) * scale + low).reshape(N, K)


def _scheme(scheme: quant.QuantScheme | None) -> Callable[[torch.Tensor], torch.Tensor]:
    if scheme is None:
        return lambda w: w
    return lambda w: quant.dequantize(quant.quantize(w, scheme, "rows"))


def grids() -> dict[str, tuple[Callable, Callable]]:
    """Weight grids to compare: name -> (the layers' grid, the LM head's grid), each fp32 matrix -> the matrix a
    draft would multiply (the weights only: activations stay fp32; ``ACTIVATIONS`` names the rows whose int4
    matrices also multiply int8 activations, as the kernel does)."""
    int8, int4 = quant.SCHEMES["int8"], quant.SCHEMES["int4"]
    g32 = quant.QuantScheme(4, 32, "bf16")
    return {
        "int8, head int8": (_scheme(int8), _scheme(int8)),
        "int4 (g64 bf16), head int4": (_scheme(int4), _scheme(int4)),
        "int4 g32 bf16, head int4": (_scheme(g32), _scheme(g32)),
        "int4 (g64 bf16) x int8 activations, head int4 x int8 activations": (_scheme(int4), _scheme(int4)),
        "int4 (g64 bf16) x int8 activations, head int8 (what int4 drafts run)": (_scheme(int4), _scheme(int8)),
        "int4 (g64 bf16), head int8": (_scheme(int4), _scheme(int8)),
        "int4 g32 bf16, head int8": (_scheme(g32), _scheme(int8)),
        "asym g64 (scale+min), head int8": (lambda w: asymmetric(w, 64), _scheme(int8)),
        "asym g32 (the source's grid), head int8": (lambda w: asymmetric(w, 32), _scheme(int8)),
        "asym g32 (the source's grid), head fp32": (lambda w: asymmetric(w, 32), _scheme(None)),
    }


ACTIVATIONS = {"int4 (g64 bf16) x int8 activations, head int4 x int8 activations": (64, 64),
               "int4 (g64 bf16) x int8 activations, head int8 (what int4 drafts run)": (64, 0)}
"""Rows whose int4 linears quantize their input per row and group to int8 (``quant.int4_activations``, the
kernel's arithmetic): name -> (the layers' group, the head's group; 0: activations kept fp32)."""


def _quantize_inputs(group: int):
    """A forward pre-hook putting a linear's input on the int4 kernel's int8 activation grid."""
    def hook(_module, args):
        x = args[0]
        return (quant.int4_activations(x.reshape(-1, x.shape[-1]), group).reshape(x.shape).to(x.dtype),)
    return hook


def _sequences(model, tok, n: int, new: int) -> list[tuple[torch.Tensor, int]]:
    """(prompt + the fp32 model's greedy continuation, prompt length) for ``n`` HumanEval and ``n`` GSM8K prompts."""
    from layerskip_core.prompts import load_prompts, use_chat_template

    seqs = []
    for task in ("humaneval", "gsm8k"):
        for item in load_prompts(task, n=n):
            text = item.prompt
            if use_chat_template(task):
                text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                               add_generation_prompt=True)
            ids = tok(text, return_tensors="pt").input_ids  # (1, P)
            out = model.generate(ids, max_new_tokens=new, do_sample=False)  # (1, P + new)
            seqs.append((out, ids.shape[1]))
    return seqs


def run_agreement(args) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from layerskip_core.models import resolve_model

    path = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        seqs = _sequences(model, tok, args.prompts, args.new_tokens)
        ref = [model(s).logits[0].argmax(-1) for s, _ in seqs]  # each (L,)
        linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        saved = {n: m.weight for n, m in linears}
        print(f"{len(seqs)} sequences, {len(linears)} linears (the tied head included)")
        print("| weights | agreement, continuation | agreement, all positions |\n|---|---|---|")
        for name, (layer_grid, head_grid) in grids().items():
            hooks = []
            for n, m in linears:
                grid = head_grid if n == "lm_head" else layer_grid
                m.weight = torch.nn.Parameter(grid(saved[n]), requires_grad=False)  # the head untied from embed
                if act := ACTIVATIONS.get(name, (0, 0))[n == "lm_head"]:
                    hooks.append(m.register_forward_pre_hook(_quantize_inputs(act)))
            same = cont = total = every = 0
            for (s, p), r in zip(seqs, ref, strict=True):
                got = model(s).logits[0].argmax(-1)  # (L,)
                same += int((got[p - 1:-1] == r[p - 1:-1]).sum())
                cont += got[p - 1:-1].numel()
                every += int((got[:-1] == r[:-1]).sum())
                total += got[:-1].numel()
            print(f"| {name} | {same / cont:.3f} ({cont}) | {every / total:.3f} ({total}) |", flush=True)
            for h in hooks:
                h.remove()
        for n, m in linears:
            m.weight = saved[n]


def _parser() -> argparse.ArgumentParser:
    p = Parser(description=__doc__.split("\n\n")[0], prog="bench_quant_matmul")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--sizes", type=lambda s: [int(v) for v in s.split(",")], default=[1, 2, 4, 8])
    p.add_argument("--shapes", type=lambda s: s.split(","), default=list(SHAPES))
    p.add_argument("--schemes", type=lambda s: s.split(","), default=["int8", "int4"])
    p.add_argument("--dtypes", type=lambda s: s.split(","), default=list(DTYPES))
    p.add_argument("--routes", type=lambda s: s.split(","),
                   default=["kernel", "aten_int8", "aten_int4", "aten_dyn4", "torchao_int8", "float"])
    p.add_argument("--sweep-mb", type=float, default=128.0, help="bytes a sweep reads (MiB)")
    p.add_argument("--agreement", action="store_true", help="teacher-forced top-1 agreement instead of speed")
    p.add_argument("--model", default="default")
    p.add_argument("--prompts", type=int, default=3, help="prompts per set (HumanEval, GSM8K)")
    p.add_argument("--new-tokens", type=int, default=64)
    return p


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    (run_agreement if args.agreement else run_speed)(args)
    return 0


def main(argv: list[str] | None = None) -> int:
    return parse_and_run(_parser(), argv, "bench_quant_matmul", run)


if __name__ == "__main__":
    sys.exit(main())
