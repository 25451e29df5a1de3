"""A lean forward pass over the weights of a Hugging Face decoder model (the families of ``layerskip_core.families``).

The runner depends on the checkpoint's weights and config only (not on transformers'
modeling code, whose internals move between releases); a family's layer math is ``infer.model.layer_math``'s, each
layer's sliding window and RoPE table its spec's (docs/MODELS.md). It executes any layer range with any
sublayer skip plan, against a preallocated KV cache whose length is tracked per layer: early
exit makes shallow layers run ahead of deep ones, and rollback is setting a length back.

Every forward is a ``Program`` over ``Rows`` (``infer.model.program``): ``Runner.run(program, rows)`` asks the
runner's *executors*, chosen once per runner, in order, and the first that does not decline runs it: ``static`` or
``graphs`` (static shapes with device-side positions and lengths, the latter captured as CUDA graphs, the CUDA default:
``infer.model.graphs``; decoding steps over one sequence), ``fused`` (the layers in one C++ call on the CPU kernel's
AVX-512 path: ``infer.model.fused_span``; one sequence or several packed, every family), ``eager`` (the one layer
loop, ``infer.model.loop``: any rows, one sequence or several packed). ``compile`` (the settings default it to on
CUDA) runs the static forwards' layers through ``torch.compile``. Prompt prefill (T > 1 rows from an empty cache)
runs on the layer loop, on the causal attention kernel (no mask). The runner then advances the cache lengths and the
layer counters, the same whichever executor ran.
"""

from __future__ import annotations

import copy
import hashlib
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from weakref import WeakKeyDictionary

import torch
from torch import Tensor

from infer.model import fused_span, layer_math
from infer.model.checks import check_state, load_checked
from infer.model.graphs import StaticExecutor
from infer.model.kv_cache import CachePool, KVCache, capacity_bucket, ints_to_device
from infer.model.loop import EagerExecutor
from infer.model.plan import LayerPlan
from infer.model.program import ONCE, Declined, Executor, Output, Program, Rows
from infer.model.stack import DraftHead, RunnerCounters, Stack
from infer.model.weights import (
    LayerWeights,
    fingerprint,
    fused_layer,
    fused_weights,
    load_kernel,
    norm_weight,
    share_unfused,
    strip_prefix,
    tensor_digest,
)
from layerskip_core.errors import UserError
from layerskip_core.models import ModelSpec
from layerskip_core.settings import EXECUTORS


def weights_device(model) -> torch.device:
    """The one device that holds all of an HF ``model``'s weights. A model whose weights are not loaded (on the meta
    device: offloaded by a ``device_map``, or built empty) or spread over several devices (a sharding
    ``device_map``) is refused in one line, before anything is copied or decoded."""
    devices = {t.device for t in [*model.parameters(), *model.buffers()]}
    placed = {str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()}
    whole = "load it whole on one device (no device_map, or device_map={'': 'cuda:0'}) to decode with it"
    if any(d.type == "meta" for d in devices) or placed & {"meta", "disk"}:
        raise UserError(f"the model's weights are not loaded (on the meta device: offloaded by a device_map, or "
                        f"built empty); {whole}")
    if len(devices) > 1 or len(placed) > 1:
        where = ", ".join(sorted(placed or {str(d) for d in devices}))
        raise UserError(f"the model is spread over several devices ({where}); the runner decodes on one: {whole}")
    if not devices:
        raise UserError("the model has no weights; give a loaded model of a supported family")
    return devices.pop()


