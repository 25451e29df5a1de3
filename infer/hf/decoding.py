"""Our drafters inside transformers' own ``generate`` (transformers 5.x ``custom_generate``).

    from infer import hf_generate
    out = model.generate(**inputs, custom_generate=hf_generate("early_exit", exit_layer=8), max_new_tokens=64)

``hf_generate(drafter, **options)`` returns a callable that ``generate`` runs as its decoding loop after its usual
input preparation: the same engine and drafters as ``layerskip generate`` (same names and options), over a runner
built on the model's own weights. The folder form, for code that passes a path (``custom_generate=FOLDER,
trust_remote_code=True, drafter="swift"``), is ``FOLDER`` (``infer/hf/custom_generate_folder``).

Every argument ``generate`` can hand it is honoured or refused in one line naming it (``infer.hf.contract`` holds
the table; docs/HF_GENERATE.md shows it). Honoured: greedy and sampling, every stateless logits processor
(temperature, top-k/p, min-p, repetition penalty, no-repeat n-grams, min length, bad words, a caller's own, ...)
applied at each verified position with the prefix that position sees, every stopping criterion (EOS, max length,
max time, stop strings, a caller's own) asked after each committed token as ``generate`` asks it, left-padded
batches, ``num_return_sequences``, a streamer (given to ``generate`` or to ``hf_generate``; it always gets
``end()``, also when decoding raises), and ``return_dict_in_generate`` (with our ``stats``). Greedy output equals
plain ``generate`` with the same processors and criteria; sampling is exact against the processed distribution but
draws differently from transformers (its seed comes from torch's global RNG, so ``torch.manual_seed`` makes it
repeatable). transformers 5.24 hands a callable neither the ``streamer``, ``assistant_model`` nor the tokenizer
that ``generate`` got: the first two are read from the running ``generate`` call; for ``stop_strings`` pass
``hf_generate(..., stop_strings=[...], tokenizer=tok)`` (the folder form takes them as ``generate`` keywords).

Weights: the runner uses the model's tensors where its layout equals theirs and fuses q/k/v and gate/up into single
matrices; where it keeps plain matrices in the model's dtype and on its device (the kernel's AVX2 path, torch's), the
model's q/k/v, gate/up, o and down parameters are then pointed at the runner's matrices (same values), so no matrix
is held twice. It holds copies too: the norm weights on every path, every matrix packed in panels on the kernel's
AVX-512 path (the model keeps its own), a draft head's rows and a copied prefix; where the runner needs another dtype
or device than the model's (``dtype=``/``device=``), every weight. The runner is kept per model and settings, for
every callable on that model (one reused, one written inline per call, the folder form's: ``infer.hf.runners``),
and before every call the model's parameters are checked against what it was built from (each parameter object,
its version counter, storage, shape, dtype and device, and a sample of its values: well under a millisecond): after
``load_state_dict``, an optimizer step (fused ones included), ``param.data = ...`` or ``model.to(...)`` the runner
and every drafter's copy are built again from the weights as they are, and the output equals plain ``generate`` of
the changed model. A write the check cannot see (through ``param.data`` or from outside torch, to a few values it
does not sample) needs ``infer.hf.runners.release(model)``; it also frees a kept runner's memory.
"""

from __future__ import annotations

