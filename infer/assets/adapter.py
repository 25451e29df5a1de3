"""Exit adapters at decoding time: a file loaded as one more decoder layer on the runner, and early exit's draft
forward through it.

The shape and file format are ``layerskip_core.adapter_spec``'s; ``train.adapter`` writes the files. The adapter's
attention, optional MLP and norms become a ``LayerWeights`` like the model's, run by ``Runner.extra_layer``: a
runner over that one layer (kept by the model's runner), sharing the model's RoPE tables, LM head and executor
kind, whose final norm is the adapter's own output norm, over a one-layer ``KVCache`` paired with the model's
cache (``Runner.cache_beside``) whose slot is the position. So the eager, static and (on CUDA) captured forwards
all cover it, with the runner's one norm, RoPE and projection code. Drafting with an adapter runs layers [0, E) of
the model (whose KV and exit hidden states are exact, so verification reuses them as for LayerSkip early exit),
then the adapter's layer, its output norm and the shared LM head (or a reduced draft head).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from infer.model.kv_cache import KVCache
from infer.model.program import BULK, STEP, Output, Program, Rows, Segment
from infer.model.quant_weights import check_widths, quantized
from infer.model.runner import DraftHead, Runner
from layerskip_core.adapter_spec import (
    LAYER_NAMES,
    AdapterShape,
    TunedDecoding,
    read_decoding,
    read_file,
    read_metadata,
)
from layerskip_core.draft_vocab import ids_digest, names_shipped_top
from layerskip_core.errors import UserError

BUNDLED_DIR = Path(__file__).parent.parent / "data" / "adapters"
"""Adapter files shipped with the package (package data), picked by ``adapter=default`` for the model they fit."""


class ExitAdapter:
    """One adapter's weights as a decoder layer on a runner's device and dtype, and its forward."""

    def __init__(self, runner: Runner, shape: AdapterShape, weights: dict[str, Tensor], provenance: dict,
                 source: str | Path = "the adapter", dtype: torch.dtype | None = None,
                 decoding: TunedDecoding | None = None, quant: str | None = None):
        try:
            shape.check_model(runner.num_layers)
        except UserError as e:
            raise UserError(f"{source}: {e}") from None
        shape.check_layout(runner.spec, source)  # the adapter's layer runs with the model's head layout
        self.runner, self.shape, self.provenance, self.source = runner, shape, provenance, source
        self.decoding = decoding
        """The early-exit setting the adapter was tuned with and its measured speed-up (its header's ``decoding``;
        None: never tuned): what early exit with it uses for the options its caller leaves unset."""
        for name, want in shape.tensor_shapes().items():
            if name not in weights or tuple(weights[name].shape) != want:
                got = tuple(weights[name].shape) if name in weights else "missing"
                raise UserError(f"{source}: adapter tensor {name!r} should have shape {want}, has {got}; the file "
                                "is damaged")
        layer = {LAYER_NAMES[k]: weights[k] for k in shape.tensor_shapes() if k in LAYER_NAMES}
        self.layer = runner.extra_layer(layer, weights["out_norm.weight"], dtype)
        """The runner over the adapter's layer, its output norm before the LM head (kept by ``runner``), in ``dtype``
        (default the model's), or its matrices quantized by the draft dtype ``quant`` ('int8', 'int4'): only drafts
        read it, so its precision changes drafts, never the output."""
        if quant is not None:
            check_widths(self.layer.layers, quant, f"{source} (an exit adapter)")
            self.layer = quantized(self.layer, quant)

    @property
    def exit_layer(self) -> int:
        return self.shape.exit_layer

    @classmethod
    def load(cls, path: str | Path, runner: Runner, dtype: torch.dtype | None = None,
             quant: str | None = None) -> ExitAdapter:
        """Read an adapter file made for ``runner``'s model (refused in one line otherwise), to run in ``dtype`` (or
        quantized: ``quant``)."""
        path = Path(path).expanduser()
        meta, weights = read_file(path, hint=", or 'default'")
        shape, provenance = read_metadata(meta, runner.identity(), str(path))
        return cls(runner, shape, weights, provenance, path, dtype, read_decoding(meta, path), quant)

    def new_cache(self, capacity: int) -> KVCache:
        """A one-layer cache for the adapter's keys and values at positions [0, capacity)."""
        return self.layer.new_cache(capacity)

    def forward(self, cache: KVCache, hidden: Tensor, start: int, logits: bool = False,
                vocab: DraftHead | None = None, kind: str = STEP) -> Output:
        """Hidden (T, d) entering layer E at positions start..start+T-1 (the cache must hold ``start``) through the
        adapter's layer, appending T rows to its cache: ``hidden`` (T, d) is the adapter's output (in its dtype) before
        its output norm; with ``logits``, the (T, V) fp32 logits after it and the LM head (or ``vocab``'s). ``kind``:
        ``BULK`` for a prompt's rows (a prefill's route: a bf16 adapter's matmuls on torch's AMX, 3x faster for a
        prompt of 200 tokens), else the rows of a decoding step."""
        T = hidden.shape[0]
        if cache.lengths[0] != start:
            raise RuntimeError(f"adapter cache holds {cache.lengths[0]} positions; asked to write from {start}")
        rows = Rows.one(cache, hidden.to(self.layer.dtype), list(range(start, start + T)), kind=kind)
        out = self.layer.run(Program(0, 1, logits=logits, vocab=vocab), rows)
        if logits:
            self.runner.counters.lm_head_tokens += T
        return out


    def forward_rows(self, caches: list[KVCache], hidden: Tensor, spans: Sequence[Sequence[int]],
                     vocab: DraftHead | None = None, kind: str = STEP) -> Tensor:
        """``forward`` of R sequences at once as packed rows: ``hidden`` (N, d) entering layer E holds each sequence's
        rows in turn, sequence j's at the consecutive positions ``spans[j]`` (from the length of its own adapter cache
        ``caches[j]``); returns the (R, V) logits of each sequence's last row. ``kind``: as ``forward``'s."""
        for cache, span in zip(caches, spans, strict=True):
            if cache.lengths[0] != span[0]:
                raise RuntimeError(f"adapter cache holds {cache.lengths[0]} positions; asked to write from {span[0]}")
        self.runner.counters.lm_head_tokens += len(spans)
        rows = Rows(hidden.to(self.layer.dtype), [Segment(c, list(s)) for c, s in zip(caches, spans, strict=True)],
                    kind)
        if rows.size == len(spans):  # one row each
            return self.layer.run(Program(0, 1, logits=True, vocab=vocab), rows).logits
        out = self.layer.run(Program(0, 1), rows).hidden  # (N, d)
        last = torch.tensor([len(s) for s in spans]).cumsum(0) - 1  # (R,)
        return self.layer.logits(out[last], vocab)


