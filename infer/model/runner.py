"""A lean forward pass over the weights of a Hugging Face decoder model (the families of ``layerskip_core.families``).

The runner depends on the checkpoint's weights and config only (not on transformers'
modeling code, whose internals move between releases); a family's layer math is ``infer.model.layer_math``'s, each
layer's sliding window and RoPE table its spec's (docs/MODELS.md). It executes any layer range with any
sublayer skip plan, against a preallocated KV cache whose length is tracked per layer: early
exit makes shallow layers run ahead of deep ones, and rollback is setting a length back.

Tensors are ``(T, ...)`` for the T tokens of one call. Every eager forward runs the one layer loop
(``infer.model.packed``): one sequence is one segment (``forward_layers``, ``span``), a batch of sequences
several packed rows (``span_rows``): the projections over all rows' tokens at once, ``cached_attention`` per row over
its own cache.

Decoding forwards (draft steps, verification) go through ``Runner.span``, which an *executor*
runs: ``eager`` (the layer loop, the CPU default: fastest there, and exact thanks to the
small-matmul kernel), ``static`` (static shapes with device-side positions and lengths, see
``infer.model.graphs``) or ``graphs`` (the static forwards captured as CUDA graphs, the CUDA default);
``compile`` (the settings default it to on CUDA) runs the static forwards' layers through ``torch.compile``.
Prompt prefill always runs eagerly, on the causal attention kernel (no mask).
"""

from __future__ import annotations

import copy
import hashlib
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from weakref import WeakKeyDictionary

import torch
import torch.nn.functional as F
from torch import Tensor

