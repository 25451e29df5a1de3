"""Running ``layerskip bench``: every (model, task, method) on the same prompts, interleaved per prompt and repeat
so that machine drift hits all methods alike, on one device and dtype (peers included).

Greedy outputs are checked token for token against our autoregressive baseline: identical in fp32; in bf16/fp16 a
near-tie can flip, so a mismatch is classified at its first divergent position by the full model's logit margin
(``exactness.DivergenceJudge``): within the dtype's resolution it is a *tie flip*, else a bug. Lossy early exit
(``autoregressive:target_exit=E``) is judged by its agreement with the full model and its GSM8K answer accuracy.

The batched bench (``layerskip bench --batch-size B``, ``run_batched_task``): every method decodes a task's prompts
``B`` at a time. Our drafters run through ``BatchEngine`` (``B`` rows, a finished row's slot taken by the next
prompt); the `transformers` peers (``methods.BATCH_PEERS``) run batched ``generate`` on the same prompts, left-padded
``B`` at a time, with the same greedy or sampling settings, ``max_new_tokens`` and EOS handling. The fairness rules
are the one-prompt bench's: untimed warm-ups (per method and ``B``), a fresh engine (fresh drafters) per timed run and
nothing carried into it, the runs interleaved per repeat (every ``B``, every method in turn; the order reversed on odd
repeats), the median of the repeats, the threads of ``cfg.run`` for all. A run's records are one per prompt:
``stats.wall_time`` is that row's latency (its start to its finish; a peer's row: its batch's wall time) and
``run_wall`` the whole run's wall time, whose total tokens over it is the run's tokens/s (``report.summarize``). Each
row's greedy output is judged (``judge_output``, the one check of the one-prompt bench) against that prompt decoded
alone by plain decoding, computed once per task, untimed.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch

from infer.decode.engine import GenerationStats
from infer.drafters.registry import stats_from_dict
from infer.measure.exactness import DivergenceJudge, first_divergence, rounded_reference
from infer.measure.methods import BASELINE, BenchConfig, Method, check_layers
from infer.measure.peers import Peer
from infer.measure.quality import same_source, verifier_quality
from infer.measure.timing import timed_batch, timed_generate
from layerskip_core.cli import split_named
from layerskip_core.errors import UserError
from layerskip_core.models import resolve_model
from layerskip_core.prompts import final_number, load_prompts, task_name, use_chat_template

if TYPE_CHECKING:
    from infer.loading import LoadedModel  # type only: infer.loading imports transformers (see run_bench)


@dataclass
class Record:
    """One timed generation: the engine's statistics and how its output was judged (repeat 0 only)."""

    model: str
    task: str
    method: str
    prompt_id: str
    repeat: int
    stats: GenerationStats
    """The engine's statistics; a peer's carry only its new tokens and wall time."""
    exact: bool | None = None
    """Greedy output equals autoregressive (None: sampling, lossy, or not judged)."""
    divergence: dict | None = None
    """First greedy divergence from autoregressive: position, tokens, margin, resolution, tie_flip."""
    agree_prefix: int | None = None
    """Tokens equal to the full model's before the first divergence (lossy methods)."""
    agree_total: int | None = None
    """Positions equal to the full model's output overall (lossy methods)."""
    answer_correct: bool | None = None
    """Final number equals the reference answer's (sets with '#### N' answers, e.g. GSM8K)."""
    start_state: str = "cold"
    """What the drafter started this run from: 'cold', or 'warm from <file>' (the drafter's own account)."""
    batch_size: int | None = None
    """The batched bench's B (this prompt decoded in a batch of B rows); None: decoded alone by one ``Engine``."""
    run_wall: float | None = None
    """Batched: wall seconds of the whole run this record belongs to (all the task's prompts, B at a time), the
    same in every record of that run; ``stats.wall_time`` is this row's latency (its start to its finish)."""

    @property
    def lossy(self) -> bool:
        return self.stats.lossy

    def to_dict(self) -> dict:
        """One flat JSON row: the labels and the judgement beside the statistics (``GenerationStats.to_dict``)."""
        row = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "stats"}
        return row | self.stats.to_dict()

    @classmethod
    def from_dict(cls, row: dict) -> Record:
        """The record ``to_dict`` wrote (its derived statistics dropped): a killed bench's rows, read back."""
        values = {f.name: row[f.name] for f in dataclasses.fields(GenerationStats) if f.name in row}
        if isinstance(values.get("drafter"), dict):  # the drafter's own stats class
            values["drafter"] = stats_from_dict(values["drafter"])
        return cls(stats=GenerationStats(**values), **{f.name: row[f.name] for f in dataclasses.fields(cls)
                                   if f.name != "stats" and f.name in row})


