"""torch's own matmul routes beside the small-matmul kernel, on one step's worth of the default model's matrices.

    python -m tools.bench.bench_matmul_routes --rounds 5 --out runs/matmul_routes.json
    python -m tools.bench.bench_matmul_routes --routes kernel,mkl_packed --dtypes fp32 --sizes 1,4

Every route multiplies T tokens by every weight matrix of the default model's step (30 layers x qkv, o, gate/up,
down, then the LM head: 134.5M weights) with random values of the model's shapes. Each round: a probe reads a
buffer as large as the weights (``torch.sum``), then the route runs once per T. Printed: T=1 ms, the T=1 time's
bandwidth ratio against the probe (median of rounds), v(T) = T tokens over one, and which ones meet issue 44's
targets (ratio >= 0.8 for the matmuls alone; v(4) <= 1.15, v(8) <= 1.40, v(16) <= 2.0).

Routes: ``kernel`` (``infer.kernels`` through the runner's ``Linear``: on AVX-512 the weights packed in panels, all
in ``infer.kernels.arena``), ``linear`` (``F.linear``: MKL/oneDNN),
``mkl_packed`` (``torch.ops.mkl._mkl_linear`` over weights packed once by ``_mkl_reorder_linear_weight``: what
inductor emits for fp32 linears on CPU; packed per T), ``mkldnn_packed`` (``torch.ops.mkldnn._linear_pointwise``
over ``_reorder_linear_weight``: inductor's bf16 route), ``compile`` (``torch.compile`` of a module of the same
linears with inductor's freezing; ``compile_autotune`` adds ``max-autotune``: the CPP GEMM template).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from infer import kernels
from infer.model.weights import Linear
from layerskip_core.cli import Parser, add_output_flags, check_output_file, parse_and_run, write_result
from layerskip_core.errors import UserError
from layerskip_core.settings import check_threads

D, FF, QKV, VOCAB, LAYERS = 576, 1536, 960, 49152, 30  # SmolLM2-135M
SHAPES = [(QKV, D), (D, D), (2 * FF, D), (D, FF)] * LAYERS + [(VOCAB, D)]
TARGETS = {4: 1.15, 8: 1.40, 16: 2.0}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def weights(dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(n, k, generator=gen) * k ** -0.5).to(dtype) for n, k in SHAPES]


def compiled(ws: list[torch.Tensor], autotune: bool, T: int) -> Callable:
    import torch._inductor.config as inductor

    inductor.freezing = True
    linears = torch.nn.ModuleList()
    for w in ws:
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
        lin.weight.data = w
        linears.append(lin)

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linears = linears

        def forward(self, x: torch.Tensor, h: torch.Tensor) -> list[torch.Tensor]:
            return [lin(x if lin.in_features == D else h) for lin in self.linears]

    step = torch.compile(Step().eval(), mode="max-autotune" if autotune else None, dynamic=False)
    with torch.no_grad():
        step(torch.zeros(T, D, dtype=ws[0].dtype), torch.zeros(T, FF, dtype=ws[0].dtype))  # compile now
    return lambda x, h: step(x, h)


def route(name: str, ws: list[torch.Tensor], T: int, linears: list[Linear]) -> Callable:
    """A function of (x (T, D), h (T, FF)) that multiplies by every matrix in ``ws`` with route ``name``
    (``kernel``: through ``linears``, the runner's ``Linear`` of each, as a runner holds them)."""
    def per_matrix(fn):
        return lambda x, h: [fn(x if w.shape[1] == D else h, w, i) for i, w in enumerate(ws)]

    if name == "kernel":
        return per_matrix(lambda a, w, i: linears[i](a))
    if name == "linear":
        return per_matrix(lambda a, w, i: F.linear(a, w))
    if name == "mkl_packed":
        if ws[0].dtype != torch.float32:
            raise UserError("mkl_packed: fp32 only (MKL's packed sgemm)")
        packed = [torch.ops.mkl._mkl_reorder_linear_weight(w, T) for w in ws]
        return per_matrix(lambda a, w, i: torch.ops.mkl._mkl_linear(a, packed[i], w, None, T))
    if name == "mkldnn_packed":
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, T) for w in ws]
        return per_matrix(lambda a, w, i: torch.ops.mkldnn._linear_pointwise(a, packed[i], None, "none", [], ""))
    if name in ("compile", "compile_autotune"):
        return compiled(ws, name == "compile_autotune", T)
    raise UserError(f"unknown route {name!r}")