from infer.model import fused_span, layer_math
from infer.model.attention import attend, rows_for, score_scale
from infer.model.checks import check_state, load_checked
from infer.model.forward_model import Segment, SpanOutput
from infer.model.graphs import StaticExecutor
from infer.model.kv_cache import CachePool, KVCache, capacity_bucket, ints_to_device
from infer.model.packed import packed_layers
from infer.model.plan import LayerPlan
from infer.model.weights import (
    LayerWeights,
    Linear,
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


class DraftHead:
    """The LM head restricted to N token ids (a reduced-vocabulary draft head), built once per runner and ids.

    Its weight is a gathered copy of the N rows of the shared head (the model's own head, tied or not, is
    untouched); ``logits`` scores only those N ids and returns them at their places in the full vocabulary,
    with -inf elsewhere, so everything downstream (argmax, softmax, sampling, token trees) sees a proper
    draft distribution that is zero outside the subset. Verification never uses it.
    """

    def __init__(self, runner: Runner, ids: Tensor, key: str, dtype: torch.dtype | None = None):
        self.ids = ids.to(runner.device, torch.long)  # (N,) sorted, unique
        self.key = key  # identifies the ids and the dtype (static forwards are keyed by it)
        self.vocab_size = runner.spec.vocab_size
        self.spec = runner.spec  # its final logit softcapping
        rows = runner.lm_head.rows(self.ids).to(dtype or runner.dtype)  # (N, d)
        self.linear = Linear(rows, None, runner.kernel)  # a copy, in ``dtype``: only drafts read it

    @property
    def size(self) -> int:
        return int(self.ids.shape[0])

    def logits(self, normed: Tensor) -> Tensor:
        """(T, d) final-normed hidden -> (T, V) fp32 logits, -inf outside the subset."""
        sub = layer_math.softcap(self.linear(normed.to(self.linear.dtype)).float(), self.spec)  # (T, N)
        full = sub.new_full((sub.shape[0], self.vocab_size), float("-inf"))  # (T, V)
        return full.index_copy_(1, self.ids, sub)


@dataclass
class RunnerCounters:
    """How many token-rows each layer has processed (for tests and profiling)."""

    layer_tokens: list[int] = field(default_factory=list)
    lm_head_tokens: int = 0

    def reset(self) -> None:
        self.layer_tokens = [0] * len(self.layer_tokens)
        self.lm_head_tokens = 0


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


class Runner:
    """Executes layer ranges of a supported model with sublayer skip plans over a KV cache."""

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
        self.set_executor(executor, compile)
        self.fused = fused_span.for_runner(self)
        """The fused layer span (``infer.model.fused_span``): a one-sequence eager forward's layers in one C++ call,
        bitwise the layer loop; None where this runner does not qualify (decided here, once)."""
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
        self.caches, self._draft_heads, self._extra_layers = CachePool(), {}, {}
        self._beside = WeakKeyDictionary()
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
        self.static = None if executor == "eager" else StaticExecutor(self, executor == "graphs", compile)

    @property
    def executor(self) -> str:
        """The executor in use: 'eager', 'static' or 'graphs'."""
        if self.static is None:
            return "eager"
        return "graphs" if self.static.capture else "static"

    def fall_back_to_eager(self, reason: str) -> None:
        """Drop the static executor after a failure (called once; warns)."""
        warnings.warn(f"CUDA graph capture failed ({reason}); decoding continues with the eager executor",
                      RuntimeWarning, stacklevel=3)
        self.static = None

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
    @property
    def num_layers(self) -> int:
        return self.spec.num_layers

    def embed(self, ids: Tensor) -> Tensor:  # embed_w None: tied to the LM head, whose rows it reads
        x = self.lm_head.rows(ids) if self.embed_w is None else F.embedding(ids, self.embed_w)  # (T,) -> (T, d)
        return x if self.embed_scale is None else x * self.embed_scale

    def logits(self, hidden: Tensor, vocab: DraftHead | None = None) -> Tensor:
        """Final norm + LM head (or a reduced-vocabulary draft head), returned in fp32 (T, V)."""
        self.counters.lm_head_tokens += hidden.shape[0]
        return self.head(hidden, vocab)

    def head(self, hidden: Tensor, vocab: DraftHead | None = None) -> Tensor:
        """Final norm + LM head in fp32, without counting (the static executor counts on the host); with
        ``vocab``, only its N rows of the head run and the other logits are -inf."""
        h = layer_math.norm(hidden, self.final_norm, self.spec)  # (T, d)
        if vocab is not None:
            return vocab.logits(h)  # (T, V)
        return layer_math.softcap(self.lm_head(h.to(self.lm_head.dtype)).float(), self.spec)  # (T, V)

    def draft_head(self, ids: Tensor | list[int], dtype: torch.dtype | None = None) -> DraftHead:
        """The draft head over token ``ids`` (N,) in ``dtype`` (default the runner's), made on first use and kept."""
        ids = torch.as_tensor(ids, dtype=torch.long).cpu()  # (N,)
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= self.spec.vocab_size:
            raise UserError(f"a draft vocabulary needs token ids in [0, {self.spec.vocab_size}), got "
                            f"{ids.numel()} ids")
        ids = ids.unique(sorted=True)
        dtype = dtype or self.dtype
        key = hashlib.sha256(ids.numpy().tobytes()).hexdigest()[:16] + ("" if dtype == self.dtype else str(dtype))
        if key not in self._draft_heads:
            self._draft_heads[key] = DraftHead(self, ids, key, dtype)
        return self._draft_heads[key]

    def span(self, cache: KVCache, hidden: Tensor, positions: list[int], start: int, end: int, *,
             exact_until: int | None = None, plan: LayerPlan | None = None, mask: Tensor | None = None,
             logits: bool = False, vocab: DraftHead | None = None) -> SpanOutput:
        """A decoding forward: layers ``[start, exact_until)`` exactly, then ``[exact_until, end)`` under ``plan``.

        ``hidden`` (T, d) enters layer ``start`` at RoPE ``positions`` (T host ints); ``mask`` (T, W)
        bool as in ``forward_layers`` (None = causal new tokens). Returns the stream at
        ``exact_until`` (default ``end``), after ``end``, and the logits when ``logits``. Runs on the
        static executor when one is set and the call fits it, else eagerly; both write the same
        cache rows and lengths. ``vocab``: score the logits with that reduced-vocabulary draft head.
        """
        split = end if exact_until is None else exact_until
        if self.static is not None:
            out = self.static.span(cache, hidden, positions, start, split, end, plan, mask, logits, vocab)
            if out is not None:
                return SpanOutput(*out)
        return self.span_rows([Segment(cache, positions, mask)], hidden, start, split, end, plan, logits, vocab)

    def span_rows(self, segments: Sequence[Segment], hidden: Tensor, start: int, split: int, end: int,
                  plan: LayerPlan | None = None, logits: bool = False, vocab: DraftHead | None = None) -> SpanOutput:
        """``span``'s eager forward over packed rows (``infer.model.packed``; one segment is one sequence): ``hidden``
        (N, d) holds the segments' rows in order; layers ``[start, split)`` exactly, then ``[split, end)`` under
        ``plan``."""
        if len(segments) == 1:
            s = segments[0]
            fused = self.fused_span(s.cache, hidden, s.positions, start, split, end, plan, s.mask)  # (T, d) x 2
            if fused is not None:
                return SpanOutput(*fused, self.logits(fused[1], vocab) if logits else None)
        pos = self.to_device([p for s in segments for p in s.positions])  # (N,)
        rope = (*self.rope(pos), pos)  # K x (N, 1, D) cos and sin, the positions
        masks = [None if s.mask is None else s.mask.to(self.device) for s in segments]  # (T, W) each
        memo: list[dict] = [{} for _ in segments]  # per segment: attention masks by start slot
        exact = packed_layers(self, segments, hidden, rope, start, split, None, masks, memo)  # (N, d)
        out = exact if split >= end else packed_layers(self, segments, exact, rope, split, end, plan, masks, memo)
        return SpanOutput(exact, out, self.logits(out, vocab) if logits else None)

    def fused_span(self, cache: KVCache, hidden: Tensor, positions: Sequence[int] | Tensor, start: int, split: int,
                   end: int, plan: LayerPlan | None, mask: Tensor | None) -> tuple[Tensor, Tensor] | None:
        """One sequence's layers ``[start, split)`` exactly and ``[split, end)`` under ``plan`` on the fused layer
        span (``self.fused``): (the stream after ``split``, after ``end``), or None where the runner has none or the
        call is not one it takes (the layer loop runs it then)."""
        if self.fused is None:
            return None
        return self.fused(cache, hidden, positions, start, split, end, plan, mask, (self._cos, self._sin),
                          self.counters.layer_tokens)

    def to_device(self, values: list[int]) -> Tensor:
        """Host ints as a device long tensor; on CUDA through pinned memory, so no host sync."""
        return ints_to_device(values, self.device)

    def forward_layers(self, cache: KVCache, hidden: Tensor, positions: Tensor, start: int = 0,
                       end: int | None = None, plan: LayerPlan | None = None,
                       mask: Tensor | None = None, bulk: bool = False) -> Tensor:
        """Run layers ``[start, end)`` on ``hidden`` (T, d); append K/V at each layer's length.

        ``positions`` (T,) are the RoPE positions. ``mask`` (T, W) bool, if given, says which of
        the last W attended slots (the W-T slots before the new ones, then the T new ones) each
        new token sees; all earlier slots are visible. Without a mask the new tokens are causal.
        A skipped attention sublayer writes no K/V and leaves its layer's length unchanged.
        ``bulk`` (prompt prefill) uses BLAS even where the small-batch kernel exists: faster for
        long inputs, and nothing compares prefill rows with token-by-token ones.
        """
        end = self.spec.num_layers if end is None else end
        fused = None if bulk else self.fused_span(cache, hidden, positions, start, start, end, plan, mask)
        if fused is not None:
            return fused[1]  # (T, d)
        segment = Segment(cache, positions, mask)  # one sequence: the one layer loop's single segment
        rope = (*self.rope(positions), positions)  # K x (T, 1, D) cos and sin, the positions
        return packed_layers(self, [segment], hidden, rope, start, end, plan, [mask], [{}], bulk)  # (T, d)

    def forward(self, cache: KVCache, ids: Tensor, positions: Tensor | None = None,
                plan: LayerPlan | None = None, mask: Tensor | None = None) -> Tensor:
        """Full model on token ids (T,), appending to the cache; returns logits (T, V)."""
        if positions is None:
            start = cache.lengths[0]
            positions = torch.arange(start, start + ids.shape[0], device=self.device)
        return self.logits(self.forward_layers(cache, self.embed(ids), positions, plan=plan, mask=mask))

    def rope(self, positions: Tensor) -> tuple[list[Tensor], list[Tensor]]:
        """(cos, sin) at ``positions`` (T,) on the device: K tensors (T, 1, D) each, one per RoPE table (layer i reads
        table ``rope_rows[i]``; each its own tensor, so compiled steps see no storage offset that differs by table);
        sin has the sign of the roll form folded in."""
        return [c[positions][:, None] for c in self._cos], [s[positions][:, None] for s in self._sin]

    def attn_mask(self, start_slot: int, T: int, mask: Tensor | None) -> Tensor | None:
        """(T, start_slot + T) bool; None where no mask is needed (one row, or causal rows from slot 0)."""
        S = start_slot + T
        if mask is None:
            if T == 1 or start_slot == 0:
                return None
            return torch.ones(T, S, dtype=torch.bool, device=self.device).tril(diagonal=start_slot)  # (T, S)
        W = mask.shape[1]
        if W > S:
            raise ValueError(f"mask covers {W} slots but only {S} exist")
        full = torch.ones(T, S, dtype=torch.bool, device=self.device)  # (T, S)
        full[:, S - W:] = mask
        return full

    def window_mask(self, cache: KVCache, i: int, base: Tensor | None, positions: Tensor) -> Tensor | None:
        """Layer ``i``'s mask for T new rows at ``positions`` (T,): ``base`` (``attn_mask``'s) where the layer attends
        fully; with a sliding window W, the rows' positions are recorded in the cache and keys W or more positions
        before a row are hidden too (``layer_math.near``), once the layer's slots outnumber W (slot >= position, so
        before that every key is near)."""
        window = self.spec.window(i)
        if window is None:
            return base
        T, start = positions.shape[0], cache.lengths[i]
        cache.pos[i, start:start + T] = positions
        if start + T <= window:
            return base
        near = layer_math.near(positions, cache.pos[i, :start + T], window)  # (T, S)
        if base is None and T > 1:  # causal rows from slot 0
            base = torch.ones(T, start + T, dtype=torch.bool, device=self.device).tril(diagonal=start)
        return near if base is None else base & near

    def cached_attention(self, i: int, cache: KVCache, q: Tensor, k: Tensor, v: Tensor,
                         attn_mask: Tensor | None, scale: float | None = None, bulk: bool = False) -> Tensor:
        """Write k, v (Hkv, T, D) at layer ``i``'s length in ``cache``, then attend q (Hq, T, D) over the layer's
        filled slots with ``attn_mask`` (``attn_mask``'s form; None: causal from slot 0, or all visible) and the
        score ``scale`` (None: D ** -0.5): (Hq, T, D). The packed batch forward (``infer.model.packed``) calls it once
        per row over that row's own cache. With the kernel, every row runs the batch-invariant row attention
        (``infer.model.attention.attend``; the cache writes in the same C++ call), except in ``bulk`` (prompt prefill)
        calls."""
        T = q.shape[1]
        start = cache.lengths[i]
        stop = start + T
        if stop > cache.capacity:
            raise RuntimeError(f"KV cache full: layer {i} needs {stop} slots, capacity {cache.capacity}")
        cache.lengths[i] = stop
        rows = None if bulk else rows_for(self.kernel, q, attn_mask, start == 0 and T > 1)
        if rows is not None:
            return rows.attend_cache(q, k, v, cache.k, cache.v, i, start, attn_mask, score_scale(q, scale))
        cache.k[i, :, start:stop] = k
        cache.v[i, :, start:stop] = v
        keys = cache.k[i, :, :stop]  # (Hkv, S, D)
        values = cache.v[i, :, :stop]  # (Hkv, S, D)
        return attend(q, keys, values, attn_mask, causal=start == 0 and T > 1, scale=scale)  # (Hq, T, D)

    def qkv_rope(self, w: LayerWeights, hidden: Tensor, cos: Tensor, sin: Tensor,
                 bulk: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """A layer's attention norm, q/k/v projection, q/k norms and RoPE (``layer_math.qkv_rope``; ``cos``/``sin``
        (T, 1, D): the layer's table): (Hq, T, D), (Hkv, T, D), (Hkv, T, D)."""
        return layer_math.qkv_rope(self.spec, w, hidden, cos, sin, bulk)

    def mlp(self, w: LayerWeights, hidden: Tensor, bulk: bool = False) -> Tensor:
        """A layer's MLP sublayer with its residual (``layer_math.mlp``): (T, d) -> (T, d)."""
        return layer_math.mlp(self.spec, w, hidden, bulk)

    # ----------------------------------------------------------------- identity
    def identity(self) -> dict:
        """What a saved plan must match: architecture numbers plus a weight fingerprint."""
        s = self.spec
        return {"model_type": s.model_type, "num_layers": s.num_layers, "hidden_size": s.hidden_size,
                "vocab_size": s.vocab_size, "weight_fingerprint": self.fingerprint}
