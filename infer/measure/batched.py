"""The batched bench (``layerskip bench --batch-size B``): every method decodes a task's prompts ``B`` at a time.

Our drafters run through ``BatchEngine`` (``B`` rows, a finished row's slot taken by the next prompt); the
`transformers` peers (``methods.BATCH_PEERS``) run batched ``generate`` on the same prompts, left-padded ``B`` at a
time, with the same greedy or sampling settings, ``max_new_tokens`` and EOS handling as the one-prompt bench. The
fairness rules are the one-prompt bench's: untimed warm-ups (per method and ``B``), a fresh engine (fresh drafters)
per timed run and nothing carried into it, the runs interleaved per repeat (every ``B``, every method in turn), the
median of the repeats, the threads of ``cfg.run`` for all.

A run's records are one per prompt: ``stats.wall_time`` is that row's latency (its start to its finish; a peer's
row: its batch's wall time) and ``run_wall`` the whole run's wall time, whose total tokens over it is the run's
tokens/s (``report.summarize``). Each row's greedy output is judged (``bench.judge_output``, the one check of the
one-prompt bench) against that prompt decoded alone by plain decoding, computed once per task, untimed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from infer.engine import GenerationStats
from infer.measure.bench import Prompt, Record, divergence_judge, engine_for, judge_output
from infer.measure.methods import BASELINE
from infer.measure.timing import timed_batch

if TYPE_CHECKING:
    from infer.loading import LoadedModel
    from infer.measure.methods import BenchConfig, Method
    from infer.measure.peers import Peer

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
        for size in cfg.batch_sizes:
            for method in cfg.methods:
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