@dataclass(frozen=True)
class Prompt:
    """One encoded prompt of a task."""

    id: str
    ids: list[int]
    reference: str = ""


def token_agreement(reference: list[int], out: list[int]) -> tuple[int, int]:
    """(positions equal before the first divergence, positions equal overall) of ``out`` against ``reference``."""
    first = first_divergence(reference, out)
    return (len(reference) if first is None else first), sum(a == b for a, b in zip(reference, out, strict=False))


def run_bench(cfg: BenchConfig, progress: bool = True, log: Callable[[Record], None] | None = None,
              on_quality: Callable[[str, dict], None] | None = None,
              on_methods: Callable[[str, dict[str, str]], None] | None = None) -> list[Record]:
    """Run every method on every prompt, ``cfg.repeats`` times, interleaved; return raw records. ``log`` gets each
    record as soon as it is finished (``report.RecordLog``: a killed bench leaves every finished record readable);
    ``on_quality(label, quality)`` each model's verifier quality (``infer.measure.quality``) before it is timed;
    ``on_methods(label, {method: spec as it runs})`` each model's drafters as resolved (an adapter's tuned setting
    in)."""
    from infer.loading import load_resolved  # lazy: transformers; report reads records through this module without it

    tasks = {task_name(src): load_prompts(src, cfg.n, from_end=True, skip_end=cfg.skip) for src in cfg.data}
    sources = [split_named(arg)[1] for arg in cfg.models]
    labels = cfg.labels

    def load(source: str) -> LoadedModel:
        return load_resolved(dataclasses.replace(cfg.run, model=resolve_model(source)))

    ready = None
    for source, label in reversed(list(zip(sources, labels, strict=True))):  # every model x method before timing
        ready = None  # one model in memory at a time; the first one to time stays loaded
        ready = load(source)
        resolved = check_methods(cfg, ready, label, source)
        if on_methods is not None:
            on_methods(label, resolved)
    records: list[Record] = []
    for source, label in zip(sources, labels, strict=True):
        model, ready = ready or load(source), None
        peer = Peer(model.path, model.runner.dtype, model.runner.device) \
            if any(m.is_peer for m in cfg.methods) else None
        if on_quality is not None and cfg.quality.enabled:
            timed = {it.id for src in cfg.data if same_source(src, cfg.quality.source) for it in tasks[task_name(src)]}
            on_quality(label, _quality(model, cfg, label, timed, progress))
        for task, items in tasks.items():
            chat = use_chat_template(task, cfg.chat, model.tokenizer)
            prompts = [Prompt(it.id, model.encode(it.prompt, chat), it.reference) for it in items]
            run_task = _run_task if cfg.batch_sizes is None else run_batched_task
            records += run_task(cfg, model, peer, label, task, prompts, progress, log)
        del model, peer
    return records


