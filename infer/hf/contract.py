"""What ``hf_generate`` does with every argument transformers' ``generate`` can hand it: honoured, refused in one
line, or harmless to leave aside (each with why). ``docs/HF_GENERATE.md`` shows the same table; a test walks the
installed transformers' ``GenerationConfig`` fields so a new one cannot slip through unclassified.

Logits processors and stopping criteria are matched by their exact class (``type(x) is``): a subclass of a
transformers class is a caller's own, and its own ``__call__`` runs.
"""

from __future__ import annotations

from transformers import generation as g

from layerskip_core.errors import UserError

HONOURED, REFUSED, HARMLESS = "honoured", "refused", "harmless"

PROCESSOR_FIELDS = ("min_length", "min_new_tokens", "repetition_penalty", "encoder_repetition_penalty",
                    "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids", "sequence_bias",
                    "suppress_tokens", "begin_suppress_tokens", "forced_bos_token_id", "forced_eos_token_id",
                    "remove_invalid_values", "exponential_decay_length_penalty", "renormalize_logits", "temperature",
                    "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h",
                    "watermarking_config")
"""Fields that ``generate`` turns into logits processors: applied at every verified position."""

ASSISTED_SETTINGS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
                     "assistant_lookbehind", "target_lookbehind", "max_matching_ngram_size",
                     "assistant_ensemble_weight")
"""Settings of transformers' assisted decoding, used only once an assistant is chosen (which is refused)."""

FIELDS: dict[str, tuple[str, str]] = {
    **{f: (HONOURED, "its logits processor runs at every verified position, with the prefix that position sees")
       for f in PROCESSOR_FIELDS},
    **{f: (HARMLESS, "a setting of assisted decoding, which only an assistant model, prompt lookup or "
                     "assistant_early_exit would start (all refused); model configs carry defaults")
       for f in ASSISTED_SETTINGS},
    "max_length": (HONOURED, "the token budget (MaxLengthCriteria, padded prompt length included)"),
    "max_new_tokens": (HONOURED, "the token budget"),
    "do_sample": (HONOURED, "greedy or speculative sampling (exact against the processed distribution)"),
    "eos_token_id": (HONOURED, "EosTokenCriteria: the end-of-sequence stop, finished rows padded as generate pads"),
    "pad_token_id": (HONOURED, "pads finished rows of a batch"),
    "max_time": (HONOURED, "MaxTimeCriteria, evaluated after every committed token"),
    "stop_strings": (HONOURED, "StopStringCriteria, evaluated after every committed token (the callable form "
                               "takes them as hf_generate(stop_strings=..., tokenizer=...))"),
    "num_return_sequences": (HONOURED, "rows repeated by generate; each row draws its own tokens"),
    "return_dict_in_generate": (HONOURED, "LayerSkipGenerateOutput: sequences and our stats; its cache is None"),
    "token_healing": (REFUSED, "generate heals the prompt before the decoding loop and needs the tokenizer for it, "
                               "which it does not keep for a custom loop; heal first: "
                               "ids = model.heal_tokens(ids, tokenizer)"),
    "num_beams": (REFUSED, "beam search is another decoding algorithm"),
    "num_beam_groups": (REFUSED, "group beam search is another decoding algorithm"),
    "diversity_penalty": (REFUSED, "a setting of group beam search"),
    "constraints": (REFUSED, "constrained beam search is another decoding algorithm"),
    "force_words_ids": (REFUSED, "constrained beam search is another decoding algorithm"),
    "penalty_alpha": (REFUSED, "contrastive search is another decoding algorithm"),
    "dola_layers": (REFUSED, "DoLa contrasts layers' logits: another decoding algorithm"),
    "low_memory": (REFUSED, "asks for the sequential form of contrastive/beam search, which hf_generate does not run"),
    "assistant_early_exit": (REFUSED, "transformers' own early-exit assistant; use hf_generate('early_exit', ...)"),
    "prompt_lookup_num_tokens": (REFUSED, "prompt-lookup drafting is not one of our drafters"),
    "use_mtp": (REFUSED, "multi-token-prediction drafting is not one of our drafters"),
    "speculation_type": (REFUSED, "another speculation method is not one of our drafters"),
    "is_assistant": (REFUSED, "marks the config of an assistant model inside assisted decoding"),
    "output_scores": (REFUSED, "a draft-verify loop has no per-step scores to return"),
    "output_logits": (REFUSED, "a draft-verify loop has no per-step logits to return"),
    "output_attentions": (REFUSED, "the runner computes no attention maps"),
    "output_hidden_states": (REFUSED, "the runner returns no per-step hidden states"),
    "guidance_scale": (REFUSED, "classifier-free guidance runs the model on a second prompt step by step"),
    "cache_implementation": (REFUSED, "the runner keeps its own KV cache; 'dynamic' and 'static' leave the tokens "
                                      "unchanged and are accepted, the others (quantized, offloaded, ...) refused"),
    "early_stopping": (HARMLESS, "a beam-search setting (beam search is refused); generate ignores it at 1 beam"),
    "length_penalty": (HARMLESS, "a beam-search setting (beam search is refused); generate ignores it at 1 beam"),
    "use_cache": (HARMLESS, "the runner always decodes with its KV cache; the tokens equal a recomputation's"),
    "cache_config": (HARMLESS, "a setting of cache_implementation (refused unless 'dynamic' or 'static')"),
    "max_cache_len": (HARMLESS, "the size of a static HF cache; the runner sizes its own"),
    "prefill_chunk_size": (HARMLESS, "chunked prefill bounds memory only; the tokens are the same"),
    "compile_config": (HARMLESS, "compiles transformers' forward; ours: hf_generate(compile=...)"),
    "disable_compile": (HARMLESS, "compiles transformers' forward; ours: hf_generate(compile=...)"),
    "continuous_batching_config": (HARMLESS, "only for cache_implementation='paged', which never reaches a "
                                             "custom_generate callable"),
    "bos_token_id": (HARMLESS, "used by generate to prepare inputs before it calls the decoding loop"),
    "decoder_start_token_id": (HARMLESS, "encoder-decoder models only; hf_generate takes decoder-only models"),
    "transformers_version": (HARMLESS, "metadata"),
    "_from_model_config": (HARMLESS, "metadata"),
}
"""Every ``GenerationConfig`` field -> (verdict, why)."""