class Runner(Stack):
    """Executes programs (layer ranges of a supported model with sublayer skip plans) over KV caches."""

    def __init__(self, config, state: dict[str, Tensor], *, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", kernel: str = "auto", executor: str = "eager",
                 compile: bool = False):
        """A runner over ``state`` (a supported model's state dict) and its HF ``config``; the options are keyword-only,
        in the same order as ``from_pretrained`` and ``from_model`` take them."""
        self.config = config
        self.spec = ModelSpec.from_config(config)
        self.dtype = dtype
        self.device = torch.device(device)
        state = strip_prefix(state)
        self.fingerprint = fingerprint(state)
        self.kernel = load_kernel(dtype, self.device, kernel)
        self.embed_w, self.final_norm, self.lm_head, self.layers = fused_weights(state, config, dtype, self.device,
                                                                                 self.kernel)
        self.embed_scale = layer_math.embed_scale(self.spec, dtype, self.device)  # Gemma 3's sqrt(d), or None
        names = dict.fromkeys([*self.spec.rope_tables, *self.spec.adapter_layer().layer_ropes])
        self.rope_freqs = {t: layer_math.rope_inv_freq(config, self.spec, t) for t in names}
        """(inverse frequencies, scaling) of each RoPE table (the layers' and an exit adapter's), by name: their
        order is the order of the rows of the tables ``rope`` returns."""
        self.rope_rows = self._rope_rows(self.spec)
        """Per layer: its row in the tables ``rope`` returns."""
        self._cos: list[Tensor] = []  # per RoPE table: (n, D)
        self._sin: list[Tensor] = []
        self.static: StaticExecutor | None = None
        self._ensure_rope(self.spec.max_position_embeddings)  # once: captured graphs read these tables
        self.counters = RunnerCounters([0] * self.spec.num_layers)
        self.caches = CachePool()
        """Free KV caches by capacity (``take_cache`` / ``release_cache``)."""
        self._draft_heads: dict[str, DraftHead] = {}
        self._extra_layers: dict[str, Runner] = {}
        self._beside: WeakKeyDictionary = WeakKeyDictionary()  # another runner's cache -> this runner's paired one
        self.quant_layers: dict[tuple[str, int], LayerWeights] = {}
        """Quantized copies of its layers for drafts, by draft dtype and layer, made on first use
        (``infer.model.quant_weights.quantized``)."""
        self.eager = EagerExecutor(self)
        """The one layer loop: runs whatever the executors before it decline."""
        self.set_executor(executor, compile)
        self.fused = fused_span.for_runner(self)
        """The fused executor (``infer.model.fused_span``): a program over packed rows in one C++ call, bitwise the
        layer loop; None where this runner does not qualify (decided here, once: ``fused_span.unfit`` says why)."""
        self.declines: dict[str, int] = {}
        """How often each reason an executor gave for declining a forward came up (``Declined.reason``)."""
        if getattr(config, "attn_logit_softcapping", None) is not None and self.spec.model_type == "gemma3_text":
            print("layerskip: note: attn_logit_softcapping is set, but transformers' Gemma 3 attention does not apply "
                  "it; neither does the runner (its logits stay transformers')", file=sys.stderr)

    # ----------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu", kernel: str = "auto", executor: str = "eager",
                        compile: bool = False) -> Runner:
        """Load from a local HF folder (safetensors read directly; .bin through transformers), the config and weights
        checked against each other and the weights for NaN or infinite values (``infer.model.checks``)."""
        config, state = load_checked(Path(path))
        return cls(config, state, dtype=dtype, device=device, kernel=kernel, executor=executor, compile=compile)

    @classmethod
    def from_model(cls, model, *, dtype: torch.dtype | None = None, device: str | torch.device | None = None,
                   kernel: str = "auto", executor: str = "eager", compile: bool = False) -> Runner:
        """Wrap an instantiated HF model (its weights are copied into fused tensors; by default in the model's own
        dtype, on its own device; its o_proj and down_proj weights then point at the runner's copies: ``share_unfused``,
        except where the kernel holds them packed only). A model not loaded whole on one device is refused."""
        home = weights_device(model)
        state = {k: v.detach() for k, v in model.state_dict().items()}
        check_state(state, model.config)  # fits its config, no NaN or infinity: once per runner built
        runner = cls(model.config, state, dtype=dtype or next(model.parameters()).dtype, device=device or home,
                     kernel=kernel, executor=executor, compile=compile)
        share_unfused(model, runner.layers)
        return runner

    def over_layers(self, layers: list[LayerWeights], final_norm: Tensor, spec: ModelSpec | None = None,
                    dtype: torch.dtype | None = None) -> Runner:
        """A runner over other decoder layers with ``final_norm`` before this model's LM head: the embedding, LM
        head, RoPE tables, kernel and executor kind are this runner's; its spec (len(layers) layers), counters, cache
        pool and static forwards are its own (``spec``: the layers' own, with their windows and RoPE tables; default
        this model's, cut to len(layers)). Its caches are ``KVCache``s of its layers, so every executor runs it as it
        runs the model. ``dtype``: its layers', caches' and RoPE tables' (default this runner's; the head's stays)."""
        (other := copy.copy(self)).own_layers(layers, final_norm, spec, dtype)
        return other

    def own_layers(self, layers: list[LayerWeights], final_norm: Tensor, spec: ModelSpec | None = None,
                   dtype: torch.dtype | None = None) -> None:
        """Make this runner (a copy, ``over_layers``) run ``layers`` with ``final_norm`` in ``dtype``; its own spec,
        counters, cache pool, draft heads, extra layers and static forwards."""
        if dtype is not None and dtype != self.dtype:
            self.dtype = dtype
            self._cos, self._sin = [c.to(dtype) for c in self._cos], [t.to(dtype) for t in self._sin]
        s = self.spec
        self.spec = spec or s.for_layers(tuple(s.window(i) for i in range(len(layers))),
                                         tuple(s.layer_ropes[:len(layers)]))
        self.rope_rows = self._rope_rows(self.spec)
        self.layers, self.final_norm = list(layers), final_norm
        self.counters = RunnerCounters([0] * len(layers))
        self.caches, self._draft_heads, self._extra_layers, self.quant_layers = CachePool(), {}, {}, {}
        self._beside, self.declines = WeakKeyDictionary(), {}
        self.eager = EagerExecutor(self)
        self.static = None if self.static is None else StaticExecutor(self, self.static.capture, self.static.compile)
        self.fused = fused_span.for_runner(self)

    def extra_layer(self, state: dict[str, Tensor], final_norm: Tensor, dtype: torch.dtype | None = None) -> Runner:
        """``derived`` ``over_layers`` for one more decoder layer (an exit adapter's), given by its tensors under HF
        names within a layer (no ``mlp.*`` tensors: no MLP), run in ``dtype`` (default this runner's)."""
        dtype = dtype or self.dtype

        def build() -> Runner:
            def get(name: str) -> Tensor | None:
                return state[name].to(self.device, dtype) if name in state else None

            spec = self.spec.adapter_layer()  # train.adapter's layer: no q/k or sandwich norms, SiLU, global RoPE
            layer = fused_layer(get, spec, self.kernel, mlp="mlp.gate_proj.weight" in state)
            return self.over_layers([layer], norm_weight(final_norm.to(self.device, dtype), spec), spec, dtype)

        return self.derived(tensor_digest(state | {"final_norm": final_norm}) + str(dtype), build)

    def derived(self, key: str, build: Callable[[], Runner]) -> Runner:
        """A runner derived from this one (``over_layers``: an exit adapter's layer, a copied prefix), made by ``build``
        on first use for ``key`` and kept, as draft heads are: its static forwards and CUDA graphs are made once."""
        if key not in self._extra_layers:
            self._extra_layers[key] = build()
        return self._extra_layers[key]

    # ----------------------------------------------------------------- executor
    def set_executor(self, executor: str = "eager", compile: bool = False) -> None:
        """Choose how decoding forwards run (see the module docstring; ``layerskip_core.settings`` resolves 'auto'
        and whether to compile: on CUDA by default)."""
        if executor not in EXECUTORS:
            raise UserError(f"unknown executor {executor!r}; use one of {', '.join(EXECUTORS)}")
        if executor == "graphs" and self.device.type != "cuda":
            raise UserError("CUDA graphs need a CUDA device; use the 'static' or 'eager' executor on "
                            f"{self.device.type}")
        self.static: StaticExecutor | None = None
        """The static-shape executor (``infer.model.graphs``), or None (``executor='eager'``)."""
        if executor != "eager":
            self.static = StaticExecutor(self, executor == "graphs", compile)

    @property
    def executor(self) -> str:
        """The executor kind in use: 'eager', 'static' or 'graphs'."""
        return "eager" if self.static is None else self.static.name

    @property
    def executors(self) -> list[Executor]:
        """The executors ``run`` asks, in order: the static one (decoding steps of one sequence), the fused one (one
        sequence or several on the CPU kernel), the layer loop (anything)."""
        return [e for e in (self.static, self.fused) if e is not None] + [self.eager]

    def run(self, program: Program, rows: Rows) -> Output:
        """Run ``program`` over ``rows`` on the first executor that takes them, then advance each segment's cache
        lengths (by its rows, at every layer whose attention ran) and the counters."""
        for executor in self.executors:
            out = executor.run(program, rows)
            if not isinstance(out, Declined):
                break
            self._declined(executor, out)
        self._account(program, rows)
        return out

    def _declined(self, executor: Executor, why: Declined) -> None:
        self.declines[why.reason] = self.declines.get(why.reason, 0) + 1
        if why.broken:  # e.g. a failed CUDA graph capture: warned once, the executor dropped
            warnings.warn(f"{why.reason}; decoding continues without the {executor.name} executor", RuntimeWarning,
                          stacklevel=3)
            if executor is self.static:
                self.static = None
            if executor is self.fused:
                self.fused = None

    def _account(self, program: Program, rows: Rows) -> None:
        """The host-side bookkeeping of a run, whichever executor ran it: cache lengths and counters."""
        counts, N = self.counters.layer_tokens, rows.size
        for i in program.layers_run:
            counts[i] += N
        attention = program.attention_layers
        for seg in rows.segments:
            lengths, T = seg.cache.lengths, seg.size
            for i in attention:
                lengths[i] += T
        if program.logits:
            self.counters.lm_head_tokens += N

    def _rope_rows(self, spec: ModelSpec) -> list[int]:
        names = list(self.rope_freqs)
        return [names.index(spec.layer_ropes[i]) if spec.layer_ropes else 0 for i in range(spec.num_layers)]

    # ----------------------------------------------------------------- caches
    def new_cache(self, capacity: int) -> KVCache:
        """A new cache of exactly ``capacity`` positions (decoding takes pooled ones: ``take_cache``)."""
        self._ensure_rope(capacity)
        return KVCache(self.spec, capacity, self.dtype, self.device)

    def take_cache(self, length: int) -> KVCache:
        """An empty cache for at least ``length`` positions, from the runner's pool (``capacity_bucket`` sizes).

        The engine takes one per generation and gives it back with ``release_cache`` when the generation
        ends, so the next generation (another prompt, another bench repeat, a fresh engine) decodes in
        the same cache, and the static forwards and CUDA graphs kept per cache are built once.
        """
        capacity = capacity_bucket(length)
        return self.caches.take(capacity) or self.new_cache(capacity)

    def cache_beside(self, cache: KVCache) -> KVCache:
        """An empty cache of this runner's layers paired with ``cache`` (another runner's: an extra layer's beside
        the model's), of its capacity: made on first use and kept while ``cache`` lives, so it is pooled with it
        and its static forwards last as long."""
        paired = self._beside.get(cache)
        if paired is None or paired.capacity != cache.capacity:
            paired = self._beside[cache] = self.new_cache(cache.capacity)
        paired.reset()
        return paired

    def release_cache(self, cache: KVCache) -> None:
        """Give a cache from ``take_cache`` back to the pool (its contents are dropped on the next take)."""
        self.caches.give_back(cache)

    def _ensure_rope(self, n: int) -> None:
        """RoPE tables for positions [0, n): built for the model's whole context at construction, so they never
        grow while graphs that read them exist (growing drops every static forward)."""
        if self._cos and self._cos[0].shape[0] >= n:
            return
        tables = [layer_math.rope_table(*freqs, n) for freqs in self.rope_freqs.values()]
        self._cos = [c.to(self.device, self.dtype) for c, _ in tables]  # K x (n, D)
        self._sin = [s.to(self.device, self.dtype) for _, s in tables]  # K x (n, D)
        if self.static is not None:
            self.static.clear()  # captured graphs read the old tables

    # ----------------------------------------------------------------- compute
    def logits(self, hidden: Tensor, vocab: DraftHead | None = None) -> Tensor:
        """Final norm + LM head (or a reduced-vocabulary draft head), returned in fp32 (T, V)."""
        self.counters.lm_head_tokens += hidden.shape[0]
        return self.head(hidden, vocab)

    def draft_head(self, ids: Tensor | list[int], dtype: torch.dtype | None = None,
                   quant: str | None = None) -> DraftHead:
        """The draft head over token ``ids`` (N,) in ``dtype`` (default the runner's), or quantized by ``quant`` (a
        scheme name: ``infer.kernels.quant``), made on first use and kept."""
        ids = torch.as_tensor(ids, dtype=torch.long).cpu()  # (N,)
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= self.spec.vocab_size:
            raise UserError(f"a draft vocabulary needs token ids in [0, {self.spec.vocab_size}), got "
                            f"{ids.numel()} ids")
        ids = ids.unique(sorted=True)
        dtype = dtype or self.dtype
        key = hashlib.sha256(ids.numpy().tobytes()).hexdigest()[:16] + ("" if dtype == self.dtype else str(dtype)) \
            + ("" if quant is None else f" {quant}")
        if key not in self._draft_heads:
            self._draft_heads[key] = DraftHead(self, ids, key, dtype, quant)
        return self._draft_heads[key]

    def to_device(self, values: list[int]) -> Tensor:
        """Host ints as a device long tensor; on CUDA through pinned memory, so no host sync."""
        return ints_to_device(values, self.device)

    def forward(self, cache: KVCache, ids: Tensor, positions: Tensor | None = None,
                plan: LayerPlan | None = None, mask: Tensor | None = None) -> Tensor:
        """Full model on token ids (T,) at ``positions`` (default: from layer 0's cache length on), appending to the
        cache, under ``plan``, with ``mask`` (T, W) as a ``Segment``'s (None: causal): (T, V) logits. A one-off forward
        (``ONCE`` rows) of the program ``Program(0, L, plan=plan, logits=True)``."""
        if positions is None:
            start = cache.lengths[0]
            positions = torch.arange(start, start + ids.shape[0], device=self.device)
        rows = Rows.one(cache, self.embed(ids), positions, mask, ONCE)
        return self.run(Program(0, self.num_layers, plan=plan, logits=True), rows).logits

    # ----------------------------------------------------------------- identity
    def identity(self) -> dict:
        """What a saved plan must match: architecture numbers plus a weight fingerprint."""
        s = self.spec
        return {"model_type": s.model_type, "num_layers": s.num_layers, "hidden_size": s.hidden_size,
                "vocab_size": s.vocab_size, "weight_fingerprint": self.fingerprint}
