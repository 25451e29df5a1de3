"""The GPU comparison's task quality of a model: loss on HumanEval prompts (and on the canonical solutions given
the prompt) and greedy GSM8K answer accuracy."""

from __future__ import annotations

import re
from pathlib import Path

from layerskip_core.device import parse_dtype, resolve_device
from layerskip_core.heldout import loss_sums, next_token_targets
from layerskip_core.prompts import load_prompts
from tools.gpu.compare_settings import CompareSettings


def answer_number(text: str) -> str | None:
    """The last number in a text (commas and a trailing dot dropped), as GSM8K answers are scored."""
    found = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
    if not found:
        return None
    value = found[-1].replace(",", "")
    return value[:-2] if value.endswith(".0") else value


def quality(model_path: Path, s: CompareSettings) -> dict:
    """Loss on HumanEval prompts (and on the canonical solutions given the prompt) and GSM8K accuracy."""
    import torch  # local: keeps gpu_compare's start-up (its --help, its refusals) torch-free
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = resolve_device(s.device)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=parse_dtype(s.dtype, device)).to(device).eval()
    tok = AutoTokenizer.from_pretrained(model_path)
    sums = {"prompt": [0.0, 0], "solution": [0.0, 0]}
    with torch.no_grad():
        for item in load_prompts("humaneval", s.humaneval_items):
            p_ids = tok(item.prompt)["input_ids"]
            s_ids = tok(item.reference, add_special_tokens=False)["input_ids"]
            ids = torch.tensor([p_ids + s_ids], device=device)  # (1, T)
            logits = model(ids).logits[0]  # (T, V): position t predicts token t+1
            targets = next_token_targets(ids)[0]  # (T,)
            for part, span in (("prompt", slice(0, len(p_ids) - 1)), ("solution", slice(len(p_ids) - 1, None))):
                nats, count = loss_sums(logits[span], targets[span])  # the one held-out loss
                sums[part][0] += float(nats)
                sums[part][1] += int(count)
        items = load_prompts("gsm8k", s.gsm8k_items)
        tok.padding_side = "left"
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        correct = 0
        for i in range(0, len(items), s.gsm8k_batch):
            chunk = items[i:i + s.gsm8k_batch]
            texts = [tok.apply_chat_template([{"role": "user", "content": it.prompt}], add_generation_prompt=True,
                                             tokenize=False) for it in chunk]
            enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)  # (B, T)
            out = model.generate(**enc, max_new_tokens=s.gsm8k_tokens, do_sample=False, pad_token_id=pad)
            answers = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            for it, answer in zip(chunk, answers, strict=True):
                expected = answer_number(it.reference.rpartition("####")[2])
                correct += int(expected is not None and answer_number(answer) == expected)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"humaneval_prompt_loss": sums["prompt"][0] / max(1, sums["prompt"][1]),
            "humaneval_solution_loss": sums["solution"][0] / max(1, sums["solution"][1]),
            "humaneval_items": s.humaneval_items or 164, "gsm8k_accuracy": correct / len(items),
            "gsm8k_items": len(items), "gsm8k_max_new_tokens": s.gsm8k_tokens}