NEUTRAL: dict[str, tuple] = {
    "num_beams": (None, 1), "num_beam_groups": (None, 1), "diversity_penalty": (None, 0.0),
    "penalty_alpha": (None, 0.0),
    "low_memory": (None, False), "use_mtp": (None, False), "is_assistant": (None, False),
    "output_scores": (None, False), "output_logits": (None, False), "output_attentions": (None, False),
    "output_hidden_states": (None, False), "guidance_scale": (None, 1.0), "token_healing": (None, False),
    "cache_implementation": (None, "dynamic", "static"),
}
"""Values of refused fields that ask for nothing (the field is refused only when set to something else)."""

STATELESS_PROCESSORS = {
    g.MinLengthLogitsProcessor, g.MinNewTokensLengthLogitsProcessor, g.RepetitionPenaltyLogitsProcessor,
    g.EncoderRepetitionPenaltyLogitsProcessor, g.NoRepeatNGramLogitsProcessor, g.EncoderNoRepeatNGramLogitsProcessor,
    g.NoBadWordsLogitsProcessor, g.SequenceBiasLogitsProcessor, g.SuppressTokensLogitsProcessor,
    g.SuppressTokensAtBeginLogitsProcessor, g.ForcedBOSTokenLogitsProcessor, g.ForcedEOSTokenLogitsProcessor,
    g.InfNanRemoveLogitsProcessor, g.ExponentialDecayLengthPenalty, g.LogitNormalization,
    g.PrefixConstrainedLogitsProcessor, g.WatermarkLogitsProcessor, g.TemperatureLogitsWarper, g.TopKLogitsWarper,
    g.TopPLogitsWarper, g.MinPLogitsWarper, g.TypicalLogitsWarper, g.EpsilonLogitsWarper, g.EtaLogitsWarper,
    g.TopHLogitsWarper,
}
"""transformers' processors that are functions of (input_ids, scores): each may run once per verified position, in
any order. Its other processors keep state across steps (classifier-free guidance, SynthID watermarking) or belong
to other model kinds (Whisper, Bark, Dia, MusicGen) and are refused."""

def check_config(config) -> None:
    """Refuse, in one line naming it, every field of the generation config that asks for what we do not run."""
    for name, (verdict, why) in FIELDS.items():
        value = getattr(config, name, None)
        if verdict == REFUSED and value not in NEUTRAL.get(name, (None,)):
            raise UserError(f"{name}={value!r} is not supported by hf_generate ({why}); drop it, or use plain generate")


def check_processors(processors) -> None:
    """Refuse transformers' processors that cannot run once per verified position (see STATELESS_PROCESSORS)."""
    for processor in processors or ():
        kind = type(processor)
        if kind.__module__.startswith("transformers.") and kind not in STATELESS_PROCESSORS:
            raise UserError(f"the logits processor {kind.__name__} keeps state across decoding steps (or is for "
                            "another kind of model), so hf_generate cannot apply it at every verified position; drop "
                            "it, or use plain generate")


def check_generate_arguments(arguments: dict) -> None:
    """Refuse ``generate`` keywords that transformers does not pass to a ``custom_generate`` callable but that would
    change the decoding (``arguments``: what ``generate`` was called with, where it can be seen)."""
    if arguments.get("assistant_model") is not None:
        raise UserError("assistant_model is not supported by hf_generate (our drafters draft with the model itself); "
                        "drop it, or use plain generate")
    if arguments.get("synced_gpus"):
        raise UserError("synced_gpus=True is not supported by hf_generate (it decodes on one device); drop it")


def check_model_inputs(model_kwargs: dict) -> None:
    """Refuse model inputs the runner does not take (inputs_embeds, a cache to fill or continue, extra inputs)."""
    if model_kwargs.get("inputs_embeds") is not None:
        raise UserError("inputs_embeds is not supported by hf_generate (the runner embeds token ids itself); pass "
                        "input_ids only")
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if cache is not None and (cache.get_seq_length() > 0 or getattr(cache, "_is_user_defined", False)):
        raise UserError("past_key_values is not supported by hf_generate (the runner keeps its own KV cache and "
                        "returns none); drop it and pass the whole prompt as input_ids")
    known = {"attention_mask", "position_ids", "logits_to_keep", "cache", "past_key_values", "use_cache"}
    extra = sorted(k for k, v in model_kwargs.items() if k not in known and v is not None)
    if extra:
        raise UserError(f"the model input {extra[0]} is not supported by hf_generate (it takes input_ids and an "
                        "attention mask); drop it, or use plain generate")


def check_positions(position_ids, paddings: list[int]) -> None:
    """Refuse position ids other than ``generate``'s own (0, 1, 2, ... from each row's first unpadded token): the
    runner numbers positions that way. ``paddings``: each row's left-padding length."""
    if position_ids is None:
        return
    for row, pad in zip(position_ids.expand(len(paddings), -1).tolist(), paddings, strict=True):
        if row[pad:] != list(range(len(row) - pad)):
            raise UserError("position_ids other than 0, 1, 2, ... from each row's first token are not supported by "
                            "hf_generate (the runner numbers positions that way); drop position_ids")
