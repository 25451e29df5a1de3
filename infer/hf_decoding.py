"""Our drafters inside transformers' own ``generate`` (transformers 5.x ``custom_generate``).

    from infer import hf_generate
    out = model.generate(**inputs, custom_generate=hf_generate("early_exit", exit_layer=8), max_new_tokens=64)

``hf_generate(drafter, **options)`` returns a callable that ``generate`` runs as its decoding loop after its usual
input preparation: the same engine and drafters as ``layerskip generate`` (same names and options), over a runner
built on the model's own weights. The folder form, for code that passes a path (``custom_generate=FOLDER,
trust_remote_code=True, drafter="swift"``), is ``FOLDER`` (``infer/hf_custom_generate``).

What it honours: greedy and sampling (``do_sample``, temperature, top-k, top-p), EOS, ``max_new_tokens`` /
``max_length``, a left-padded batch (each row is decoded on its own), ``num_return_sequences``, a streamer, and
``return_dict_in_generate`` (the output also carries our ``stats``, one ``GenerationStats`` per row). What it
cannot: any other logits processor or stopping criterion (repetition penalty, min length, bad words, stop strings,
max time, ...), beams, assistant models, per-step scores/logits/attentions/hidden states, a prefilled cache, and
``inputs_embeds``; each is refused in one line (``UserError``) before anything is decoded. Sampling follows the
target distribution exactly but draws differently from transformers (its seed comes from torch's global RNG, so
``torch.manual_seed`` makes it repeatable). transformers 5.24 does not hand a callable ``custom_generate`` the
``streamer`` given to ``generate``: pass it as ``hf_generate(..., streamer=s)`` (the folder form forwards it).

Weights: the runner uses the model's tensors where its layout equals theirs (embeddings, norms, o/down
projections, a tied LM head) and fuses q/k/v and gate/up into single matrices; the model's q/k/v and gate/up
parameters are then pointed at row slices of those fused matrices (same values), so the model and the runner
share every weight and nothing is held twice. Where the runner needs another dtype or device than the model's
(``dtype=``/``device=`` options), it holds its own copy. The runner is built once per model and reused by this
callable; in-place changes to the model's weights (``load_state_dict``, an optimizer step) reach it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from transformers import PreTrainedModel
from transformers.generation import (
    EosTokenCriteria,
    GenerateDecoderOnlyOutput,
    MaxLengthCriteria,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from infer.drafters import Spec, drafter_spec
from infer.engine import DecodeConfig, Engine
from infer.runner import Runner
from infer.sampling import SamplingConfig
from layerskip_core.errors import UserError
from layerskip_core.settings import resolve_compile, resolve_executor

FOLDER = Path(__file__).resolve().parent / "hf_custom_generate"
"""The folder form: ``model.generate(..., custom_generate=str(FOLDER), trust_remote_code=True, drafter=...)``."""

UNSUPPORTED_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")
"""Generation-config flags asking for per-step tensors, which the draft-verify loop does not produce."""

FUSED = {"self_attn.q_proj": ("qkv", 0), "self_attn.k_proj": ("qkv", 1), "self_attn.v_proj": ("qkv", 2),
         "mlp.gate_proj": ("gate_up", 0), "mlp.up_proj": ("gate_up", 1)}
"""Model projection -> (the runner's fused matrix, its index among the parts fused in it)."""


@dataclass
class LayerSkipGenerateOutput(GenerateDecoderOnlyOutput):
    """What ``generate(..., return_dict_in_generate=True)`` returns, plus our statistics per row."""

    stats: tuple | None = None
    """One ``infer.GenerationStats`` per output row (acceptance, tokens per verification, timings, ...)."""


def hf_generate(drafter: str = "autoregressive", *, tokenizer=None, streamer=None, dtype: torch.dtype | None = None,
                device: str | torch.device | None = None, executor: str = "auto", compile: bool | None = None,
                **options) -> HFGenerate:
    """A ``custom_generate`` callable decoding with ``drafter`` and its ``options`` (as in ``LoadedModel.engine``).

    ``tokenizer``: the model's, to resolve a ``draft_vocab`` by tokenizer (a checkpoint of the default model uses
    the counts shipped for it). ``streamer``: receives the prompt, the tokens as they are accepted, then ``end()``.
    ``dtype``/``device``: run the runner elsewhere than the model (a copy of the weights); default: the model's.
    ``executor``: 'auto' (CUDA graphs on CUDA, eager on CPU), 'eager', 'static' or 'graphs'; ``compile``: the static
    forwards through torch.compile (None: on CUDA). Both are resolved once the model's device is known."""
    spec = drafter_spec(drafter, dict(options))  # an unknown drafter or a bad option is refused here, not mid-generate
    return HFGenerate(spec, tokenizer, streamer, dtype, device, executor, compile)


class HFGenerate:
    """The decoding loop transformers' ``generate`` calls (see the module docstring); build it with
    ``hf_generate``."""

    def __init__(self, spec: Spec, tokenizer, streamer, dtype, device, executor: str, compile: bool | None = None):
        self.spec = spec
        self.tokenizer = tokenizer
        self.streamer = streamer
        self.runner_settings = (dtype, device, executor, compile)
        self.runners: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __call__(self, model: PreTrainedModel, input_ids: Tensor, logits_processor=None, stopping_criteria=None,
                 generation_config=None, synced_gpus: bool = False, streamer=None, **model_kwargs):
        config = generation_config if generation_config is not None else model.generation_config
        own_streamer = streamer is None  # a streamer given to generate() has had the prompt from it already
        streamer = self.streamer if own_streamer else streamer
        check_supported(config, logits_processor, stopping_criteria, input_ids, model_kwargs, streamer)
        max_length = config.max_length if config.max_length is not None else input_ids.shape[1] + 20
        if max_length <= input_ids.shape[1]:
            raise UserError(f"max_length {max_length} leaves no room after the prompt's {input_ids.shape[1]} "
                            "tokens; set max_new_tokens")
        decode = DecodeConfig(max_new_tokens=max_length - input_ids.shape[1],
                              sampling=sampling_config(config, logits_processor))
        eos = eos_ids(config)
        if streamer is not None and own_streamer:
            streamer.put(input_ids[0].cpu())
        with self.engine(self.runner_for(model), eos) as engine:
            results = [run_row(engine, row, decode, streamer)
                       for row in unpadded_rows(input_ids, model_kwargs.get("attention_mask"))]
        if streamer is not None:
            streamer.end()
        pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else 0)
        sequences = assemble(input_ids, [r.tokens for r in results], pad)
        if not config.return_dict_in_generate:
            return sequences
        return LayerSkipGenerateOutput(sequences=sequences, stats=tuple(r.stats for r in results))

    def engine(self, runner: Runner, eos: tuple[int, ...]) -> Engine:
        """A fresh drafter on ``runner`` (as ``LoadedModel.engine``: a ``draft_vocab`` resolved with the tokenizer)."""
        drafter = self.spec.resolve(runner, self.tokenizer)
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        return Engine(runner, drafter.build(runner), eos, decode)

    def runner_for(self, model: PreTrainedModel) -> Runner:
        """The runner over ``model``'s weights: built (and its weights shared with the model) on first use."""
        dtype, device, executor, compile = self.runner_settings
        first = next(model.parameters())
        want = (dtype or first.dtype, torch.device(device) if device is not None else first.device)
        runner = self.runners.get(model)
        if runner is None or (runner.dtype, runner.device) != want:
            runner = Runner.from_model(model, dtype=want[0], device=want[1],
                                       executor=resolve_executor(executor, want[1]),
                                       compile=resolve_compile(compile, want[1]))
            share_weights(model, runner)
            self.runners[model] = runner
        return runner


