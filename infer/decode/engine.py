"""The draft-verify loop: prefill, propose, verify in one forward, accept, roll back, stop.

``Engine.start`` prefills a prompt (``infer.decode.prefill``; ``start_rows`` prefills several engines' prompts
together), ``Engine.step`` runs one propose-verify-accept cycle and ``Engine.finish`` returns the result;
``Engine.generate`` is those three in a loop.
"""

from __future__ import annotations

import dataclasses
import numbers
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor

from infer.decode.cycle import CycleObserver, step_rows
from infer.decode.prefill import Prompt, prefill
from infer.decode.processing import PROCESSED, PositionProcessor
from infer.decode.stopping import StopRules, StopScan
from infer.drafters.base import DecodeState, Drafter, DrafterStats, VerifyOutcome
from infer.model.graphs import BUCKETS
from infer.model.kv_cache import capacity_bucket
from infer.model.program import Program, Rows
from infer.model.runner import Runner
from infer.model.sampling import SamplingConfig, select
from layerskip_core.errors import UserError
from layerskip_core.layers import check_exit_layer
from layerskip_core.options import check_fields


@dataclass(frozen=True)
class DecodeConfig:
    """When to stop and how to choose tokens (named apart from transformers' ``GenerationConfig``, which the
    transformers entry, ``infer.hf_generate``, reads and turns into one of these)."""

    max_new_tokens: int = 128
    """Generate at most this many tokens."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Greedy (temperature 0) or sampling settings."""
    stop_strings: tuple[str, ...] = ()
    """Stop at the first token that completes any of these in the decoded text (the output keeps it). Checked after
    every committed token in order, as plain decoding checks, so every drafter stops where plain decoding stops; a
    match may begin in the prompt's text but must end in a generated token's, as transformers' ``stop_strings``
    (``infer.decode.stopping``)."""
    stop_at_eos: bool = True
    """Stop at the model's end-of-sequence token(s)."""
    target_exit: int | None = None
    """Lossy early exit (the LayerSkip paper's "EE" rows): the target itself is layers [0, E) + final norm + LM head,
    so the output is that exit's, not the model's; only plain decoding (the autoregressive drafter) takes it.
    None (or E = the model's layer count) is the full model."""

    def __post_init__(self) -> None:
        check_fields(self, "DecodeConfig")
        if self.max_new_tokens < 1:
            raise UserError(f"max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.target_exit is not None and self.target_exit < 1:
            raise UserError(f"target-exit must be >= 1 (a layer count), got {self.target_exit}")
        if any(not s for s in self.stop_strings):
            raise UserError("a stop string must not be empty (it would end every output at once)")


def token_ids(prompt_ids) -> list[int]:
    """``prompt_ids`` (a sequence of ints or a 1-D integer tensor) as a list; anything else is a UserError."""
    if isinstance(prompt_ids, Tensor):
        if prompt_ids.dim() != 1 or prompt_ids.dtype.is_floating_point or prompt_ids.dtype == torch.bool:
            raise UserError(f"prompt_ids must be a 1-D integer tensor, got {prompt_ids.dim()}-D {prompt_ids.dtype}")
        return prompt_ids.tolist()
    if isinstance(prompt_ids, str | bytes) or not isinstance(prompt_ids, Sequence):
        raise UserError(f"prompt_ids must be a list of token ids, not {type(prompt_ids).__name__} (for text, use "
                        "LoadedModel.generate, or LoadedModel.encode first)")
    bad = [t for t in prompt_ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
    if bad:
        raise UserError(f"prompt_ids must hold integer token ids; got {bad[0]!r} ({type(bad[0]).__name__})")
    return [int(t) for t in prompt_ids]


@dataclass
class GenerationStats:
    """Counters and timings of one ``generate`` call (times in seconds)."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    verify_calls: int = 0
    drafted: int = 0
    accepted: int = 0
    wall_time: float = 0.0
    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    update_time: float = 0.0
    target_exit: int | None = None
    """Lossy early exit: the target's layer count E when it was not the full model (None: lossless)."""
    drafter: DrafterStats = field(default_factory=DrafterStats)
    """The drafter's own statistics (a dataclass per drafter; serialised by ``to_dict``)."""

    @property
    def lossy(self) -> bool:
        """The output is a lossy early exit's, not the full model's."""
        return self.target_exit is not None

    @property
    def acceptance_rate(self) -> float:
        """alpha: accepted / drafted tokens (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_verify(self) -> float:
        """M: tokens produced per verification forward (the prefill token excluded)."""
        return (self.new_tokens - 1) / self.verify_calls if self.verify_calls else 1.0

    @property
    def tokens_per_second(self) -> float:
        """End-to-end: new tokens / wall time including prefill."""
        return self.new_tokens / self.wall_time if self.wall_time > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(acceptance_rate=self.acceptance_rate, tokens_per_verify=self.tokens_per_verify,
                 tokens_per_second=self.tokens_per_second, lossy=self.lossy)
        return d


def tokens_per_verify(stats: Sequence[GenerationStats]) -> float | None:
    """M over many generations (the prefill token excluded); None when none verified anything."""
    calls = sum(s.verify_calls for s in stats)
    return sum(s.new_tokens - 1 for s in stats) / calls if calls else None


@dataclass
class GenerationResult:
    tokens: list[int]
    """Generated token ids (prompt excluded)."""
    finish_reason: str
    """'eos', 'length' or 'stop_string' ('criterion': ended by a caller's stopping criterion, ``infer.hf.rows``)."""
    stats: GenerationStats
    text: str | None = None


@dataclass
class Generation:
    """One sequence being generated: made by ``Engine.start``, advanced by ``Engine.step``."""

    state: DecodeState
    """The decoding state shared with the drafter (tokens, cache, sampling)."""
    config: DecodeConfig
    """The settings it was started with."""
    stats: GenerationStats
    """Counters and timings so far."""
    tokens: list[int]
    """Generated tokens so far (a step that commits several is cut at the first stop condition among them)."""
    stops: StopRules
    """Its stop conditions, asked after every committed token in order (``infer.decode.stopping``)."""
    finish_reason: str | None = None
    """None while running; then 'eos', 'length' or 'stop_string'."""
    started: float = 0.0
    """perf_counter() when the prefill began."""
    processor: PositionProcessor | None = None
    """Logits processing at every position the target scores (``infer.decode.processing``); None: the raw logits."""

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class Engine:
    """Runs one drafter against the full model; output is identical to plain decoding.

    ``DecodeConfig.target_exit`` E makes the *target* itself lossy: layers [0, E) + final norm + LM head
    (prefill and verification run only those layers); only a drafter that does not draft (autoregressive)
    may be combined with it, and E = L is exactly the plain model.

    An engine owns its drafter's life: ``close()`` (or leaving a ``with`` block) calls the drafter's
    ``finish`` once, which saves what it learned (SWIFT's ``save_plan``, the adaptive gate's memory).
    """

    def __init__(self, runner: Runner, drafter: Drafter, eos_token_ids: Sequence[int] = (),
                 decode: Callable[[list[int]], str] | None = None):
        self.runner = runner
        self.drafter = drafter
        self.eos = frozenset(int(t) for t in eos_token_ids)
        self.decode = decode
        self.closed = False
        self.observers: list[CycleObserver] = []
        """What sees every cycle of this engine (measurement: ``infer.measure.timing``)."""

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Decoding with this engine is over: the drafter's ``finish`` runs (once, however often this is called)."""
        if not self.closed:
            self.closed = True
            self.drafter.finish()

    def target_depth(self, config: DecodeConfig) -> int:
        """Layers of the target under ``config``: the model's, or a lossy ``target_exit``."""
        L, E = self.runner.num_layers, config.target_exit
        if E is None or E == L:
            return L
        check_exit_layer(E, L, "target exit")
        if self.drafter.drafts:
            raise UserError(f"a lossy early-exit target (target exit {E}) works only with plain decoding (the "
                            f"autoregressive drafter), not {self.drafter.name!r}")
        return E

    @torch.no_grad()  # one grad mode on the whole decoding path: compiled steps guard on it (see infer.model.compiled)
    def generate(self, prompt_ids: Sequence[int] | Tensor, config: DecodeConfig | None = None,
                 generator: torch.Generator | None = None, reserve: int | None = None) -> GenerationResult:
        """Prefill, then propose-verify-accept cycles until a stop condition (``reserve``: see ``start``)."""
        gen = self.start(prompt_ids, config, generator, reserve)
        while not gen.done:
            self.step(gen)
        return self.finish(gen)

    @torch.no_grad()
    def start(self, prompt_ids: Sequence[int] | Tensor, config: DecodeConfig | None = None,
              generator: torch.Generator | None = None, reserve: int | None = None,
              processor: PositionProcessor | None = None) -> Generation:
        """Check and prefill a prompt; the returned generation holds its first token.

        ``reserve``: cache positions to take from the runner's pool (default ``cache_length`` of this prompt and
        ``config``); ``warm_up`` uses it to run short generations in the cache a longer one will use.
        ``processor``: logits processing at every position the target scores, the prefill's included (the target
        then picks or samples from the processed scores; ``infer.decode.processing``)."""
        gen = self.admit(prompt_ids, config, generator, reserve, processor)
        start_rows([(self, gen)])
        return gen

    def admit(self, prompt_ids: Sequence[int] | Tensor, config: DecodeConfig | None = None,
              generator: torch.Generator | None = None, reserve: int | None = None,
              processor: PositionProcessor | None = None) -> Generation:
        """Check a prompt and set up its generation, not yet prefilled (``start_rows``); arguments as ``start``'s."""
        config = DecodeConfig() if config is None else config
        if not isinstance(config, DecodeConfig):
            raise UserError(f"config must be a DecodeConfig (or None), not {type(config).__name__}: "
                            "e.g. DecodeConfig(max_new_tokens=32)")
        prompt = token_ids(prompt_ids)
        self.check_prompt(prompt, config)
        if self.closed:
            raise ValueError("the engine is closed (its drafter has finished); build a new one")
        if config.stop_strings and self.decode is None:
            raise UserError("stop strings need a tokenizer to decode the output")
        stats = GenerationStats(prompt_tokens=len(prompt))
        cache = self.runner.take_cache(max(reserve or 0, self.cache_length(len(prompt), config.max_new_tokens)))
        generator = generator or config.sampling.generator(self.runner.device)
        state = DecodeState(self.runner, cache, config.sampling, generator, tokens=list(prompt), prompt_len=len(prompt),
                            eos=self.eos if config.stop_at_eos else frozenset(), depth=self.target_depth(config))
        stats.target_exit = None if state.depth == self.runner.num_layers else state.depth
        strings = StopScan(config.stop_strings, self.decode, prompt) if config.stop_strings else None
        stops = StopRules(state.eos, config.max_new_tokens, strings)
        return Generation(state, config, stats, [], stops, processor=processor)

    def step(self, gen: Generation) -> VerifyOutcome:
        """One cycle (``infer.decode.cycle.step_rows`` over this one row, seen by ``observers``): the drafter proposes,
        one forward verifies, the accepted tokens are appended."""
        return step_rows([(self, gen)], self.observers)[0]

    def advance(self, gen: Generation, outcome: VerifyOutcome, draft_time: float, verify_time: float) -> None:
        """Record a verified step of ``gen`` (its timings in seconds), append its tokens, check the stop conditions
        and let the drafter learn from it (``BatchEngine`` calls it for each row of a batched step)."""
        state, stats = gen.state, gen.stats
        t2 = time.perf_counter()
        stats.draft_time += draft_time
        stats.verify_time += verify_time
        stats.verify_calls += 1
        stats.drafted += outcome.drafted
        stats.accepted += outcome.accepted
        self.take(gen, outcome.tokens)
        state.tokens.extend(outcome.tokens)
        if not gen.done:
            self.drafter.update(state, outcome)
            stats.update_time += time.perf_counter() - t2

    def finish(self, gen: Generation) -> GenerationResult:
        """The result of a finished generation (its output ends at its first stop condition)."""
        if not gen.done:
            raise ValueError("the generation is still running; call step() until done")
        out, finish = list(gen.tokens), gen.finish_reason
        if gen.state.cache is not None:  # back to the runner's pool for the next generation
            self.runner.release_cache(gen.state.cache)
            gen.state.cache = None
        stats = gen.stats
        stats.wall_time = time.perf_counter() - gen.started
        stats.new_tokens = len(out)
        stats.drafter = self.drafter.stats()
        text = self.decode(out) if self.decode else None
        return GenerationResult(out, finish, stats, text)

    def warm_up(self, prompts: Sequence[Sequence[int]], config: DecodeConfig | None = None) -> None:
        """Untimed generations that set up what timed generations of ``prompts`` with ``config`` will use.

        On the static/graphs executors, static forwards (and CUDA graphs) are built per pooled cache and per
        shape, on first use: so for each cache capacity the prompts need, the longest prompt there runs once at
        full length (the steady-state shapes) and then in short generations whose first step verifies 1, 2, 4,
        8, ... rows (the shapes of a generation's last steps, where the token budget cuts the draft). After that
        a timed run builds nothing, except SWIFT's drafting forward for a plan first found in it. On the eager
        executor one short generation loads what needs loading (kernels, allocator).
        """
        config = dataclasses.replace(config or DecodeConfig(), stop_at_eos=False, stop_strings=())  # full length
        if self.runner.static is None:
            self.generate(prompts[0], dataclasses.replace(config, max_new_tokens=min(4, config.max_new_tokens)))
            return
        longest: dict[int, Sequence[int]] = {}
        for prompt in prompts:
            need = self.cache_length(len(prompt), config.max_new_tokens)
            cap = capacity_bucket(need)
            if len(prompt) > len(longest.get(cap, ())):
                longest[cap] = prompt
        for cap, prompt in sorted(longest.items()):
            self.generate(prompt, config)
            for m in sorted({2, 3, 5, 9, 17, 33}):  # the first step verifies min(k + 1, m - 1) rows
                if m <= min(config.max_new_tokens, self.drafter.needs().lookahead + 1):
                    self.generate(prompt, dataclasses.replace(config, max_new_tokens=m), reserve=cap)

    def cache_length(self, prompt_len: int, max_new_tokens: int) -> int:
        """Cache positions a generation needs: prompt, new tokens, the drafter's lookahead, and slack for the
        static executor, whose padded rows write up to ``BUCKETS[-1] - 1`` slots past the real ones."""
        return prompt_len + max_new_tokens + self.drafter.needs().lookahead + 2 + BUCKETS[-1]

    @torch.no_grad()
    def target_logits(self, prompt_ids: Sequence[int], tokens: Sequence[int],
                      config: DecodeConfig | None = None) -> Tensor:
        """(V,) fp32 logits of the target after ``prompt_ids + tokens``, computed exactly as plain decoding with
        this engine and ``config`` computes them: the prompt prefilled in one forward, then one token per
        forward through the runner's executor, in a pooled cache of the same capacity. In bf16 this is what
        tells a tie flip from a bug: recomputing on another path (eager instead of static/graphs, another
        capacity) can move a logit by more than the tie bound."""
        config = config or DecodeConfig()
        runner, prompt = self.runner, [int(t) for t in prompt_ids]
        cache = runner.take_cache(self.cache_length(len(prompt), config.max_new_tokens))
        state = DecodeState(runner, cache, config.sampling, torch.Generator(), tokens=prompt, prompt_len=len(prompt),
                            depth=self.target_depth(config))
        try:
            logits = prefill(runner, [Prompt(state)])[0]  # (1, V)
            step = Program(0, state.depth, logits=True)
            for i, token in enumerate(tokens):
                hidden = runner.embed(runner.to_device([int(token)]))  # (1, d)
                logits = runner.run(step, Rows.one(cache, hidden, [len(prompt) + i])).logits  # (1, V)
        finally:
            runner.release_cache(cache)
        return logits[0]

    # ----------------------------------------------------------------- the cycle's parts
    def check_prompt(self, prompt: list[int], config: DecodeConfig) -> None:
        """Refuse, in one line, a prompt this engine cannot decode under ``config`` (empty, ids out of range, long)."""
        if not prompt:
            raise UserError("the prompt is empty; give at least one token of text")
        vocab = self.runner.spec.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise UserError(f"prompt token ids must lie in [0, {vocab})")
        limit = self.runner.spec.max_position_embeddings
        if len(prompt) + config.max_new_tokens > limit:
            raise UserError(f"prompt ({len(prompt)} tokens) + max-new-tokens ({config.max_new_tokens}) "
                            f"exceeds the model's context of {limit} tokens; "
                            "shorten the prompt or lower --max-new-tokens")

    def first_token(self, gen: Generation, logits: Tensor) -> None:
        """A prefilled generation's first token, from the prefill's logits (1, V): the pending token."""
        state, sampling = gen.state, gen.state.sampling
        if gen.processor is not None:
            logits = gen.processor(state.tokens[:state.prompt_len], [[]], logits)  # (1, V)
            sampling = sampling if sampling.greedy else PROCESSED
        first = int(select(logits, sampling, state.generator)[0])  # the prefill's sync
        state.tokens.append(first)
        self.take(gen, [first])

    @staticmethod
    def take(gen: Generation, tokens: list[int]) -> None:
        """Append committed ``tokens`` to the output, examined one at a time in order (``StopRules.scan``): the output
        ends at the first where plain decoding stops, with its reason."""
        start = len(gen.tokens)
        gen.tokens.extend(tokens)
        stop = gen.stops.scan(gen.tokens, start)
        if stop is not None:
            del gen.tokens[stop[0]:]
            gen.finish_reason = stop[1]


def start_rows(rows: Sequence[tuple[Engine, Generation]]) -> None:
    """Prefill admitted generations (``Engine.admit``) of engines on one runner together (``infer.decode.prefill``:
    packed forwards where that is exact, else one prompt at a time), then each row's first token and its drafter's
    start. A row's ``prefill_time`` is its share of the prefill by prompt length (the shares add up to the prefill's
    time), its ``started`` the prefill's start."""
    runner, t0 = rows[0][0].runner, time.perf_counter()
    if any(engine.runner is not runner for engine, _ in rows):
        raise ValueError("rows prefilled together must share one runner")
    logits = prefill(runner, [Prompt.of(gen.state, engine.drafter) for engine, gen in rows])  # R x (1, V)
    for (engine, gen), first in zip(rows, logits, strict=True):
        engine.first_token(gen, first)
    seconds, total = time.perf_counter() - t0, sum(gen.state.prompt_len for _, gen in rows)
    for engine, gen in rows:
        gen.started, gen.stats.prefill_time = t0, seconds * gen.state.prompt_len / total
        if not gen.done:
            engine.drafter.start(gen.state)
