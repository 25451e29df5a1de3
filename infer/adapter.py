"""Exit adapters at decoding time: loading a file for a runner, the adapter's forward and its own KV cache.

The shape and file format are ``layerskip_core.adapter_spec``'s; ``train.adapter`` writes the files. Drafting
with an adapter runs layers [0, E) of the model (whose KV and exit hidden states are exact, so verification
reuses them as for LayerSkip early exit), then the adapter, then the shared LM head (or a reduced draft head).
The adapter runs eagerly on every executor (one attention layer on one token: nothing for a static shape or a
CUDA graph to save worth the capture), and it keeps its KV in an ``AdapterCache`` whose slot is the position.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import Tensor

from infer.runner import DraftHead, KVCache, Linear, Runner
from layerskip_core.adapter_spec import AdapterShape, read_file, read_metadata
from layerskip_core.errors import UserError

BUNDLED_DIR = Path(__file__).parent / "data" / "adapters"
"""Adapter files shipped with the package (package data), picked by ``adapter=default`` for the model they fit."""


class AdapterCache:
    """The adapter's keys and values for positions [0, length): slot = position, one sequence."""

    def __init__(self, shape: AdapterShape, capacity: int, dtype: torch.dtype, device: torch.device):
        self.k = torch.zeros(shape.num_kv_heads, capacity, shape.head_dim, dtype=dtype, device=device)  # (Hkv, S, D)
        self.v = torch.zeros_like(self.k)  # (Hkv, S, D)
        self.length = 0