def _quality(model: LoadedModel, cfg: BenchConfig, label: str, timed: set[str], progress: bool) -> dict:
    """The model's verifier quality (cached or computed), said on stderr when ``progress``."""
    q = verifier_quality(model, cfg.quality, timed)
    if progress or q["note"]:
        how = "read from the cache" if q["cache"] == "read" else f"computed in {q['seconds']:.1f} s"
        note = f"; {q['note']}" if q["note"] else ""
        print(f"{label}: held-out loss {q['loss']:.3f} nats/token on {q['tokens']} tokens ({how}){note}",
              file=sys.stderr)
    return q


def resolved_text(name: str, config) -> str:
    """A drafter's spec as it ran: its options that differ from the class defaults (an adapter's tuned setting
    included), ``remember`` left out (the bench sets it)."""
    fields = [f for f in dataclasses.fields(config) if f.name != "remember"]
    parts = []
    for f in fields:
        value = getattr(config, f.name)
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        if value != default:
            parts.append(f"{f.name}={str(value).lower() if isinstance(value, bool) else value}")
    return ":".join([name, *parts])


def check_methods(cfg: BenchConfig, model: LoadedModel, label: str, source: str) -> dict[str, str]:
    """Build every drafter of ``cfg`` for ``model`` (options, plan files checked against this model, exit layers)
    without running it, so that a bad spec is refused before anything is timed. The drafters come first: a peer the
    bench adds by default (``hf_early_exit`` at each early exit's E) must not take the blame for a drafter's value.
    Returns each drafter's spec as it runs on the model (``resolved_text``)."""
    resolved = {}
    for method in cfg.methods:
        if not method.is_peer:
            try:
                engine = engine_for(method, model, label, cfg.start)  # not closed: finish() may write (save_plan)
            except UserError as e:
                raise UserError(f"{method.label} on model {label!r}: {e}") from None
            resolved[method.label] = resolved_text(method.name, engine.drafter.config)
    check_layers(cfg.methods, model.runner.num_layers)
    return resolved


def engine_for(method: Method, model: LoadedModel, label: str, start: str, warm_up: bool = False,
               batch_size: int | None = None):
    """A fresh engine (a ``BatchEngine`` of ``batch_size`` rows when given); '{model}' in an option value becomes
    the model's label (per-model plan files).

    A drafter that remembers state across commands starts as ``start`` says ('cold': remember=off; 'warm':
    remember=read) unless the method sets remember itself; a warm-up drafter never reads or writes remembered
    state nor its save_plan file."""
    spec = method.spec_for(label).remembering("off" if start == "cold" else "read")
    if warm_up:
        spec = spec.for_warm_up()
    if batch_size is not None:
        return model.batch_engine(spec.drafter, spec, batch_size=batch_size)
    return model.engine(spec.drafter, spec)


def _run_task(cfg: BenchConfig, model: LoadedModel, peer: Peer | None, label: str, task: str,
              prompts: list[Prompt], progress: bool, log: Callable[[Record], None] | None = None) -> list[Record]:
    from tqdm.auto import tqdm

    if cfg.warmup:
        _warmup(cfg, model, peer, [p.ids for p in prompts], label)
    reference: dict[str, list[int]] = {}
    judge = divergence_judge(cfg, model)
    records = []
    bar = tqdm(total=cfg.repeats * len(prompts) * len(cfg.methods), desc=f"{label}/{task}", disable=not progress,
               leave=False)
    for repeat in range(cfg.repeats):
        engines = {m.label: engine_for(m, model, label, cfg.start) for m in cfg.methods if not m.is_peer}
        configs = {m.label: cfg.generation(m) for m in cfg.methods if not m.is_peer}
        for prompt in prompts:
            for method in cfg.methods:
                bar.set_postfix_str(method.label)
                if method.is_peer:
                    tokens, wall = peer.generate(method, prompt.ids, cfg, model.eos_token_ids)
                    stats, verified = GenerationStats(new_tokens=len(tokens), wall_time=wall), None
                else:
                    result, verified = timed_generate(engines[method.label], prompt.ids, configs[method.label])
                    tokens, stats = result.tokens, result.stats
                rec = Record(model=label, task=task, method=method.label, prompt_id=prompt.id, repeat=repeat,
                             stats=stats, start_state=stats.drafter.start_state)
                if method.label == BASELINE and repeat == 0:
                    reference[prompt.id] = tokens
                if repeat == 0:
                    judge_output(rec, tokens, reference.get(prompt.id), prompt, model, cfg.sampling.greedy, judge,
                           verified)
                records.append(rec)
                if log is not None:
                    log(rec)
                bar.update()
        for engine in engines.values():
            engine.close()  # each drafter's finish(): SWIFT's save_plan, the adaptive gate's memory
    bar.close()
    return records


