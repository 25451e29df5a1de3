"""Prompt prefill, once, for 1..N prompts: each prompt's cache filled, its last position's logits, and the streams its
drafter asked for (``Needs.prompt_layers``), per prompt exactly what prefilling that prompt alone gives.

``Engine.start`` prefills its one prompt here; ``BatchEngine`` prefills together the prompts that take free slots in
the same round (the batch's first rows, and rows joining when others finish). The engine turns the logits into the
first token (``infer.decode.engine``); this module only runs the target over prompts.

**The packing rule** (``packs``). Prompts share one packed forward (``infer.model.loop``: the norms, projections and
MLPs run once over all N = sum P_r prompt positions; the attention runs per prompt over its own cache, causal from slot
0, so no position sees another prompt's keys) only where each prompt's result provably does not depend on the others:

- fp32 on a CPU whose small-matmul kernel (``infer.kernels``) runs its AVX-512 path, with every projection of the
  model and its LM head on the kernel: each output element is one dot product with one vector accumulator, the
  k-chunks added in order, whatever the number of rows and however they are split over threads (docs/KERNELS.md);
  the row norm is per row. Prefill then takes the kernel for one prompt too (the same route alone and packed), at
  MKL's rate at prefill sizes on that path (docs/BATCHING.md);
- one intra-op thread: the elementwise ops with approximations (SiLU, GELU's tanh) then run each row in the same
  positions of their vector loops (one inner loop per row of the strided gate view); several threads may cut a row
  at a place that depends on N;
- the attention of a prompt is the same call alone and packed (its own q/k/v rows, its cache, ``is_causal``, its
  sliding-window mask), the embedding and RoPE tables are gathers, the residuals and RoPE exact elementwise products
  and sums; a family's final logit softcap (a tanh over the (R, V) logits, one flat vector loop) needs V a multiple
  of 64, so every row starts at the same place of that loop.

Everywhere else (CUDA, bf16, the AVX2 kernel path, a projection off the kernel, more than one thread) every prompt runs
alone in its own forward (``BULK``: ``F.linear``, or the AVX-512 kernel's panels where a matrix has them, except bf16
on an AMX CPU, ``infer.model.weights.Linear.bulk_on_torch``), as before: cuBLAS and MKL choose their blocking by the
number of rows (MKL's fp32 rows measured bitwise row-invariant only from 4 rows on here, which nothing promises), and
the AVX2 kernel runs prefill-sized matmuls at about 0.65x MKL's rate. Prompts of a different target depth run in
different forwards, and one packed forward holds at most ``PACK_ROWS`` positions (a longer prompt runs in a forward of
its own).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

from torch import Tensor

from infer.drafters.base import DecodeState, Drafter, cut_layers
from infer.model.loop import packs
from infer.model.program import BULK, ONCE, Program, Rows, Segment
from infer.model.runner import Runner

PACK_ROWS = 4096
"""Most prompt positions in one packed forward (bounds its (N, 2 I) MLP activations)."""


@dataclass
class Prompt:
    """One prompt to prefill: its state (``tokens[:prompt_len]`` the prompt, an empty cache, the target's depth) and
    what its drafter keeps of it."""

    state: DecodeState
    layers: tuple[int, ...] = ()
    """Layers strictly inside the target at whose input the stream of the last ``rows`` positions is kept."""
    rows: int = 0
    """How many of the prompt's last positions are kept there and after the last layer (0: nothing kept)."""

    @classmethod
    def of(cls, state: DecodeState, drafter: Drafter) -> Prompt:
        """``state``'s prompt with what ``drafter`` asks of it (``Drafter.needs``: prompt layers and rows)."""
        needs = drafter.needs()
        layers = cut_layers(needs.prompt_layers, state.depth) if needs.prompt_rows > 0 else ()
        return cls(state, layers, needs.prompt_rows) if layers else cls(state)

    @property
    def size(self) -> int:
        return self.state.prompt_len


def prefill(runner: Runner, prompts: Sequence[Prompt]) -> list[Tensor]:
    """Prefill every prompt: its cache then holds the prompt in the target's layers, ``state.n`` is its length and
    ``state.prompt_observed`` what its drafter keeps (None: nothing). Returns each prompt's (1, V) fp32 logits at its
    last position, in order."""
    out: list[Tensor | None] = [None] * len(prompts)
    packed = packs(runner)
    for group in groups(prompts, packed):
        logits = forward(runner, [prompts[j] for j in group], bulk=not packed)  # (R, V)
        for r, j in enumerate(group):
            out[j] = logits[r:r + 1]  # (1, V)
    return out


def groups(prompts: Sequence[Prompt], packed: bool) -> list[list[int]]:
    """Indices of the prompts that share a forward, in order: one prompt each unless ``packed``; else consecutive
    prompts of the same depth up to ``PACK_ROWS`` positions."""
    if not packed:
        return [[j] for j in range(len(prompts))]
    out: list[list[int]] = []
    rows = 0
    for j, p in enumerate(prompts):
        same = out and prompts[out[-1][0]].state.depth == p.state.depth
        if same and rows + p.size <= PACK_ROWS:
            out[-1].append(j)
            rows += p.size
        else:
            out.append([j])
            rows = p.size
    return out


def forward(runner: Runner, prompts: Sequence[Prompt], bulk: bool) -> Tensor:
    """One forward over the prompts' positions (packed rows; one prompt when ``bulk``, on ``F.linear``), observed at
    the layers any of them keeps (the same layers on the same rows: the output is unchanged); returns the (R, V)
    logits of each prompt's last position."""
    depth = prompts[0].state.depth
    ends = list(accumulate(p.size for p in prompts))  # R host ints: each prompt's end row
    ids = runner.to_device([t for p in prompts for t in p.state.tokens[:p.size]])  # (N,)
    hidden = runner.embed(ids)  # (N, d)
    if bulk:  # one prompt
        rows = Rows.one(prompts[0].state.cache, hidden, runner.to_device(list(range(prompts[0].size))), kind=BULK)
    else:  # each prompt causal over its own cache from slot 0, from position 0
        rows = Rows(hidden, [Segment(p.state.cache, list(range(p.size))) for p in prompts], ONCE)
    observe = tuple(sorted({cut for p in prompts for cut in p.layers}))
    out = runner.run(Program(0, depth, observe=observe), rows)
    for p, end in zip(prompts, ends, strict=True):
        p.state.prompt_observed = None
        if p.layers:  # the kept streams of its last ``rows`` positions, at its layers and after the last one
            kept = slice(max(end - p.size, end - p.rows), end)
            streams = [(x, out.observed[x]) for x in sorted(p.layers)] + [(depth, out.hidden)]
            p.state.prompt_observed = {x: h[kept].clone() for x, h in streams}  # (m, d) each
        p.state.n = p.size
    return runner.logits(out.hidden.index_select(0, runner.to_device([end - 1 for end in ends])))  # (R, V)