def check_supported(config, processors, criteria, input_ids: Tensor, model_kwargs: dict, streamer) -> None:
    """Refuse, in one line, what the draft-verify loop does not implement (see the module docstring)."""
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise UserError("custom_generate=hf_generate(...) needs input_ids (inputs_embeds alone are not supported)")
    if (config.num_beams or 1) > 1:
        raise UserError(f"num_beams={config.num_beams}: beam search is not supported by hf_generate; use num_beams=1")
    for flag in UNSUPPORTED_OUTPUTS:
        if getattr(config, flag, False):
            raise UserError(f"{flag}=True is not supported by hf_generate (a draft-verify loop has no per-step "
                            "tensors); drop it, or use plain generate")
    for processor in processors or ():
        if not isinstance(processor, (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)):
            raise UserError(f"the logits processor {type(processor).__name__} is not supported by hf_generate "
                            "(temperature, top_k and top_p are); drop it, or use plain generate")
    for criterion in criteria or ():
        if not isinstance(criterion, (MaxLengthCriteria, EosTokenCriteria)):
            raise UserError(f"the stopping criterion {type(criterion).__name__} is not supported by hf_generate "
                            "(max_length/max_new_tokens and EOS are); drop it, or use plain generate")
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if cache is not None and cache.get_seq_length() > 0:
        raise UserError("a prefilled cache is not supported by hf_generate; pass the whole prompt as input_ids")
    if streamer is not None and input_ids.shape[0] > 1:
        raise UserError(f"a streamer takes one sequence, got a batch of {input_ids.shape[0]}")