def divergence_judge(cfg: BenchConfig, model: LoadedModel) -> DivergenceJudge:
    """The judge of greedy mismatches, with the reference's (full model's) settings; the rounding is measured on
    first need, in bf16/fp16 against an fp32 recomputation of the same rounded weights (gpu_check's bound,
    independent of the verification being judged)."""
    runner = model.runner
    make = (lambda: rounded_reference(model.path, runner.dtype, runner.device)) \
        if runner.dtype != torch.float32 and model.path is not None else None
    return DivergenceJudge(runner, cfg.generation(), make_reference=make)


def judge_output(rec: Record, tokens: list[int], reference: list[int] | None, prompt: Prompt, model: LoadedModel,
           greedy: bool, judge: DivergenceJudge, verified: list[int] | None) -> None:
    """Exactness (classified at the first divergence, with the run's own verification argmax ``verified``; None for
    a peer), lossy agreement and answer accuracy of one output."""
    answer = final_number(prompt.reference) if "####" in prompt.reference else None
    if answer is not None:
        eos = next((i for i, t in enumerate(tokens) if t in model.eos_token_ids), len(tokens))
        rec.answer_correct = final_number(model.decode(tokens[:eos])) == answer
    if not greedy or reference is None:
        return
    if rec.lossy:
        rec.agree_prefix, rec.agree_total = token_agreement(reference, tokens)
        return
    rec.exact = tokens == reference
    if not rec.exact:
        found = judge.classify(prompt.ids, reference, tokens, verified)
        rec.divergence = asdict(found) if found is not None else None


def _warmup(cfg: BenchConfig, model: LoadedModel, peer: Peer | None, prompts: list[list[int]], label: str) -> None:
    """Untimed runs before timing: per peer a short one, ``hf_static`` on the longest prompt at the full
    ``max_new_tokens`` (its static cache and, on CUDA, its compiled forward are sized by them: a shorter warm-up
    leaves a rebuild and a recompile to the first longer timed call); per drafter ``Engine.warm_up`` over the
    task's prompts, so that on the static/graphs executors every static forward and CUDA graph is built before
    the clock runs."""
    short = dataclasses.replace(cfg, max_new_tokens=4)
    for method in cfg.methods:
        if method.name == "hf_static":
            peer.generate(method, max(prompts, key=len), cfg, model.eos_token_ids)
        elif method.is_peer:
            peer.generate(method, prompts[0], short, model.eos_token_ids)
        else:
            with engine_for(method, model, label, cfg.start, warm_up=True) as engine:
                engine.warm_up(prompts, cfg.generation(method))


# --------------------------------------------------------------------------- the batched bench
Row = tuple[list[int], GenerationStats, list[int] | None]
"""One prompt of a batched run: (new tokens, statistics, the verification's argmax per token or None for a peer)."""


