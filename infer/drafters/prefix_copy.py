"""Early exit's draft forward on its own copy of layers [0, E) in a narrower dtype (``early_exit:prefix=copy``;
int8 / int4 draft dtypes: a quantized copy, ``infer.model.quant_weights``).

LayerSkip drafts with the model's own layers [0, E), so verification reuses their KV and exit states; a draft then
reads those layers' weights in the model's dtype. With ``prefix=copy`` a draft runs a copy of them in the drafter's
``draft_dtype`` (bf16 under an fp32 model on a CPU with native bf16 dot products: half the bytes), over its own KV
cache paired with the model's, then the exit adapter's layer (if any) or the final norm, and the (draft) head.
Verification never reads the copy: it runs every layer over the drafted tokens (``exact_layers`` 0), so the output is
the model's as always. The trade: drafts read E/L of the weights in the narrower dtype, verification runs layers
[0, E) over T rows instead of one, and the copy holds E/L of the weights again.

The copy's cache (and the adapter's) follow the accepted tokens: a draft writes the row of each token it runs,
rows of rejected tokens are rolled back, and the rows a draft did not run (the last drafted token when every one was
accepted, plain steps of the adaptive gate) are run in front of the next draft's first token, in the same forward;
the prompt's rows are taken from the model's own cache (and stream at E, for the adapter) at the first draft, so a
sequence that never drafts never spends anything on them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from infer.assets.adapter import ExitAdapter
from infer.model.kv_cache import KVCache
from infer.model.loop import packs
from infer.model.program import BULK, ONCE, STEP, Program, Rows, Segment
from infer.model.quant_weights import quantized
from infer.model.runner import DraftHead, Runner
from infer.model.weights import TORCH_BULK_ROWS, cast_layer


def prefix_copy(runner: Runner, end: int, dtype: torch.dtype, quant: str | None = None) -> Runner:
    """A runner over a copy of ``runner``'s layers [0, ``end``) in ``dtype`` with its final norm, or quantized by the
    draft dtype ``quant`` (its activations in the model's dtype), made once per runner (``Runner.derived``)."""
    if quant is not None:
        return quantized(runner, quant, end)

    def build() -> Runner:
        layers = [cast_layer(w, dtype, runner.spec, runner.kernel) for w in runner.layers[:end]]
        norm = runner.final_norm if runner.spec.family.norm_offset else runner.final_norm.to(dtype)
        return runner.over_layers(layers, norm, None, dtype)

    return runner.derived(f"prefix {end} {dtype}", build)


def catch_up_kind(rows: int) -> str:
    """How a draft forward that catches a copy up runs its ``rows``: from ``TORCH_BULK_ROWS`` on as a prompt's rows
    (``BULK``: torch's matmuls, AMX in bf16, and SDPA; 8 rows of 64 missing tokens each, after a batch's plain phase,
    cost 0.2 s on the panels), else as a decoding step's. Nothing compares a draft's rows with token-by-token ones."""
    return BULK if rows >= TORCH_BULK_ROWS else STEP


class CopiedPrefixForward:
    """Draft forward: the copied layers [0, E) in ``dtype``, then ``adapter``'s layer or the final norm, then the
    head (``vocab``: a reduced draft head). It owns the copy's cache and the adapter's for the sequence being
    decoded (``start``, ``accept``, ``catch_up``, as ``infer.assets.adapter.AdapterForward``)."""

    exact_layers = 0
    """Nothing a draft computes is the model's: verification runs every layer over the drafted tokens."""

    def __init__(self, runner: Runner, exit_layer: int, dtype: torch.dtype, adapter: ExitAdapter | None = None,
                 vocab: DraftHead | None = None, quant: str | None = None):
        self.runner, self.adapter, self.vocab, self.exit_layer = runner, adapter, vocab, exit_layer
        self.prefix = prefix_copy(runner, exit_layer, dtype, quant)
        """The runner over the copied layers (kept by ``runner`` per E and dtype)."""
        self.to_exit = Program(0, exit_layer)
        """The copied layers, without a head."""
        self.to_logits = Program(0, exit_layer, logits=True, vocab=vocab)
        """The copied layers, the final norm and the (draft) head."""
        self.cache: KVCache | None = None
        """The copy's cache, paired with the model's cache of the sequence being decoded."""
        self.adapter_cache: KVCache | None = None
        self.tokens: list[int] = []
        """The sequence's tokens (``catch_up``'s): rows the copy's cache lacks are run from them."""
        self.unfilled = 0
        """Prompt positions the copy's cache still lacks (``fill`` takes them at the first draft)."""
        self.model_cache: KVCache | None = None
        self.kept: Tensor | None = None
        """The prefill's stream entering layer E over the prompt, until ``fill`` feeds it to the adapter."""

    def __call__(self, cache: KVCache, token: Tensor, position: int) -> tuple[Tensor, Tensor]:
        return self.rows([self], [cache], token, [position])  # (1, d), (1, V)

    def rows(self, forwards: list[CopiedPrefixForward], caches: list[KVCache], tokens: Tensor,
             positions: list[int]) -> tuple[Tensor, Tensor]:
        """The draft forward of R sequences' tokens (R,) at once as packed rows: each sequence's segment holds the
        rows its copy's cache lacks (after plain steps, the tokens verification took), then its token, so a batch
        catches up in one forward rather than one per sequence (after 3 plain cycles at B = 8: 0.06 s against one
        draft forward's 0.015 s). Returns (R, d) streams after the copy and (R, V) logits, at each sequence's token."""
        ids = [f.missing(p, token) for f, token, p in zip(forwards, tokens.split(1), positions, strict=True)]
        spans = [range(p - i.shape[0] + 1, p + 1) for i, p in zip(ids, positions, strict=True)]
        N = sum(len(s) for s in spans)
        kind = STEP if N == len(forwards) else catch_up_kind(N)  # one row each: the draft's own step
        rows = Rows(self._embed(torch.cat(ids)), [Segment(f.cache, list(s)) for f, s in zip(forwards, spans,
                                                                                             strict=True)], kind)
        if self.adapter is None and N == len(forwards):
            out = self.prefix.run(self.to_logits, rows)
            return out.hidden, out.logits
        hidden = self.prefix.run(self.to_exit, rows).hidden  # (N, d)
        last = torch.tensor([len(s) for s in spans]).cumsum(0) - 1  # (R,) each sequence's token among the N rows
        if self.adapter is None:
            return hidden[last], self.prefix.logits(hidden[last], self.vocab)
        caches_a = [f.adapter_cache for f in forwards]
        return hidden[last], self.adapter.forward_rows(caches_a, hidden, spans, self.vocab, kind)

    def start(self, cache: KVCache, tokens: list[int], kept: Tensor | None = None) -> None:
        """A prompt was prefilled into ``cache``: the copy's cache (and the adapter's) are filled for its positions at
        the first draft (``fill``), not before: where the gate never drafts (a batch too large for drafting to pay)
        nothing is spent on them. ``kept``: the (P, d) stream entering layer E that the prefill kept, or None."""
        self.cache = self.prefix.cache_beside(cache)
        if self.adapter is not None:
            self.adapter_cache = self.adapter.layer.cache_beside(cache)
        self.model_cache, self.kept = cache, kept
        self.tokens, self.unfilled = tokens, len(tokens)

    def fill(self) -> None:
        """The prompt's rows, once, before the first draft: the copy's cache takes the model's keys and values of
        layers [0, E) (in the copy's dtype: what the copy computes, up to its rounding; bitwise in the model's dtype),
        and the adapter's cache is computed from the model's stream entering E (``kept``). Running the copy over the
        prompt instead cost 0.4 s for 8 prompts of about 200 tokens (6 plain cycles of the batch) and changed no
        output: drafts only propose."""
        P, self.unfilled = self.unfilled, 0
        hidden, self.kept = self.kept, None
        if not P:
            return
        if self.adapter is not None and (hidden is None or hidden.shape[0] != P):
            # no stream kept (a target not deeper than E): the copy runs over the prompt, the prefill's route
            rows = Rows.one(self.cache, self._embed(self.runner.to_device(self.tokens[:P])),
                            torch.arange(P, device=self.runner.device), kind=ONCE if packs(self.runner) else BULK)
            self.adapter.forward(self.adapter_cache, self.prefix.run(self.to_exit, rows).hidden, 0, kind=BULK)
            return
        E, source = self.exit_layer, self.model_cache
        self.cache.k[:E, :, :P] = source.k[:E, :, :P]  # (E, Hkv, P, D), cast to the copy's dtype
        self.cache.v[:E, :, :P] = source.v[:E, :, :P]
        if self.cache.pos is not None:
            self.cache.pos[:E, :P] = source.pos[:E, :P]
        self.cache.lengths[:E] = [P] * E
        if self.adapter is not None:
            stream = hidden.to(self.prefix.dtype)  # (P, d) the model's stream entering E
            self.adapter.forward(self.adapter_cache, stream, 0, kind=BULK)

    def accept(self, n: int, hidden: Tensor | None, new_n: int, kept: int) -> None:
        """Verification settled positions [0, new_n): drop the rows from ``kept`` on (rejected tokens, and those
        after the first sibling a token tree's path took); the rest stay."""
        for c in (self.cache, self.adapter_cache):
            if c is not None and c.lengths[0] > kept:
                c.rollback(kept)

    def catch_up(self, cache: KVCache, tokens: list[int], n: int) -> None:
        """Before a draft at position ``n``: the rows in [have, n) are run with the draft's first token."""
        self.tokens = tokens

    def missing(self, position: int, token: Tensor) -> Tensor:
        """The token ids (T,) to run for a draft at ``position``: the rows the copy's cache lacks, then ``token``."""
        self.fill()
        have = self.cache.lengths[0]
        if have >= position:
            return token
        return torch.cat([self.runner.to_device(self.tokens[have:position]), token])

    def _embed(self, ids: Tensor) -> Tensor:
        return self.runner.embed(ids).to(self.prefix.dtype)  # (T, d)