def measure(name: str, dtype: torch.dtype, sizes: list[int], rounds: int, kernel) -> dict:
    ws = weights(dtype)
    nbytes = sum(w.numel() * w.element_size() for w in ws)
    # the kernel's route reads what a runner's matrices hold: packed panels (AVX-512) or the matrices, in the arena
    linears = [Linear(w, None, kernel) for w in ws] if name == "kernel" else []
    probe = torch.ones(nbytes // 4)
    fns = {T: route(name, ws, T, linears) for T in sizes}
    inputs = {T: (torch.randn(T, D).to(dtype), torch.randn(T, FF).to(dtype)) for T in sizes}
    times: dict[int, list[float]] = {T: [] for T in sizes}
    ratios = []
    with torch.no_grad():
        for T in sizes:
            fns[T](*inputs[T])  # warm up
        for _ in range(rounds):
            for T in sizes:
                t0 = time.perf_counter()
                probe.sum()
                t1 = time.perf_counter()
                fns[T](*inputs[T])
                t2 = time.perf_counter()
                times[T].append(t2 - t1)
                if T == 1:
                    ratios.append((t1 - t0) / (t2 - t1))
    base = statistics.median(times[1])
    return {"ms": {T: 1000 * statistics.median(v) for T, v in times.items()}, "ratio": statistics.median(ratios),
            "v": {T: statistics.median(v) / base for T, v in times.items()}, "weight_mb": nbytes / 1e6}


def _meets(r: dict) -> str:
    ok = [f"v({T})" for T, limit in TARGETS.items() if T in r["v"] and r["v"][T] <= limit]
    return ", ".join((["ratio"] if r["ratio"] >= 0.8 else []) + ok) or "-"


def run(args: argparse.Namespace) -> int:

    sizes = sorted({1, *(int(x) for x in args.sizes.split(","))})
    if args.out:
        check_output_file(args.out, "--out", force=args.force)
    torch.set_num_threads(check_threads(args.threads))
    kernel = kernels.load()
    results = []
    for dt in args.dtypes.split(","):
        for name in args.routes.split(","):
            unfit = name == "mkl_packed" and dt != "fp32"
            if unfit or (name == "kernel" and not kernels.supports(kernel, DTYPES[dt])):
                print(f"{dt} {name}: not for this dtype or CPU, skipped", file=sys.stderr)
                continue
            t0 = time.perf_counter()
            r = measure(name, DTYPES[dt], sizes, args.rounds, kernel)
            results.append({"route": name, "dtype": dt, "threads": args.threads, "setup_s": time.perf_counter() - t0}
                           | r)
            print(f"{dt} {name}: T=1 {r['ms'][1]:.1f} ms, ratio {r['ratio']:.2f}", flush=True)
    print("\n| dtype | route | T=1 ms | ratio | " + " | ".join(f"v({T})" for T in sizes[1:]) + " | meets |")
    print("|---|---|---|---|" + "---|" * len(sizes))
    for r in results:
        print(f"| {r['dtype']} | {r['route']} | {r['ms'][1]:.1f} | {r['ratio']:.2f} | "
              + " | ".join(f"{r['v'][T]:.2f}" for T in sizes[1:]) + f" | {_meets(r)} |")
    if args.out:
        write_result(args.out, {"argv": sys.argv[1:], "results": results})
    return 0


def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--routes", default="kernel,linear,mkl_packed,mkldnn_packed,compile,compile_autotune")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--sizes", default="1,2,4,8,16")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    add_output_flags(p, "JSON file for the measured numbers")
    return parse_and_run(p, argv, "bench_matmul_routes", run)


if __name__ == "__main__":
    sys.exit(main())