def run_batched_task(cfg: BenchConfig, model: LoadedModel, peer: Peer | None, label: str, task: str,
                     prompts: list[Prompt], progress: bool, log: Callable[[Record], None] | None = None
                     ) -> list[Record]:
    """Every (repeat, B, method) run over ``prompts``; one record per prompt and run, logged as each run ends."""
    from tqdm.auto import tqdm

    ids = [p.ids for p in prompts]
    if cfg.warmup:
        _warm_up(cfg, model, peer, ids, label)
    reference = alone(model, ids, cfg) if cfg.sampling.greedy else [None] * len(ids)
    judge = divergence_judge(cfg, model)
    records = []
    bar = tqdm(total=cfg.repeats * len(cfg.batch_sizes) * len(cfg.methods), desc=f"{label}/{task} batched",
               disable=not progress, leave=False)
    for repeat in range(cfg.repeats):
        for size in alternate(cfg.batch_sizes, repeat):
            for method in alternate(cfg.methods, repeat):
                bar.set_postfix_str(f"{method.label} B={size}")
                rows, wall = _timed_run(cfg, model, peer, label, method, ids, size)
                for prompt, ref, (tokens, stats, verified) in zip(prompts, reference, rows, strict=True):
                    rec = Record(model=label, task=task, method=method.label, prompt_id=prompt.id, repeat=repeat,
                                 stats=stats, start_state=stats.drafter.start_state, batch_size=size, run_wall=wall)
                    if repeat == 0:
                        judge_output(rec, tokens, ref, prompt, model, cfg.sampling.greedy, judge, verified)
                    records.append(rec)
                    if log is not None:
                        log(rec)
                bar.update()
    bar.close()
    return records


def alternate(items: list, repeat: int) -> list:
    """``items`` in order on even repeats, reversed on odd ones: over two repeats a load that drifts during the run
    (a shared machine) hits the first and the last (B, method) alike."""
    return list(items) if repeat % 2 == 0 else list(reversed(items))


def alone(model: LoadedModel, prompts: list[list[int]], cfg: BenchConfig) -> list[list[int]]:
    """Each prompt decoded alone by plain decoding with the full model (the reference every row is judged by)."""
    with model.engine(BASELINE) as engine:
        return [engine.generate(p, cfg.generation()).tokens for p in prompts]


def _timed_run(cfg: BenchConfig, model: LoadedModel, peer: Peer | None, label: str, method: Method,
               prompts: list[list[int]], size: int) -> tuple[list[Row], float]:
    """One timed run of ``method`` over ``prompts`` at batch size ``size``: a row per prompt, the run's wall time."""
    size = min(size, len(prompts))  # a task with fewer prompts than B: never more rows (slots) than prompts
    if method.is_peer:
        tokens, latency, wall = peer.generate_batch(method, prompts, size, cfg, model.eos_token_ids)
        return [(t, GenerationStats(new_tokens=len(t), wall_time=s), None)
                for t, s in zip(tokens, latency, strict=True)], wall
    with engine_for(method, model, label, cfg.start, batch_size=size) as engine:  # built before the clock starts
        results, verified, wall = timed_batch(engine, prompts, cfg.generation(method))
    gate = getattr(engine, "gate", None)
    if gate is not None:  # the rows' drafters handed their gates to the batch's: what it started from is theirs
        for r in results:
            r.stats.drafter = dataclasses.replace(r.stats.drafter, start_state=gate.start_state)
    return [(r.tokens, r.stats, v) for r, v in zip(results, verified, strict=True)], wall


def _warm_up(cfg: BenchConfig, model: LoadedModel, peer: Peer | None, prompts: list[list[int]], label: str) -> None:
    """Untimed runs per method and B on the B longest prompts: 4 new tokens (``hf_static``: the full length, which
    sizes its static cache), with warm-up drafters (neither reading nor writing remembered state)."""
    short = dataclasses.replace(cfg, max_new_tokens=4)
    for size in cfg.batch_sizes:
        batch = sorted(prompts, key=len, reverse=True)[:size]
        for method in cfg.methods:
            if method.is_peer:
                peer.generate_batch(method, batch, size, cfg if method.name == "hf_static" else short,
                                    model.eos_token_ids)
                continue
            with engine_for(method, model, label, cfg.start, warm_up=True, batch_size=size) as engine:
                engine.generate(batch, dataclasses.replace(cfg.generation(method), max_new_tokens=4))