import inspect
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from transformers import GenerationMixin, PreTrainedModel
from transformers.generation import (
    GenerateDecoderOnlyOutput,
    LogitsProcessorList,
    StoppingCriteriaList,
    StopStringCriteria,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from infer.decode.engine import DecodeConfig, Engine, start_rows
from infer.drafters import ResolvedSpec, Spec, drafter_spec
from infer.hf import runners
from infer.hf.contract import (
    check_config,
    check_generate_arguments,
    check_model_inputs,
    check_positions,
    check_processors,
)
from infer.hf.rows import RowProcessor, RowRun, lockstep
from infer.hf.runners import RunnerSettings
from infer.model.runner import Runner
from infer.model.sampling import SamplingConfig
from layerskip_core.errors import UserError
from layerskip_core.settings import resolve_compile, resolve_executor

FOLDER = Path(__file__).resolve().parent / "custom_generate_folder"
"""The folder form: ``model.generate(..., custom_generate=str(FOLDER), trust_remote_code=True, drafter=...)``."""

FAST_WARPERS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
"""Warpers the engine applies itself on the device (``SamplingConfig``: temperature, then top-k, then top-p) when they
are the only processors, each at most once, in an order that computes the same distribution (``fast_sampling``)."""

@dataclass
class LayerSkipGenerateOutput(GenerateDecoderOnlyOutput):
    """What ``generate(..., return_dict_in_generate=True)`` returns, plus our statistics per row (``cache`` is None:
    the runner's KV cache is its own, not a transformers cache)."""

    stats: tuple | None = None
    """One ``infer.GenerationStats`` per output row (acceptance, tokens per verification, timings, ...)."""


def hf_generate(drafter: str = "autoregressive", *, tokenizer=None, streamer=None, stop_strings=None,
                dtype: torch.dtype | None = None, device: str | torch.device | None = None, executor: str = "auto",
                compile: bool | None = None, **options) -> HFGenerate:
    """A ``custom_generate`` callable decoding with ``drafter`` and its ``options`` (as in ``LoadedModel.engine``).

    ``tokenizer``: the model's, to resolve a ``draft_vocab`` by tokenizer (a checkpoint of the default model uses
    the counts shipped for it) and for ``stop_strings``. ``streamer``: receives the prompt, each committed token,
    then ``end()`` (or give it to ``generate``; not to both). ``stop_strings``: stop after any of these strings, as
    ``generate(stop_strings=...)`` would (which transformers refuses for a callable: it does not pass it the
    tokenizer). ``dtype``/``device``: run the runner elsewhere than the model (a copy of the weights); default: the
    model's. ``executor``: 'auto' (CUDA graphs on CUDA, eager on CPU), 'eager', 'static' or 'graphs'; ``compile``:
    the static forwards through torch.compile (None: on CUDA). Both are resolved once the model's device is known."""
    try:
        spec = drafter_spec(drafter, dict(options))  # an unknown drafter or a bad option is refused here
        criteria = stop_string_criteria(stop_strings, tokenizer)
    except UserError:
        if streamer is not None:  # its consumer must not wait for a generation that will not come
            streamer.end()
        raise
    return HFGenerate(spec, tokenizer, streamer, dtype, device, executor, compile, criteria)


def stop_string_criteria(stop_strings, tokenizer) -> list:
    """``[StopStringCriteria]`` for ``stop_strings`` (a string or a list), [] for none."""
    if not stop_strings:
        return []
    if tokenizer is None:
        raise UserError("stop_strings need the model's tokenizer: hf_generate(..., stop_strings=[...], tokenizer=tok)")
    return [StopStringCriteria(tokenizer, [stop_strings] if isinstance(stop_strings, str) else list(stop_strings))]


class HFGenerate:
    """The decoding loop transformers' ``generate`` calls (see the module docstring); build it with
    ``hf_generate``."""

    def __init__(self, spec: Spec, tokenizer, streamer, dtype, device, executor: str,
                 compile: bool | None = None, criteria: list | None = None):
        self.spec = spec
        self.tokenizer = tokenizer
        self.streamer = streamer
        self.criteria = criteria or []
        self.runner_settings = (dtype, device, executor, compile)

    def __call__(self, model: PreTrainedModel, input_ids: Tensor, logits_processor=None, stopping_criteria=None,
                 generation_config=None, synced_gpus: bool = False, streamer=None, **model_kwargs):
        arguments = generate_arguments(model)
        given = streamer if streamer is not None else arguments.get("streamer")  # generate has put the prompt in it
        streamers = [s for s in dict.fromkeys((given, self.streamer)) if s is not None]
        try:
            config = generation_config if generation_config is not None else model.generation_config
            check_generate_arguments({**arguments, "synced_gpus": synced_gpus or arguments.get("synced_gpus")})
            check_config(config)
            check_processors(logits_processor)
            check_model_inputs(model_kwargs)
            if len(streamers) > 1:
                raise UserError("a streamer was given both to generate and to hf_generate; give it to one of them")
            if streamers and input_ids.shape[0] > 1:
                raise UserError(f"a streamer takes one sequence, got a batch of {input_ids.shape[0]}")
            if streamers and given is None:
                streamers[0].put(input_ids[0].cpu())
            processors = LogitsProcessorList(logits_processor or ())
            criteria = [*(stopping_criteria or ()), *self.criteria]
            rows = unpadded_rows(input_ids, model_kwargs.get("attention_mask"))
            check_positions(model_kwargs.get("position_ids"), [len(padding) for padding, _ in rows])
            streamer = streamers[0] if streamers else None
            return self.decode(model, input_ids, processors, criteria, config, rows, streamer)
        finally:
            for s in streamers:  # always: a consumer waiting on the streamer must not wait forever
                s.end()

    def decode(self, model: PreTrainedModel, input_ids: Tensor, processors: list, criteria: list, config,
               rows: list[tuple[list[int], list[int]]], streamer):
        """Decode every row ((left padding, prompt) each; ``infer.hf.rows``); the (B, P + new) sequences or the
        output dataclass."""
        B, P = input_ids.shape
        max_length = config.max_length if config.max_length is not None else P + 20
        if max_length <= P:
            raise UserError(f"max_length {max_length} leaves no room after the prompt's {P} tokens; set max_new_tokens")
        criteria = StoppingCriteriaList(criteria)
        eos = eos_ids(criteria)
        pad = pad_id(config, eos)
        fast = fast_sampling(processors)
        decode = DecodeConfig(max_new_tokens=max_length - P, sampling=sampling_config(config, processors))
        runner = self.runner_for(model)
        resolved = self.spec.resolve(runner, self.tokenizer)  # once per call
        with ExitStack() as stack:
            runs = []
            for r, (padding, prompt) in enumerate(rows):
                engine = stack.enter_context(self.engine(runner, eos, resolved))  # a drafter per row
                processor = None if fast else RowProcessor(processors, r, B, padding)
                gen = engine.admit(prompt, decode, row_generator(runner, decode), processor=processor)
                runs.append(RowRun(engine, gen))
            start_rows([(run.engine, run.gen) for run in runs])  # the rows' prompts prefilled together
            sequences = lockstep(runs, input_ids, criteria, pad, decode.max_new_tokens, streamer)
            stats = tuple(run.close().stats for run in runs)
        if not config.return_dict_in_generate:
            return sequences
        return LayerSkipGenerateOutput(sequences=sequences, stats=stats)

    def engine(self, runner: Runner, eos: tuple[int, ...], resolved: ResolvedSpec | None = None) -> Engine:
        """A fresh drafter on ``runner`` (as ``LoadedModel.engine``: a ``draft_vocab`` resolved with the tokenizer);
        ``resolved``: the spec already resolved for ``runner`` (rows of one call share it)."""
        if resolved is None:
            resolved = self.spec.resolve(runner, self.tokenizer)
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        return Engine(runner, resolved.build(runner), eos, decode)

    def runner_for(self, model: PreTrainedModel) -> Runner:
        """The runner over ``model``'s weights as they are now (``infer.hf.runners``: kept per model and settings
        across callables, built again when the weights changed, its matrices shared with the model)."""
        dtype, device, executor, compile = self.runner_settings
        first = next(model.parameters())
        dtype = dtype or first.dtype
        device = torch.device(device) if device is not None else first.device
        settings = RunnerSettings(dtype, device, resolve_executor(executor, device), resolve_compile(compile, device))
        return runners.runner_for(model, settings)


def generate_arguments(model: PreTrainedModel) -> dict:
    """``streamer``, ``assistant_model`` and ``synced_gpus`` of the ``GenerationMixin.generate`` call running this
    callable (transformers 5.x does not pass them on to a ``custom_generate`` callable); {} outside one."""
    code = inspect.unwrap(GenerationMixin.generate).__code__
    frame = inspect.currentframe().f_back
    while frame is not None:
        if frame.f_code is code and frame.f_locals.get("self") is model:
            return {k: frame.f_locals.get(k) for k in ("streamer", "assistant_model", "synced_gpus")}
        frame = frame.f_back
    return {}


def fast_sampling(processors) -> bool:
    """Whether ``processors`` (in the order ``generate`` applies them: a caller's own first, then the config's) compute
    what ``SamplingConfig`` computes: only temperature, top-k and top-p warpers keeping one token at least, each at
    most once (two temperatures multiply, which one value does not say), in ``SamplingConfig``'s order (temperature,
    top-k, top-p). Order matters even between temperature and top-k: two fp32 scores one ulp apart can round to one
    value once divided by a temperature, and a top-k after the division keeps both where one before it kept one.
    Anything else runs through the processors themselves."""
    if any(type(p) not in FAST_WARPERS or getattr(p, "min_tokens_to_keep", 1) != 1 for p in processors):
        return False
    order = [FAST_WARPERS.index(type(p)) for p in processors]
    return len(set(order)) == len(order) and order == sorted(order)


def sampling_config(config, processors) -> SamplingConfig:
    """Greedy unless ``do_sample``; then the temperature, top-k and top-p that ``generate`` prepared (exact classes
    only; with other processors they shape the drafts while the target samples from the processed scores)."""
    if not config.do_sample:
        return SamplingConfig()
    values = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    for processor in processors:
        if type(processor) in FAST_WARPERS:
            for name in values:
                if hasattr(processor, name):
                    values[name] = getattr(processor, name)
    return SamplingConfig(**values)


def row_generator(runner: Runner, decode: DecodeConfig) -> torch.Generator | None:
    """Sampling: a generator per row seeded from torch's global RNG (so repeated rows of ``num_return_sequences``
    differ, and ``torch.manual_seed`` makes a generation repeatable); None when greedy."""
    if decode.sampling.greedy:
        return None
    return torch.Generator(device=runner.device).manual_seed(int(torch.randint(0, 2**62, (1,))))


def eos_ids(criteria) -> tuple[int, ...]:
    """The end-of-sequence ids of the criteria's EOS stops (the engine ends a row at them, as the criteria do)."""
    ids: list[int] = []
    for criterion in criteria:
        eos = getattr(criterion, "eos_token_id", None)
        if eos is not None:
            ids += torch.as_tensor(eos).reshape(-1).tolist()
    return tuple(dict.fromkeys(int(t) for t in ids))


def pad_id(config, eos: tuple[int, ...]) -> int:
    """The id finished rows are padded with: generate's prepared pad token (the first EOS id when none is set)."""
    pad = getattr(config, "_pad_token_tensor", None)
    if pad is None:
        pad = config.pad_token_id
    if pad is None:
        return eos[0] if eos else 0
    return int(torch.as_tensor(pad).reshape(-1)[0])


def unpadded_rows(input_ids: Tensor, attention_mask: Tensor | None) -> list[tuple[list[int], list[int]]]:
    """Each row's (left padding, prompt); right padding is refused."""
    if attention_mask is None:
        return [([], ids) for ids in input_ids.tolist()]
    rows = []
    for ids, mask in zip(input_ids.tolist(), attention_mask.tolist(), strict=True):
        start = mask.index(1) if 1 in mask else len(mask)
        if not all(mask[start:]) or start == len(mask):
            raise UserError("hf_generate needs left padding (tokenizer.padding_side = 'left') and a non-empty prompt "
                            "per row")
        rows.append((ids[:start], ids[start:]))
    return rows