def trained_vocab_size(adapter: ExitAdapter) -> str | None:
    """What ``draft_vocab=auto`` means with this adapter: the size of the draft vocabulary its head was trained on,
    when that vocabulary was the top of the shipped counts (its provenance's option 'auto' or a size, so the same
    ids resolve again); None for a vocabulary file or the whole head (auto then keeps its usual meaning)."""
    trained = adapter.provenance.get("draft_vocab")
    if not isinstance(trained, dict) or "size" not in trained or not names_shipped_top(trained.get("option")):
        return None
    size, vocab = trained["size"], adapter.runner.spec.vocab_size
    if isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= vocab:
        raise UserError(f"{adapter.source}: the adapter's provenance says its head was trained on a draft vocabulary "
                        f"of {size!r} ids, not a size in [1, {vocab}]; the file is damaged: train the adapter again, "
                        "or give draft_vocab= a size or a vocabulary file")
    return str(size)


def vocab_note(adapter: ExitAdapter, vocab: DraftHead | None) -> str | None:
    """A one-line note when ``vocab`` (the draft head a drafter resolved; None: the whole head) is not the draft
    vocabulary the adapter's head was trained on (its provenance's ``draft_vocab.ids_sha256``, written since
    2026-12-05): drafts stay exact but may accept less. None when they match or the file does not say."""
    trained = adapter.provenance.get("draft_vocab") or {}
    want = trained.get("ids_sha256") if isinstance(trained, dict) else None
    if not want or (vocab is not None and ids_digest(vocab.ids.tolist()) == want):
        return None
    have = "the whole head" if vocab is None else f"{vocab.size} other ids"
    return (f"layerskip: note: the adapter's head was trained on a draft vocabulary of {trained.get('size')} ids "
            f"(draft_vocab={trained.get('option')} when it was trained), this drafter scores {have}: output unchanged, "
            "drafts may accept less; give draft_vocab= the vocabulary it was trained on, or train it again")


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
    """Draft forward of early exit with an adapter: layers [0, E) exactly, then the adapter's layer and the LM head.

    It owns the adapter's cache for the sequence being decoded; ``EarlyExitDrafter`` keeps that cache in step with
    the accepted tokens (``catch_up``, ``accept``). ``vocab``: a reduced-vocabulary draft head."""

    def __init__(self, runner: Runner, adapter: ExitAdapter, vocab: DraftHead | None = None):
        self.runner, self.adapter, self.vocab = runner, adapter, vocab
        self.exact_layers = adapter.exit_layer
        self.program = Program(0, self.exact_layers)
        """Layers [0, E) of the model, exactly."""
        self.cache: KVCache | None = None
        """The adapter layer's one-layer cache, paired with the model's cache of the sequence being decoded."""

    def __call__(self, cache: KVCache, token: Tensor, position: int) -> tuple[Tensor, Tensor]:
        r = self.runner
        exact = r.run(self.program, Rows.one(cache, r.embed(token), [position])).hidden  # (1, d)
        return exact, self.adapter.forward(self.cache, exact, position, logits=True, vocab=self.vocab).logits

    def rows(self, forwards: list[AdapterForward], caches: list[KVCache], tokens: Tensor,
             positions: list[int]) -> tuple[Tensor, Tensor]:
        """The draft forward of R sequences' tokens (R,) at once, each in its own caches (the model's ``caches``, each
        forward's adapter cache), as packed rows: (R, d) exact streams at layer E, (R, V) logits."""
        r = self.runner
        segments = [Segment(cache, [p]) for cache, p in zip(caches, positions, strict=True)]
        exact = r.run(self.program, Rows(r.embed(tokens), segments)).hidden  # (R, d)
        spans = [[p] for p in positions]
        return exact, self.adapter.forward_rows([f.cache for f in forwards], exact, spans, self.vocab)

    def start(self, cache: KVCache, tokens: list[int], kept: Tensor | None = None) -> None:
        """A prompt was prefilled: fill the adapter's cache for its positions from ``kept``, the (P, d) stream
        entering layer E that the prefill kept (``Needs.prompt_layers``). Without it (a target not deeper than E),
        layers [0, E) run over the prompt again, in a scratch cache (E/L of a prefill)."""
        r, P = self.runner, len(tokens)
        self.cache = self.adapter.layer.cache_beside(cache)
        if kept is not None and kept.shape[0] == P:
            self.adapter.forward(self.cache, kept, 0, kind=BULK)
            return
        scratch = r.take_cache(P)
        try:
            ids = r.to_device(tokens)  # (P,)
            rows = Rows.one(scratch, r.embed(ids), torch.arange(P, device=r.device), kind=BULK)
            hidden = r.run(self.program, rows).hidden  # (P, d)
        finally:
            r.release_cache(scratch)
        self.adapter.forward(self.cache, hidden, 0, kind=BULK)

    def accept(self, n: int, hidden: Tensor | None, new_n: int, kept: int) -> None:
        """Verification accepted positions [n, new_n) (``hidden``: their exit states from verification, rows from
        position n on, or None): keep the adapter rows the draft wrote for positions [n, kept) (those whose token
        it ran: up to the first sibling a token tree's path took), compute the missing ones."""
        self.cache.rollback(kept)
        have = self.cache.lengths[0]
        if have < new_n and hidden is not None and hidden.shape[0] >= new_n - n:
            self.adapter.forward(self.cache, hidden[have - n:new_n - n], have)

    def catch_up(self, cache: KVCache, tokens: list[int], n: int) -> None:
        """Fill adapter rows for positions the draft did not see (after plain steps): layers [0, E) run again over
        them in the model's cache (rolled back to rewrite the same rows), their exit states feed the adapter."""
        have = self.cache.lengths[0]
        if have >= n:
            return
        r = self.runner
        cache.rollback(have, 0, self.exact_layers)
        rows = Rows.one(cache, r.embed(r.to_device(tokens[have:n])), list(range(have, n)))
        hidden = r.run(self.program, rows).hidden  # (n - have, d)
        self.adapter.forward(self.cache, hidden, have)
