"""LayerSkip's two schedules: depth-scaled layer dropout rates, and early-exit loss weights/curricula.

Conventions (the same as the inference side's ``--exit-layer E``):
- decoder layers are 0-based, ``l`` in ``[0, L)``;
- an *exit* ``E`` in ``[1, L]`` is the number of layers run: the hidden state after layers ``[0, E)``,
  i.e. Hugging Face's ``hidden_states[E]`` for ``E < L``. ``E = L`` is the model's normal output.
  (HF's ``hidden_states[L]`` is already normed: never apply the final norm to it again.)
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from layerskip_core.errors import UserError
from layerskip_core.layers import check_exit_layer
from train.config import EarlyExitConfig, LayerDropoutConfig

# --------------------------------------------------------------------------------------------
# Layer dropout
# --------------------------------------------------------------------------------------------


def depth_scale(kind: str, num_layers: int) -> list[float]:
    """S(l) for l in [0, L): 0 at the first layer, 1 at the last (``uniform``: 1 everywhere)."""
    if num_layers == 1:
        return [1.0]
    if kind == "linear":
        return [i / (num_layers - 1) for i in range(num_layers)]
    if kind == "exp":
        return [2.0 ** (i / (num_layers - 1)) - 1.0 for i in range(num_layers)]
    return [1.0] * num_layers


def time_scale(kind: str, step: int, total: int) -> float:
    """D(t): the curriculum factor at optimiser step ``step`` of ``total``."""
    frac = min(1.0, step / max(1, total))
    if kind == "linear":
        return frac
    if kind == "exp":
        return 2.0**frac - 1.0
    return 1.0


def dropout_rates(cfg: LayerDropoutConfig, num_layers: int, step: int, max_steps: int) -> list[float]:
    """p(l, t) = p_max * S(l) * D(t) for every layer; 0 for layers not in ``cfg.layers``."""
    if cfg.layers is not None and any(i >= num_layers for i in cfg.layers):
        raise UserError(f"layer_dropout.layers {cfg.layers} out of range for a {num_layers}-layer model (0-based)")
    allowed = set(range(num_layers) if cfg.layers is None else cfg.layers)
    d = time_scale(cfg.curriculum, step, cfg.curriculum_steps or max_steps)
    s = depth_scale(cfg.scale, num_layers)
    return [cfg.p_max * s[i] * d if i in allowed else 0.0 for i in range(num_layers)]


def skip_generator(seed: int, step: int, micro: int) -> torch.Generator:
    """A CPU generator that depends only on (seed, step, micro-batch): every rank draws the same
    decisions (balanced step times across ranks), and a resumed run redraws exactly the same ones."""
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + step) * 1_009 + micro)
    return g


def sample_skips(rates: list[float], batch_size: int, generator: torch.Generator,
                 granularity: str = "sample") -> Tensor:
    """Skip decisions: ``skip[b, l]`` is True when layer l is skipped for row b. (B, L) bool, CPU.

    ``sample``: one draw per row and layer. ``batch``: one draw per layer, shared by every row.
    """
    p = torch.tensor(rates, dtype=torch.float64)  # (L,)
    rows = batch_size if granularity == "sample" else 1
    u = torch.rand((rows, len(rates)), generator=generator, dtype=torch.float64)  # (B or 1, L)
    return (u < p).expand(batch_size, -1).contiguous()  # (B, L)


# --------------------------------------------------------------------------------------------
# Early-exit loss
# --------------------------------------------------------------------------------------------


def check_exits(cfg: EarlyExitConfig, num_layers: int) -> list[int]:
    """The configured early exits, sorted, validated against the model depth."""
    for e in cfg.exits:  # the last layer is the model's own output, always trained
        check_exit_layer(e, num_layers, "early_exit.exits: exit layer", below_last=True)
    return sorted(cfg.exits)


def raw_exit_scale(cfg: EarlyExitConfig, exit_: int, num_layers: int) -> float:
    """e(E) before normalisation (see ``EarlyExitConfig.scale``)."""
    L = num_layers
    if exit_ == L:
        return {"uniform": 1.0, "linear": float(L), "sum": (L - 1) + cfg.e_scale * (L - 2) * (L - 1) / 2}[cfg.scale]
    base = {"uniform": 1.0, "linear": float(exit_), "sum": exit_ * (exit_ - 1) / 2}[cfg.scale]
    return cfg.e_scale * base


def enabled_exits(cfg: EarlyExitConfig, exits: list[int], step: int, max_steps: int) -> list[int]:
    """The early exits (sorted list from :func:`check_exits`) that get a loss at optimiser step ``step``."""
    if not exits or cfg.curriculum == "none":
        return list(exits)
    if cfg.curriculum == "rotational":
        r = cfg.rotation
        return [e for i, e in enumerate(exits) if i % r == step % r]
    # gradual: deepest first, exit j (1 = deepest) is on once step + 1 >= j * T / k, where T defaults
    # to max_steps / 2 (the paper's C_grad: all exits on by half of training)
    k, total = len(exits), cfg.curriculum_steps or max(1, max_steps // 2)
    n_on = min(k, math.floor((step + 1) * k / total))
    return exits[k - n_on:] if n_on else []


def exit_weights(cfg: EarlyExitConfig, exits: list[int], num_layers: int, step: int,
                 max_steps: int) -> dict[int, float]:
    """Normalised weights {E: w} of the exits enabled at ``step`` plus the final layer; they sum to 1."""
    on = enabled_exits(cfg, exits, step, max_steps) + [num_layers]
    raw = {e: raw_exit_scale(cfg, e, num_layers) for e in on}
    total = sum(raw.values())
    if total <= 0:  # e.g. scale=sum with a 1-layer model: fall back to the final loss alone
        return {num_layers: 1.0}
    return {e: w / total for e, w in raw.items() if w > 0}
