"""The runner ``hf_generate`` decodes with, kept per model and following the model's weights.

A runner is built once per model and settings (dtype, device, executor, compile) and kept for as long as the model
lives (keyed weakly by the model object), so every ``hf_generate`` callable on that model uses it: one reused
callable, a new one written inline per ``generate`` call, and the folder form (which makes one per call) alike.
``release(model)`` drops it (a runner on the kernel's AVX-512 path holds a packed copy of every matrix).

A runner holds copies of the model's weights: on the kernel's AVX-512 path every matrix packed in panels, on every
path the norm weights, and what drafters derive from it (a copied prefix, a draft head's rows, an exit adapter's
layer over its head). So before every call the model's parameters are compared with a ``WeightStamp`` taken when the
runner was built, and every runner of a model whose weights changed is dropped and built again from the new ones
(drafters' copies with it). Where the runner keeps plain matrices in the model's dtype and on its device (the AVX2 and
torch paths), the model's q/k/v, gate/up, o and down parameters are then pointed at the runner's matrices again
(``share_weights``, ``infer.model.weights.share_unfused``): no weight is held twice, also after a rebuild.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from weakref import WeakKeyDictionary

import torch
from torch import Tensor
from transformers import PreTrainedModel

from infer.model.runner import Runner
from layerskip_core.errors import UserError

SAMPLES = 16
"""Values of each parameter a ``WeightStamp`` compares (evenly spaced over the parameter)."""

FUSED = {"self_attn.q_proj": ("qkv", 0), "self_attn.k_proj": ("qkv", 1), "self_attn.v_proj": ("qkv", 2),
         "mlp.gate_proj": ("gate_up", 0), "mlp.up_proj": ("gate_up", 1)}
"""Model projection -> (the runner's fused matrix, its index among the parts fused in it)."""


@dataclass(frozen=True)
class RunnerSettings:
    """What a kept runner is built with (one runner per model and settings)."""

    dtype: torch.dtype
    """The runner's weights' dtype (the model's unless ``hf_generate(dtype=...)``)."""
    device: torch.device
    """Where the runner decodes (the model's device unless ``hf_generate(device=...)``)."""
    executor: str
    """'eager', 'static' or 'graphs' (resolved from 'auto')."""
    compile: bool
    """The static forwards through torch.compile."""


def mark(p: Tensor) -> tuple:
    """What a parameter's in-place writes and replacements change: its version counter (every in-place write torch
    tracks: ``load_state_dict``, optimizer steps of the for-loop and foreach kinds, ``p.mul_()`` under no_grad), its
    storage (``p.data = ...``, ``model.to(...)``), shape, dtype and device."""
    return p._version, p.data_ptr(), p.shape, p.dtype, p.device


def sample(p: Tensor) -> Tensor | None:
    """A view of ``SAMPLES`` evenly spaced values of ``p`` (its storage, not a copy); None for an empty or
    non-contiguous parameter."""
    flat = p.detach()
    if flat.numel() == 0 or not flat.is_contiguous():
        return None
    flat = flat.view(-1)  # (n,)
    step = max(1, flat.numel() // SAMPLES)
    return flat[step // 2::step][:SAMPLES]  # (<= SAMPLES,)


@dataclass
class WeightStamp:
    """A model's parameters as a runner was built from them: each parameter object by name, its ``mark``, and a
    sample of its values (writes the version counter does not see: fused optimizers, writes through ``p.data``).
    Checking it costs ~0.7 ms for the default model's 272 parameters (1 thread, a loaded machine)."""

    params: list[tuple[str, Tensor]]
    """(name, parameter) in ``named_parameters`` order."""
    marks: list[tuple]
    """``mark`` of each parameter."""
    views: dict[torch.dtype, list[Tensor]] = field(default_factory=dict)
    """Per dtype: the ``sample`` views of the parameters of that dtype."""
    values: dict[torch.dtype, Tensor] = field(default_factory=dict)
    """Per dtype: the sampled values, concatenated, as bytes (``sampled_bits``)."""

    @classmethod
    def of(cls, model: PreTrainedModel) -> WeightStamp:
        params = list(model.named_parameters())
        stamp = cls(params, [mark(p) for _, p in params])
        for _, p in params:
            view = sample(p)
            if view is not None:
                stamp.views.setdefault(view.dtype, []).append(view)
        stamp.values = {dtype: sampled_bits(views) for dtype, views in stamp.views.items()}
        return stamp

    def holds(self, model: PreTrainedModel) -> bool:
        """Whether ``model``'s parameters are still the ones stamped, unchanged."""
        params = list(model.named_parameters())
        if len(params) != len(self.params):
            return False
        for (name, p), (name0, p0), marked in zip(params, self.params, self.marks, strict=True):
            if p is not p0 or name != name0 or mark(p) != marked:
                return False
        return all(torch.equal(sampled_bits(views), self.values[dtype]) for dtype, views in self.views.items())


def sampled_bits(views: list[Tensor]) -> Tensor:
    """The views' current values (one dtype), concatenated, as bytes: compared bit for bit, so a NaN equals itself
    and -0.0 differs from 0.0. (n * element size,) uint8."""
    return torch.cat(views).view(torch.uint8)


@dataclass
class Kept:
    """A model's runners (by settings) and the stamp of the weights they were built from."""

    stamp: WeightStamp | None = None
    runners: dict[RunnerSettings, Runner] = field(default_factory=dict)


class RunnerCache:
    """Runners by model (weakly: a model's runners go with it) and settings, checked against the weights on every
    ``get``."""

    def __init__(self):
        self.kept: WeakKeyDictionary = WeakKeyDictionary()  # model -> Kept
        self.lock = threading.Lock()

    def get(self, model: PreTrainedModel, settings: RunnerSettings) -> Runner:
        """The runner of ``model`` with ``settings``: the kept one while the weights are unchanged, else built (and
        its weights shared with the model) from the weights as they are now."""
        with self.lock:
            kept = self.kept.get(model)
            if kept is None or kept.stamp is None or not kept.stamp.holds(model):
                kept = self.kept[model] = Kept()  # every runner of the old weights goes
            runner = kept.runners.get(settings)
            if runner is None:
                runner = build(model, settings)
                kept.runners[settings] = runner
                kept.stamp = WeightStamp.of(model)  # after sharing: the parameters may point into the runner now
            return runner

    def release(self, model: PreTrainedModel) -> None:
        with self.lock:
            self.kept.pop(model, None)


RUNNERS = RunnerCache()
"""The process's kept runners (every ``hf_generate`` callable reads them: a per-callable cache would build a runner
per inline callable and per folder-form call)."""


def runner_for(model: PreTrainedModel, settings: RunnerSettings) -> Runner:
    """``model``'s runner with ``settings``, kept across calls and callables, rebuilt when the weights changed."""
    return RUNNERS.get(model, settings)


def release(model: PreTrainedModel) -> None:
    """Drop ``model``'s kept runners (their memory goes once no generation uses them); the next call builds anew.
    Also the way to make a change the check cannot see reach the runner: a write through ``p.data`` (or from
    outside torch) to a few values that the stamp does not sample."""
    RUNNERS.release(model)


def build(model: PreTrainedModel, settings: RunnerSettings) -> Runner:
    """A runner over ``model``'s weights as they are now, its matrices shared with the model where they can be."""
    runner = Runner.from_model(model, dtype=settings.dtype, device=settings.device, executor=settings.executor,
                               compile=settings.compile)
    share_weights(model, runner)
    return runner


def share_weights(model: PreTrainedModel, runner: Runner) -> int:
    """Point ``model``'s q/k/v and gate/up parameters at row slices of the runner's fused matrices, which hold the
    same values, so the separate copies are freed; returns the bytes no longer held twice. Parameters in another
    dtype or on another device than the runner's keep their own storage, and so do those of a matrix the kernel
    holds packed only (its AVX-512 path)."""
    freed = 0
    for i, layer in enumerate(runner.layers):
        prefix = layer_prefix(model, i)
        for fused_name in ("qkv", "gate_up"):
            fused = getattr(layer, fused_name)
            parts = [(n, model.get_submodule(prefix + n)) for n, (f, _) in FUSED.items() if f == fused_name]
            # plain: None where the kernel holds the matrix packed only (nothing to share)
            for kind, matrix in (("weight", fused.plain), ("bias", getattr(fused, "bias", None))):
                freed += point_at_rows([getattr(module, kind, None) for _, module in parts], matrix)
    return freed


def point_at_rows(params: list, fused: Tensor | None) -> int:
    """Make ``params`` (in order) views of consecutive row blocks of ``fused`` when they fit exactly."""
    if fused is None or any(p is None for p in params) or sum(p.shape[0] for p in params) != fused.shape[0]:
        return 0
    if any(p.dtype != fused.dtype or p.device != fused.device or p.shape[1:] != fused.shape[1:] for p in params):
        return 0
    freed, start = 0, 0
    for p in params:
        rows = p.shape[0]
        if p.untyped_storage().data_ptr() != fused.untyped_storage().data_ptr():
            freed += p.numel() * p.element_size()
            p.data = fused[start:start + rows]
        start += rows
    return freed


def layer_prefix(model: PreTrainedModel, i: int) -> str:
    """The module path of decoder layer ``i`` ('model.layers.3.' for a ForCausalLM)."""
    for name in (f"model.layers.{i}.", f"layers.{i}."):
        try:
            model.get_submodule(name[:-1])
            return name
        except AttributeError:
            continue
    raise UserError(f"{type(model).__name__} has no decoder layer {i} at model.layers; is it a Llama-family model?")
