"""Counting token frequencies for reduced-vocabulary draft heads, on calibration data or the model's own output.

``count_tokens`` makes the ``layerskip_core.draft_vocab.TokenCounts`` that ``layerskip draft-vocab`` writes;
``heldout_tokens`` gives the target tokens a subset's coverage is measured on. Both decode with the engine
(plain autoregressive decoding), which is why they live apart from the file formats in ``layerskip_core.draft_vocab``
that the drafters import.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence

from tqdm.auto import tqdm

from infer.decode.engine import DecodeConfig
from layerskip_core.draft_vocab import MODES, TokenCounts, model_record, special_ids
from layerskip_core.errors import UserError
from layerskip_core.prompts import PromptItem, use_chat_template


def text_tokens(item: PromptItem, tokenizer) -> list[int]:
    """Token ids of an item's text: the prompt, then its reference answer where the set has one."""
    text = item.prompt + ("\n" + item.reference if item.reference else "")
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


def encode_prompts(model, items: Sequence[PromptItem], max_new_tokens: int, chat: str = "auto") -> list[list[int]]:
    """Token ids of the items' prompts (chat template per the prompt set's task policy); refuses, naming them, the
    prompts that leave no room for ``max_new_tokens`` in the model's context."""
    prompts = [model.encode(item.prompt, use_chat_template(item.task, chat, model.tokenizer)) for item in items]
    limit = model.runner.spec.max_position_embeddings
    long = [f"{item.task}/{item.id}" for item, ids in zip(items, prompts, strict=True)
            if len(ids) + max_new_tokens > limit]
    if long:
        raise UserError(f"prompts {', '.join(long[:5])}{' ...' if len(long) > 5 else ''} leave no room for "
                        f"{max_new_tokens} new tokens in the model's context of {limit}; lower --max-new-tokens "
                        "or use shorter prompts")
    return prompts


def greedy_generations(model, items: Sequence[PromptItem], max_new_tokens: int, chat: str = "auto",
                       progress: bool = False, desc: str = "generating") -> list[list[int]]:
    """The model's own greedy output for each item (prompt excluded; cut at EOS), plain autoregressive decoding.

    ``model`` is an ``infer.loading.LoadedModel``; ``chat`` is the task policy of ``layerskip_core.prompts``
    (``auto``: the chat template for question-answer sets such as gsm8k).
    """
    prompts = encode_prompts(model, items, max_new_tokens, chat)
    config = DecodeConfig(max_new_tokens=max_new_tokens)
    with model.engine("autoregressive") as engine:
        return [engine.generate(ids, config).tokens for ids in tqdm(prompts, desc=desc, disable=not progress,
                                                                     unit="prompt")]


def count_tokens(model, items: Sequence[PromptItem], mode: str = "generate", *, max_new_tokens: int = 128,
                 chat: str = "auto", text_items: Sequence[PromptItem] | None = None, progress: bool = False,
                 source: dict | None = None) -> TokenCounts:
    """Count token frequencies on calibration items (``model``: an ``infer.loading.LoadedModel``).

    ``generate``: the model's greedy generations on the items' prompts, the generated tokens only (a drafter
    predicts continuations, never prompt tokens; VocabTrim found the target's own output a better guide
    than raw text), with the tokens of ``text_items`` (default: the items) as the tie-breaking back-off.
    ``text``: the tokens of the items' texts (prompt and reference answer). ``source`` adds provenance.
    """
    if mode not in MODES:
        raise UserError(f"--mode must be one of {', '.join(MODES)}, got {mode!r}")
    start = time.perf_counter()
    texts = items if mode == "text" or text_items is None else text_items
    text_counts = Counter(t for item in texts for t in text_tokens(item, model.tokenizer))
    info = {"mode": mode, "items": len(items), "text_items": len(texts), "text_tokens": sum(text_counts.values())}
    if mode == "text":
        counts, backoff = text_counts, Counter()
    else:
        outputs = greedy_generations(model, items, max_new_tokens, chat, progress, "counting")
        counts, backoff = Counter(t for out in outputs for t in out), text_counts
        info |= {"max_new_tokens": max_new_tokens, "chat": chat, "generated_tokens": sum(counts.values())}
    info["wall_time_s"] = round(time.perf_counter() - start, 1)
    return TokenCounts(dict(counts), dict(backoff), special_ids(model.tokenizer, model.eos_token_ids),
                       model_record(model.runner.identity(), model.tokenizer), (source or {}) | info)


def heldout_tokens(model, items: Sequence[PromptItem], max_new_tokens: int = 128, chat: str = "auto",
                   progress: bool = False) -> dict[str, list[int]]:
    """Held-out target tokens per task: the model's greedy generations on ``items`` (take them from the END
    of each set, which calibration leaves alone), since those are the tokens a drafter must predict."""
    outputs = greedy_generations(model, items, max_new_tokens, chat, progress, "held-out")
    by_task: dict[str, list[int]] = {}
    for item, out in zip(items, outputs, strict=True):
        by_task.setdefault(item.task, []).extend(out)
    return by_task