class ExitAdapter:
    """One adapter's weights on a runner's device and dtype, and its forward."""

    def __init__(self, runner: Runner, shape: AdapterShape, weights: dict[str, Tensor], provenance: dict):
        shape.check_model(runner.num_layers)
        self.runner, self.shape, self.provenance = runner, shape, provenance
        for name, want in shape.tensor_shapes().items():
            if name not in weights or tuple(weights[name].shape) != want:
                got = tuple(weights[name].shape) if name in weights else "missing"
                raise UserError(f"adapter tensor {name!r} should have shape {want}, has {got}; the file is damaged")
        w = {k: v.to(runner.device, runner.dtype) for k, v in weights.items()}
        self.attn_norm, self.out_norm = w["attn_norm.weight"], w["out_norm.weight"]
        self.qkv = Linear(torch.cat([w["q_proj.weight"], w["k_proj.weight"], w["v_proj.weight"]]), None, runner.kernel)
        self.o = Linear(w["o_proj.weight"], None, runner.kernel)
        self.mlp, self.rope = None, None
        if shape.mlp_size:
            gate_up = Linear(torch.cat([w["gate_proj.weight"], w["up_proj.weight"]]), None, runner.kernel)
            self.mlp = (w["mlp_norm.weight"], gate_up, Linear(w["down_proj.weight"], None, runner.kernel))

    @property
    def exit_layer(self) -> int:
        return self.shape.exit_layer

    @classmethod
    def load(cls, path: str | Path, runner: Runner) -> ExitAdapter:
        """Read an adapter file made for ``runner``'s model (refused in one line otherwise)."""
        path = Path(path).expanduser()
        meta, weights = read_file(path, hint=", or 'default'")
        shape, provenance = read_metadata(meta, runner.identity(), str(path))
        shape.check_layout(runner.spec, path)
        return cls(runner, shape, weights, provenance)

    def new_cache(self, capacity: int) -> AdapterCache:
        return AdapterCache(self.shape, capacity, self.runner.dtype, self.runner.device)

    def forward(self, cache: AdapterCache, hidden: Tensor, start: int) -> Tensor:
        """Hidden (T, d) entering layer E at positions start..start+T-1 (cache.length must be ``start``) ->
        the adapter's output after its output norm (T, d), ready for the LM head; appends T rows to the cache."""
        s, T = self.shape, hidden.shape[0]
        if cache.length != start or start + T > cache.k.shape[1]:
            raise RuntimeError(f"adapter cache holds {cache.length} of {cache.k.shape[1]} positions; asked to "
                               f"write {start}..{start + T - 1}")
        q, k, v = self._qkv_rope(hidden, start)  # (Hq, T, D), (Hkv, T, D), (Hkv, T, D)
        cache.k[:, start:start + T], cache.v[:, start:start + T] = k, v
        cache.length = start + T
        mask = None if T == 1 else torch.ones(T, start + T, dtype=torch.bool, device=hidden.device).tril(start)
        out = F.scaled_dot_product_attention(q[None], cache.k[None, :, :start + T], cache.v[None, :, :start + T],
                                             attn_mask=mask, enable_gqa=s.num_heads != s.num_kv_heads)  # (1, Hq, T, D)
        h = hidden + self.o(out[0].transpose(0, 1).reshape(T, s.num_heads * s.head_dim))  # (T, d)
        if self.mlp is not None:
            norm, gate_up, down = self.mlp
            gate, up = gate_up(_rms(h, norm, s.rms_norm_eps)).chunk(2, dim=-1)  # (T, I) each
            h = h + down(F.silu(gate) * up)  # (T, d)
        return _rms(h, self.out_norm, s.rms_norm_eps)  # (T, d)

    def _qkv_rope(self, hidden: Tensor, start: int) -> tuple[Tensor, Tensor, Tensor]:
        s, T = self.shape, hidden.shape[0]
        qkv = self.qkv(_rms(hidden, self.attn_norm, s.rms_norm_eps))  # (T, (Hq + 2 Hkv) D)
        heads = s.num_heads + s.num_kv_heads
        qk = qkv[:, :heads * s.head_dim].view(T, heads, s.head_dim)  # (T, Hq + Hkv, D)
        cos, sin = self._rope(start, T, hidden.dtype)  # (T, 1, D) each
        half = s.head_dim // 2
        qk = qk * cos + torch.cat([-qk[..., half:], qk[..., :half]], dim=-1) * sin
        v = qkv[:, heads * s.head_dim:].view(T, s.num_kv_heads, s.head_dim)  # (T, Hkv, D)
        return qk[:, :s.num_heads].transpose(0, 1), qk[:, s.num_heads:].transpose(0, 1), v.transpose(0, 1)

    def _rope(self, start: int, T: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """RoPE tables for positions start..start+T-1, (T, 1, D) each: slices of tables built once for the model's
        context (a slice with host ints: no host sync, no copy to the device per draft step)."""
        if self.rope is None:
            r = self.runner
            pos = torch.arange(r.spec.max_position_embeddings, dtype=torch.float)  # (S,)
            emb = torch.cat([pos[:, None] * r.inv_freq[None, :]] * 2, dim=-1)  # (S, D)
            self.rope = tuple((t * r.rope_scale)[:, None].to(r.device, dtype) for t in (emb.cos(), emb.sin()))
        cos, sin = self.rope
        return cos[start:start + T], sin[start:start + T]


def _rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm as HF Llama computes it: normalise in fp32, scale in the input's dtype."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def adapter_path(spec: str, runner: Runner) -> Path:
    """The file for an ``adapter`` option: a path, or 'default' (the shipped adapter made for this model)."""
    if spec != "default":
        return Path(spec).expanduser()
    identity = runner.identity()
    for path in sorted(BUNDLED_DIR.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        try:
            read_metadata(meta, identity, str(path))
            return path
        except UserError:
            continue
    raise UserError("no exit adapter is shipped for this model (adapter=default fits the default model); train "
                    "one with train/layerskip.py and a recipe that has an adapter: section, then pass its path")


class AdapterForward:
    """Draft forward of early exit with an adapter: layers [0, E) exactly, then the adapter and the LM head.

    It owns the adapter's cache for the sequence being decoded; ``EarlyExitDrafter`` keeps that cache in step with
    the accepted tokens (``catch_up``, ``accept``). ``vocab``: a reduced-vocabulary draft head."""

    def __init__(self, runner: Runner, adapter: ExitAdapter, vocab: DraftHead | None = None):
        self.runner, self.adapter, self.vocab = runner, adapter, vocab
        self.exact_layers = adapter.exit_layer
        self.cache: AdapterCache | None = None

    def __call__(self, cache: KVCache, token: Tensor, position: int) -> tuple[Tensor, Tensor]:
        r = self.runner
        exact = r.span(cache, r.embed(token), [position], 0, self.exact_layers).hidden  # (1, d)
        return exact, self.logits(self.adapter.forward(self.cache, exact, position))  # (1, d), (1, V)

    def logits(self, normed: Tensor) -> Tensor:
        """(T, d) adapter output -> (T, V) fp32 logits from the shared head (or the draft head)."""
        self.runner.counters.lm_head_tokens += normed.shape[0]
        return self.runner.lm_head(normed).float() if self.vocab is None else self.vocab.logits(normed)

    def start(self, cache: KVCache, tokens: list[int]) -> None:
        """A prompt was prefilled: fill the adapter's cache for its positions. The prefill did not keep the
        stream at layer E, so layers [0, E) run over the prompt again, in a scratch cache (E/L of a prefill)."""
        r, P = self.runner, len(tokens)
        if self.cache is None or self.cache.k.shape[1] < cache.capacity:
            self.cache = self.adapter.new_cache(cache.capacity)
        self.cache.length = 0
        scratch = r.take_cache(P)
        try:
            ids = r.to_device(tokens)  # (P,)
            hidden = r.forward_layers(scratch, r.embed(ids), torch.arange(P, device=r.device), 0,
                                      self.exact_layers, bulk=True)  # (P, d)
        finally:
            r.release_cache(scratch)
        self.adapter.forward(self.cache, hidden, 0)

    def accept(self, n: int, hidden: Tensor | None, new_n: int) -> None:
        """Verification accepted positions [n, new_n) (``hidden``: their exit states from verification, rows from
        position n on, or None): keep the adapter rows the draft wrote for them, compute the missing ones."""
        self.cache.length = min(self.cache.length, new_n)
        have = self.cache.length
        if have < new_n and hidden is not None and hidden.shape[0] >= new_n - n:
            self.adapter.forward(self.cache, hidden[have - n:new_n - n], have)

    def catch_up(self, cache: KVCache, tokens: list[int], n: int) -> None:
        """Fill adapter rows for positions the draft did not see (after plain steps): layers [0, E) run again over
        them in the model's cache (rolled back to rewrite the same rows), their exit states feed the adapter."""
        have = self.cache.length
        if have >= n:
            return
        r = self.runner
        cache.rollback(have, 0, self.exact_layers)
        hidden = r.span(cache, r.embed(r.to_device(tokens[have:n])), list(range(have, n)), 0,
                        self.exact_layers).hidden  # (n - have, d)
        self.adapter.forward(self.cache, hidden, have)