def sampling_config(config, processors) -> SamplingConfig:
    """Greedy unless ``do_sample``; then the temperature, top-k and top-p that ``generate`` prepared, with a seed
    drawn from torch's global RNG (``torch.manual_seed`` makes a sampled generation repeatable)."""
    if not config.do_sample:
        return SamplingConfig()
    values = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    for processor in processors or ():
        for name in values:
            if hasattr(processor, name):
                values[name] = getattr(processor, name)
    return SamplingConfig(**values, seed=int(torch.randint(0, 2**62, (1,))))


def eos_ids(config) -> tuple[int, ...]:
    """The generation config's end-of-sequence ids."""
    eos = config.eos_token_id
    if eos is None:
        return ()
    if isinstance(eos, Tensor):
        eos = eos.tolist()
    return tuple(int(t) for t in ([eos] if isinstance(eos, int) else eos))


def unpadded_rows(input_ids: Tensor, attention_mask: Tensor | None) -> list[list[int]]:
    """Each row's prompt without its left padding; right padding is refused."""
    if attention_mask is None:
        return input_ids.tolist()
    rows = []
    for ids, mask in zip(input_ids.tolist(), attention_mask.tolist(), strict=True):
        start = mask.index(1) if 1 in mask else len(mask)
        if not all(mask[start:]) or start == len(mask):
            raise UserError("hf_generate needs left padding (tokenizer.padding_side = 'left') and a non-empty prompt "
                            "per row")
        rows.append(ids[start:])
    return rows


def run_row(engine: Engine, prompt: list[int], config: DecodeConfig, streamer):
    """Decode one prompt; accepted tokens go to ``streamer`` as they come (cut at EOS and the token budget)."""
    generator = None
    if not config.sampling.greedy:  # one seed per row, so repeated rows (num_return_sequences) differ
        generator = torch.Generator(device=engine.runner.device).manual_seed(int(torch.randint(0, 2**62, (1,))))
    gen = engine.start(prompt, config, generator)
    sent = 0
    while True:
        if streamer is not None:
            sent = stream_new(streamer, gen.tokens, sent, engine.eos, config.max_new_tokens)
        if gen.done:
            return engine.finish(gen)
        engine.step(gen)


def stream_new(streamer, tokens: list[int], sent: int, eos: frozenset[int], limit: int) -> int:
    """Put ``tokens[sent:]`` up to the first EOS and ``limit`` into ``streamer``; returns how many are sent."""
    end = min(len(tokens), limit)
    for i in range(sent, end):
        if tokens[i] in eos:
            end = i + 1
            break
    if end > sent:
        streamer.put(torch.tensor(tokens[sent:end]))
    return max(end, sent)


def assemble(input_ids: Tensor, outputs: list[list[int]], pad: int) -> Tensor:
    """(B, P + longest output): each prompt row as given, then its tokens, then ``pad`` (as ``generate`` pads)."""
    B, P = input_ids.shape
    out = torch.full((B, P + max(map(len, outputs))), pad, dtype=input_ids.dtype, device=input_ids.device)
    out[:, :P] = input_ids
    for i, tokens in enumerate(outputs):
        out[i, P:P + len(tokens)] = torch.tensor(tokens, dtype=input_ids.dtype)
    return out


def share_weights(model: PreTrainedModel, runner: Runner) -> int:
    """Point ``model``'s q/k/v and gate/up parameters at row slices of the runner's fused matrices, which hold the
    same values, so the separate copies are freed; returns the bytes no longer held twice. Parameters in another
    dtype or on another device than the runner's keep their own storage."""
    freed = 0
    for i, layer in enumerate(runner.layers):
        prefix = layer_prefix(model, i)
        for fused_name in ("qkv", "gate_up"):
            fused = getattr(layer, fused_name)
            parts = [(n, model.get_submodule(prefix + n)) for n, (f, _) in FUSED.items() if f == fused_name]
            for kind, matrix in (("weight", fused.weight), ("bias", getattr(fused, "bias", None))):
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
