"""How usable is each exit as a drafter? Per-exit validation loss and top-1 agreement with the final layer.

For every exit E (the first E layers -> final norm -> LM head) and every position that has a
label, we measure:
- ``loss``: CE of the exit's prediction against the true next token;
- ``agreement``: how often the exit's argmax equals the final layer's argmax. For greedy
  self-speculative decoding this is the per-token acceptance probability of an exit-E draft,
  so it is the number that says whether early exit will pay off;
- ``accuracy``: how often the exit's argmax equals the true next token.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from layerskip_core.heldout import IGNORE, loss_sums, next_token_targets
from train.data import Examples
from train.model import LayerSkipLM


@torch.no_grad()
def exit_metrics(lm: LayerSkipLM, examples: Examples, exits: list[int], batch_size: int, pad_id: int,
                 device: torch.device | str = "cpu", indices: list[int] | None = None,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 on_batch: Callable[[int], object] | None = None) -> dict[str, dict[int, float]]:
    """Token-weighted per-exit ``loss``, ``agreement`` and ``accuracy`` over ``examples`` (or ``indices``).

    ``exits`` may include L (the final layer; its agreement is 1 by definition). ``reduce`` sums the
    (4, n_exits) statistics across processes (``accelerator.reduce``) when each evaluates a shard.
    ``on_batch(n)`` is called after each batch of n examples (a progress bar's ``update``).
    """
    was_training = lm.training
    lm.eval()
    L = lm.num_layers
    exits = sorted(set(exits) | {L})
    stats = torch.zeros(4, len(exits), dtype=torch.float64)  # rows: CE sum, agree, correct, tokens
    order = list(range(len(examples))) if indices is None else list(indices)
    for start in range(0, len(order), batch_size):
        batch = examples.batch(order[start:start + batch_size], pad_id)
        ids = batch["input_ids"].to(device)  # (B, T)
        targets = next_token_targets(batch["labels"]).to(device)  # (B, T): position t predicts token t+1
        valid = targets != IGNORE  # (B, T)
        hiddens, last = lm.hidden_states(ids, None, collect=set(exits) - {L})
        hiddens[L] = last
        final_top = lm.exit_logits(last).argmax(-1)  # (B, T)
        for j, e in enumerate(exits):
            logits = lm.exit_logits(hiddens[e]).float()  # (B, T, V)
            ce, _ = loss_sums(logits, targets)  # the one held-out loss (layerskip_core.heldout)
            top = logits.argmax(-1)  # (B, T)
            stats[0, j] += ce.double().cpu()
            stats[1, j] += ((top == final_top) & valid).sum().cpu()
            stats[2, j] += ((top == targets) & valid).sum().cpu()
            stats[3, j] += valid.sum().cpu()
        if on_batch is not None:
            on_batch(ids.shape[0])
    if reduce is not None:
        stats = reduce(stats.to(device)).cpu()
    lm.train(was_training)
    n = stats[3].clamp(min=1)
    return {
        "loss": {e: float(stats[0, j] / n[j]) for j, e in enumerate(exits)},
        "agreement": {e: float(stats[1, j] / n[j]) for j, e in enumerate(exits)},
        "accuracy": {e: float(stats[2, j] / n[j]) for j, e in enumerate(exits)},
        "tokens": {e: int(stats[3, j]) for j, e in enumerate(exits)},
    }
