"""Benchmark drafters and `transformers` peers side by side on real prompt sets.

Every (model, task, method) is run on the same prompts, interleaved per prompt and repeat so
that machine drift hits all methods alike, on one device and dtype (peers included). Greedy
outputs are checked token for token against our autoregressive baseline: identical in fp32; in
bf16/fp16 a near-tie can flip, so every mismatch is classified at its first divergent position by
the full model's logit margin between the two tokens. A margin within the dtype's resolution is a
*tie flip* (its own column); anything else is a bug and makes ``layerskip bench`` exit non-zero.
Lossy early exit (``autoregressive:E=8``) is not expected to match: its quality is reported next
to its speed (token agreement with the full model; GSM8K answer accuracy).

Cost model (LayerSkip, Elhoushi et al. 2024, §4; speculative decoding, Leviathan et al. 2023):
one draft-verify cycle produces M tokens and costs k̄·c + v full-forward equivalents, where k̄ is
the mean number of draft forwards per cycle, c the cost of one draft forward relative to one
full single-token forward, and v the cost of the verification forward (≈ 1 when memory-bound).
The expected speed-up over autoregressive decoding is M / (k̄·c + v).

torch, transformers, the engine and the drafters are imported inside the functions that run models:
the commands import this module to parse and check their arguments before any of that loads.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import platform
import statistics
import subprocess
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from infer.plan import cycle_speedup
from layerskip_core.cli import split_named
from layerskip_core.device import dtype_name
from layerskip_core.errors import UserError
from layerskip_core.prompts import final_number, load_prompts, task_name, use_chat_template
from layerskip_core.settings import RunSettings

if TYPE_CHECKING:
    from infer.sampling import SamplingConfig

PEERS = ("hf_generate", "hf_static", "hf_early_exit", "prompt_lookup")
PEER_OPTIONS = {"hf_early_exit": ("E", "k"), "prompt_lookup": ("k",)}
BASELINE = "autoregressive"


# --------------------------------------------------------------------------- specs
@dataclass(frozen=True)
class Method:
    """One thing to time: one of our drafters, or a `transformers` peer."""

    label: str
    """Display name, e.g. 'early_exit:E=8:k=6' or 'hf_early_exit:E=8'."""
    name: str
    """Drafter name or peer name."""
    options: tuple[tuple[str, str], ...] = ()
    """Drafter/peer options as (key, value) strings."""
    target_exit: int | None = None
    """Lossy early exit of plain decoding (``autoregressive:target_exit=E``): the generation's target exit."""

    @property
    def is_peer(self) -> bool:
        return self.name in PEERS

    @property
    def opts(self) -> dict[str, str]:
        return dict(self.options)


def parse_methods(drafters: str, peers: str | None) -> list[Method]:
    """Parse '--drafters' and '--peers' lists; the autoregressive baseline is always included."""
    from infer.drafters import parse_spec

    methods: list[Method] = []
    if any(not s.strip() for s in drafters.split(",")) and drafters.strip():
        raise UserError(f"--drafters {drafters!r} has an empty entry; give comma-separated drafter specs such as "
                        "autoregressive,early_exit:E=8:k=6")
    for spec in [s for s in drafters.split(",") if s.strip()]:
        parsed = parse_spec(spec, validate="{model}" not in spec)  # per-model values are checked at load
        methods.append(Method(spec.strip(), parsed.drafter, tuple(parsed.options.items()), parsed.target_exit))
    # The baseline runs first on every prompt: the others are judged against its output right away.
    methods = [Method(BASELINE, BASELINE)] + [m for m in methods
                                               if not (m.name == BASELINE and not m.options and m.target_exit is None)]
    exits = sorted({int(m.opts.get("E", m.opts.get("exit_layer", 0))) for m in methods if m.name == "early_exit"})
    peer_specs = "hf_generate,prompt_lookup" + "".join(f",hf_early_exit:E={e}" for e in exits) if peers is None \
        else peers
    if any(not s.strip() for s in peer_specs.split(",")) and peer_specs.strip():
        raise UserError(f"--peers {peer_specs!r} has an empty entry; give comma-separated peers (or 'none')")
    for spec in [s for s in peer_specs.split(",") if s.strip()]:
        methods.append(parse_peer(spec))
    labels = [m.label for m in methods]
    if len(set(labels)) != len(labels):
        raise UserError(f"a method is listed twice: {labels}")
    return methods


def parse_peer(spec: str) -> Method:
    """``'hf_early_exit:E=8:k=5'`` -> a peer Method; names, keys and integer values checked here."""
    name, _, rest = spec.strip().partition(":")
    if name not in PEERS:
        raise UserError(f"unknown peer {name!r}; choose from {', '.join(PEERS)} (or --peers none)")
    opts = {}
    for part in [p for p in rest.split(":") if p] if rest else []:
        key, sep, value = part.partition("=")
        if not sep or key not in PEER_OPTIONS.get(name, ()):
            allowed = ", ".join(PEER_OPTIONS.get(name, ())) or "none"
            raise UserError(f"peer spec {spec!r}: bad option {part!r} (options of {name}: {allowed})")
        try:
            if int(value) < 1:
                raise ValueError(value)
        except ValueError:
            raise UserError(f"peer spec {spec!r}: {key}={value!r}: expected an integer >= 1") from None
        opts[key] = value
    if name == "hf_early_exit" and "E" not in opts:
        raise UserError("hf_early_exit needs an exit layer: hf_early_exit:E=8")
    return Method(spec.strip(), name, tuple(opts.items()))


def check_layers(methods: list[Method], num_layers: int, model: str) -> None:
    """Refuse an exit layer beyond the model (peers too), before anything is timed."""
    for m in methods:
        E = m.opts.get("E", m.opts.get("exit_layer"))
        if m.is_peer and E is not None and not 1 <= int(E) <= num_layers:
            raise UserError(f"{m.label}: exit layer {E} is out of range: {model} has {num_layers} layers, so use "
                            f"1 <= E <= {num_layers}")


def sweep_methods(exits: list[int], ks: list[int], vocabs: list[int] | None = None) -> list[Method]:
    """The LayerSkip E x k grid of early-exit drafters, times draft-vocabulary sizes N (0 = the full head; none given:
    the drafters' default)."""
    methods = []
    for n in vocabs or [None]:
        value = None if n is None else str(n) if n else "off"
        extra = (("draft_vocab", value),) if value else ()
        tail = f":draft_vocab={value}" if value else ""
        methods += [Method(f"early_exit:E={e}:k={k}{tail}", "early_exit", (("E", str(e)), ("k", str(k))) + extra)
                    for e in exits for k in ks]
    return methods


@dataclass
class BenchConfig:
    """What `layerskip bench` runs."""

    models: list[str]
    """Model folders or 'default', optionally labelled as NAME=PATH (the label names rows and '{model}')."""
    methods: list[Method]
    """Drafters and peers to time."""
    data: list[str]
    """Prompt sources (built-in names, jsonl files, text folders)."""
    n: int = 8
    """Prompts per task, taken from the end of each set (held out from training)."""
    max_new_tokens: int = 128
    """Tokens generated per prompt."""
    repeats: int = 3
    """Timed repeats; tokens/s is the median over repeats."""
    run: RunSettings = field(default_factory=lambda: RunSettings(threads=1))
    """Device, dtype, executor and threads every method (peers included) runs with (1 thread by default: the most
    repeatable CPU numbers)."""
    sampling: SamplingConfig | None = None
    """Greedy (temperature 0: exactness is checked) or sampling settings, the same for every method (None: greedy)."""
    chat: str = "auto"
    """'auto' (chat template for gsm8k only), 'always' or 'never'."""
    stop_at_eos: bool = False
    """Stop at EOS; off by default so every method generates exactly max_new_tokens."""
    warmup: bool = True
    """Untimed runs per method before timing (``Engine.warm_up``: also builds every static forward and graph)."""

    def __post_init__(self) -> None:
        if self.n < 1 or self.max_new_tokens < 1 or self.repeats < 1:
            raise UserError("--n, --max-new-tokens and --repeats must be >= 1")
        if self.chat not in ("auto", "always", "never"):
            raise UserError("--chat must be auto, always or never")
        if not self.models or not self.data:
            raise UserError("give at least one --model and one --data source")
        if self.sampling is None:
            from infer.sampling import SamplingConfig  # torch-heavy: see the module docstring

            self.sampling = SamplingConfig()

    def generation(self, method: Method):
        """The GenerationConfig of ``method`` (its lossy ``target_exit``, if any, on top of the shared settings)."""
        from infer.engine import GenerationConfig

        return GenerationConfig(max_new_tokens=self.max_new_tokens, sampling=self.sampling,
                                stop_at_eos=self.stop_at_eos, target_exit=method.target_exit)


# --------------------------------------------------------------------------- records
@dataclass
class Record:
    """One timed generation."""

    model: str
    task: str
    method: str
    prompt_id: str
    repeat: int
    new_tokens: int
    wall_time: float
    verify_calls: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_time: float = 0.0
    verify_time: float = 0.0
    update_time: float = 0.0
    opt_time: float = 0.0
    draft_forwards: int = 0
    exact: bool | None = None
    drafter_stats: dict = field(default_factory=dict)
    lossy: bool = False
    """Lossy early exit (autoregressive with E < L): compared by agreement, not exactness."""
    divergence: dict | None = None
    """First greedy divergence from autoregressive: position, tokens, margin, resolution, tie_flip."""
    agree_prefix: int | None = None
    """Tokens equal to the full model's before the first divergence (lossy methods)."""
    agree_total: int | None = None
    """Positions equal to the full model's output overall (lossy methods)."""
    answer_correct: bool | None = None
    """Final number equals the reference answer's (sets with '#### N' answers, e.g. GSM8K)."""


@dataclass
class Summary:
    """Aggregate over the prompts and repeats of one (model, task, method)."""

    model: str
    task: str
    method: str
    prompts: int
    new_tokens: int
    tokens_per_second: float
    tps_per_repeat: list[float]
    speedup_vs_autoregressive: float | None
    speedup_vs_hf_generate: float | None
    acceptance_rate: float | None
    tokens_per_verify: float | None
    mean_draft_forwards: float | None
    draft_cost_ratio: float | None
    verify_cost_ratio: float | None
    expected_speedup: float | None
    opt_time_share: float | None
    exact_mismatches: int | None
    """Prompts whose greedy output differs from autoregressive (None when sampling or lossy)."""
    tie_flips: int | None = None
    """Mismatches at a near-tie: the target's margin within the dtype's resolution (bf16/fp16)."""
    mismatches: int | None = None
    """Mismatches that are not tie flips: bugs (the bench exits non-zero)."""
    lossy: bool = False
    """Lossy early exit: quality below, not exactness."""
    agreement: float | None = None
    """Fraction of positions equal to the full model's greedy output (lossy methods)."""
    prefix_agreement: float | None = None
    """Fraction of positions equal up to the first divergence (lossy methods)."""
    answer_accuracy: float | None = None
    """Fraction of prompts whose final number is the reference answer (GSM8K)."""


def tokens_per_verify(stats) -> float | None:
    """M over many generations (anything with ``new_tokens`` and ``verify_calls``): the prefill token excluded."""
    stats = list(stats)
    calls = sum(s.verify_calls for s in stats)
    return sum(s.new_tokens - 1 for s in stats) / calls if calls else None


def token_agreement(reference: list[int], out: list[int]) -> tuple[int, int]:
    """(positions equal before the first divergence, positions equal overall) of ``out`` against ``reference``."""
    from infer.measure.exactness import first_divergence

    first = first_divergence(reference, out)
    return (len(reference) if first is None else first), sum(a == b for a, b in zip(reference, out, strict=False))


# --------------------------------------------------------------------------- running
class _Peer:
    """`transformers` generate, plain / with its early-exit assistant / with prompt lookup."""

    def __init__(self, path: Path, dtype, device):
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()  # generate() warns about its own assistant's kwargs
        hf_logging.disable_progress_bar()
        self.torch = torch
        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()

    def generate(self, method: Method, ids: list[int], cfg: BenchConfig,
                 eos: tuple[int, ...]) -> tuple[list[int], float]:
        from transformers import GenerationConfig

        kwargs: dict = {}
        if method.name == "hf_early_exit":
            kwargs["assistant_early_exit"] = int(method.opts["E"])
            kwargs["num_assistant_tokens"] = int(method.opts.get("k", 5))
        elif method.name == "prompt_lookup":
            kwargs["prompt_lookup_num_tokens"] = int(method.opts.get("k", 10))
        elif method.name == "hf_static":  # a fixed-size cache; on CUDA generate() compiles the forward
            kwargs["cache_implementation"] = "static"
        s = cfg.sampling
        sampling = not s.greedy
        gen = GenerationConfig(max_new_tokens=cfg.max_new_tokens, do_sample=sampling,
                               temperature=s.temperature if sampling else None,
                               top_k=s.top_k or None, top_p=s.top_p if sampling else None,
                               eos_token_id=list(eos) if cfg.stop_at_eos and eos else None,
                               pad_token_id=eos[0] if eos else 0, **kwargs)
        # generate() falls back to the model's own generation_config.eos_token_id when ours is None;
        # with stop_at_eos off every method must run to max_new_tokens, so clear it for this call.
        self.model.generation_config.eos_token_id = list(eos) if cfg.stop_at_eos and eos else None
        x = self.torch.tensor([ids], device=self.device)
        # An explicit mask: without one, generate() infers it from pad_token_id, and SmolLM2's pad is
        # its <|im_end|>, which every chat prompt contains, so those prompt tokens would be masked out.
        mask = self.torch.ones_like(x)
        t0 = time.perf_counter()
        with self.torch.no_grad():
            out = self.model.generate(x, attention_mask=mask, generation_config=gen)
            tokens = out[0, len(ids):].tolist()  # reads the result: the GPU has finished when the clock stops
        return tokens, time.perf_counter() - t0


def run_bench(cfg: BenchConfig, progress: bool = True) -> list[Record]:
    """Run every method on every prompt, ``cfg.repeats`` times, interleaved; return raw records."""
    from infer.loading import load_model

    run = cfg.run.resolve()
    tasks = {task_name(src): load_prompts(src, cfg.n, from_end=True) for src in cfg.data}
    records: list[Record] = []
    for model_arg in cfg.models:
        label, source = split_named(model_arg)
        model = load_model(source, device=run.device, dtype=run.dtype, executor=run.executor, threads=run.threads)
        check_layers(cfg.methods, model.runner.num_layers, source)
        peer = _Peer(model.path, model.runner.dtype, model.runner.device) \
            if any(m.is_peer for m in cfg.methods) else None
        label = label or _model_label(source, model.path)
        for task, items in tasks.items():
            prompts = [Prompt(it.id, model.encode(it.prompt, use_chat_template(task, cfg.chat)), it.reference)
                       for it in items]
            records += _run_task(cfg, model, peer, label, task, prompts, progress)
        del model, peer
    return records


@dataclass(frozen=True)
class Prompt:
    """One encoded prompt of a task."""

    id: str
    ids: list[int]
    reference: str = ""


def _model_label(arg: str, path: Path) -> str:
    return "default" if arg == "default" else path.name


def _engine_for(method: Method, model, label: str):
    """A fresh engine; '{model}' in an option value becomes the model's label (per-model plan files)."""
    options = {k: v.replace("{model}", label) for k, v in method.opts.items()}
    return model.engine(method.name, options)


def _run_task(cfg: BenchConfig, model, peer, label: str, task: str, prompts: list[Prompt],
              progress: bool) -> list[Record]:
    from tqdm.auto import tqdm

    from infer.measure.exactness import DivergenceJudge

    greedy = cfg.sampling.greedy
    gen = cfg.generation(Method(BASELINE, BASELINE))  # the reference's (full model) settings
    if cfg.warmup:
        _warmup(cfg, model, peer, [p.ids for p in prompts], label)
    reference: dict[str, list[int]] = {}
    judge = DivergenceJudge(model.runner, gen)  # the references' config; spread measured on first need
    records = []
    bar = tqdm(total=cfg.repeats * len(prompts) * len(cfg.methods), desc=f"{label}/{task}", disable=not progress,
               leave=False)
    for repeat in range(cfg.repeats):
        engines = {m.label: _engine_for(m, model, label) for m in cfg.methods if not m.is_peer}  # fresh streams
        configs = {m.label: cfg.generation(m) for m in cfg.methods if not m.is_peer}
        for prompt in prompts:
            for method in cfg.methods:
                bar.set_postfix_str(method.label)
                if method.is_peer:
                    tokens, wall = peer.generate(method, prompt.ids, cfg, model.eos_token_ids)
                    rec = Record(label, task, method.label, prompt.id, repeat, len(tokens), wall)
                else:
                    result = engines[method.label].generate(prompt.ids, configs[method.label])
                    tokens = result.tokens
                    rec = _record(label, task, method, prompt.id, repeat, result)
                if method.label == BASELINE and repeat == 0:
                    reference[prompt.id] = tokens
                if repeat == 0:
                    _judge(rec, tokens, reference.get(prompt.id), prompt, model, greedy, judge)
                records.append(rec)
                bar.update()
        for engine in engines.values():
            engine.close()  # each drafter's finish(): SWIFT's save_plan, the adaptive gate's memory
    bar.close()
    return records


def _judge(rec: Record, tokens: list[int], reference: list[int] | None, prompt: Prompt, model,
           greedy: bool, judge) -> None:
    """Exactness (classified at the first divergence by ``judge``, an ``exactness.DivergenceJudge``), lossy
    agreement and answer accuracy of one output."""
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
        found = judge.classify(prompt.ids, reference, tokens)
        rec.divergence = asdict(found) if found is not None else None


def _record(model: str, task: str, method: Method, pid: str, repeat: int, result) -> Record:
    s = result.stats
    extra = dict(s.drafter)
    return Record(model, task, method.label, pid, repeat, s.new_tokens, s.wall_time, s.verify_calls, s.drafted,
                  s.accepted, s.draft_time, s.verify_time, s.update_time, float(extra.get("opt_time", 0.0)),
                  int(extra.get("draft_forwards", 0)), None, extra, lossy=s.lossy)


def _warmup(cfg: BenchConfig, model, peer, prompts: list[list[int]], label: str) -> None:
    """Untimed runs before timing: a short one per peer; per drafter ``Engine.warm_up`` over the task's prompts,
    so that on the static/graphs executors every static forward and CUDA graph is built before the clock runs."""
    short = dataclasses.replace(cfg, max_new_tokens=4)
    for method in cfg.methods:
        if method.is_peer:
            peer.generate(method, prompts[0], short, model.eos_token_ids)
        else:
            with _engine_for(method, model, label) as engine:
                engine.warm_up(prompts, cfg.generation(method))


# --------------------------------------------------------------------------- summarising
def summarize(records: list[Record]) -> list[Summary]:
    groups: dict[tuple[str, str, str], list[Record]] = defaultdict(list)
    for r in records:
        groups[(r.model, r.task, r.method)].append(r)
    base = {}
    rows = []
    for (model, task, method), recs in groups.items():
        rows.append(_summarize_group(model, task, method, recs))
        if method in (BASELINE, "hf_generate"):
            base[(model, task, method)] = rows[-1]
    ar_step = {key[:2]: _step_time(groups[key]) for key in groups if key[2] == BASELINE}
    for row in rows:
        ar = base.get((row.model, row.task, BASELINE))
        hf = base.get((row.model, row.task, "hf_generate"))
        row.speedup_vs_autoregressive = row.tokens_per_second / ar.tokens_per_second if ar else None
        row.speedup_vs_hf_generate = row.tokens_per_second / hf.tokens_per_second if hf else None
        _cost_model(row, groups[(row.model, row.task, row.method)], ar_step.get((row.model, row.task)))
    return rows


def _step_time(recs: list[Record]) -> float | None:
    calls = sum(r.verify_calls for r in recs)
    return sum(r.verify_time for r in recs) / calls if calls else None


def _summarize_group(model: str, task: str, method: str, recs: list[Record]) -> Summary:
    by_repeat: dict[int, list[Record]] = defaultdict(list)
    for r in recs:
        by_repeat[r.repeat].append(r)
    tps = [sum(r.new_tokens for r in rs) / sum(r.wall_time for r in rs) for _, rs in sorted(by_repeat.items())]
    ours = any(r.verify_calls for r in recs)
    drafted = sum(r.drafted for r in recs)
    first = [r for r in recs if r.repeat == 0]
    wrong = [r for r in first if r.exact is False]
    flips = sum(1 for r in wrong if (r.divergence or {}).get("tie_flip"))
    judged = any(r.exact is not None for r in first)
    compared = [r for r in first if r.agree_total is not None]
    n_cmp = sum(r.new_tokens for r in compared)
    answered = [r.answer_correct for r in first if r.answer_correct is not None]
    wall = sum(r.wall_time for r in recs)
    return Summary(
        model=model, task=task, method=method, prompts=len(first), new_tokens=sum(r.new_tokens for r in first),
        tokens_per_second=statistics.median(tps), tps_per_repeat=tps, speedup_vs_autoregressive=None,
        speedup_vs_hf_generate=None,
        acceptance_rate=sum(r.accepted for r in recs) / drafted if drafted else None,
        tokens_per_verify=tokens_per_verify(recs) if ours else None,
        mean_draft_forwards=None, draft_cost_ratio=None, verify_cost_ratio=None, expected_speedup=None,
        opt_time_share=(sum(r.opt_time for r in recs) / wall) if ours and wall else None,
        exact_mismatches=len(wrong) if judged else None,
        tie_flips=flips if judged else None, mismatches=len(wrong) - flips if judged else None,
        lossy=any(r.lossy for r in first),
        agreement=sum(r.agree_total for r in compared) / n_cmp if n_cmp else None,
        prefix_agreement=sum(r.agree_prefix for r in compared) / n_cmp if n_cmp else None,
        answer_accuracy=sum(answered) / len(answered) if answered else None,
    )


def _cost_model(row: Summary, recs: list[Record], ar_step: float | None) -> None:
    """Fill k̄, c, v and the expected speed-up M / (k̄ c + v) from measured times."""
    calls = sum(r.verify_calls for r in recs)
    forwards = sum(r.draft_forwards for r in recs)
    if not calls or not ar_step or row.tokens_per_verify is None:
        return
    row.mean_draft_forwards = forwards / calls
    row.verify_cost_ratio = sum(r.verify_time for r in recs) / calls / ar_step
    if forwards:
        row.draft_cost_ratio = sum(r.draft_time for r in recs) / forwards / ar_step
    c = row.draft_cost_ratio or 0.0
    row.expected_speedup = cycle_speedup(row.tokens_per_verify, row.mean_draft_forwards, c, row.verify_cost_ratio)


def recommend(rows: list[Summary]) -> dict[tuple[str, str], str]:
    """Fastest of our lossless methods per (model, task) (what a user should run; lossy early exit excluded)."""
    best: dict[tuple[str, str], Summary] = {}
    for row in rows:
        if row.method.split(":")[0] in PEERS or row.lossy:
            continue
        key = (row.model, row.task)
        if key not in best or row.tokens_per_second > best[key].tokens_per_second:
            best[key] = row
    return {k: v.method for k, v in best.items()}


# --------------------------------------------------------------------------- outputs
def machine_info(cfg: BenchConfig) -> dict:
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    run = cfg.run.resolve()
    gpu = torch.cuda.get_device_name(run.device) if run.device.type == "cuda" else None
    return {"cpu": cpu, "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "threads": cfg.run.threads, "git": git_commit(),
            "date": time.strftime("%Y-%m-%d %H:%M"), "device": str(run.device), "gpu": gpu,
            "dtype": dtype_name(run.dtype), "executor": cfg.run.executor}


def git_commit() -> str | None:
    """The toolkit's commit (with '+dirty' for local changes), when it runs from a git checkout."""

    root = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return rev + ("+dirty" if dirty else "")


def _fmt(x, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if x is None else format(x, spec) + suffix


def _exact_cell(r: Summary) -> str:
    """yes / n tie flip(s) / **n mismatched** (bugs), 'lossy' for early-exit decoding, n/a when sampling."""
    if r.lossy:
        return "lossy"
    if r.exact_mismatches is None:
        return "n/a"
    bugs = r.exact_mismatches if r.mismatches is None else r.mismatches
    cells = [f"{r.tie_flips} tie flip{'s' if r.tie_flips != 1 else ''}"] if r.tie_flips else []
    cells += [f"**{bugs} mismatched**"] if bugs else []
    return ", ".join(cells) or "yes"


def markdown_table(rows: list[Summary]) -> str:
    """Per task: one row per (model, method); quality columns appear when some row has them."""
    out = []
    for task in dict.fromkeys(r.task for r in rows):
        task_rows = [r for r in rows if r.task == task]
        agree = any(r.agreement is not None for r in task_rows)
        acc = any(r.answer_accuracy is not None for r in task_rows)
        head = ["model", "method", "tok/s", "vs AR", "vs HF generate", "α", "M", "k̄", "c", "expected", "opt share",
                "exact"] + (["agree (prefix)"] if agree else []) + (["answer acc"] if acc else [])
        out.append(f"\n#### {task}\n")
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "---|" * len(head))
        for r in task_rows:
            cells = [r.model, r.method, f"{r.tokens_per_second:.1f}", _fmt(r.speedup_vs_autoregressive, suffix="x"),
                     _fmt(r.speedup_vs_hf_generate, suffix="x"), _fmt(r.acceptance_rate), _fmt(r.tokens_per_verify),
                     _fmt(r.mean_draft_forwards), _fmt(r.draft_cost_ratio), _fmt(r.expected_speedup, suffix="x"),
                     _fmt(r.opt_time_share, ".1%"), _exact_cell(r)]
            if agree:
                cells.append("–" if r.agreement is None else f"{r.agreement:.2f} ({r.prefix_agreement:.2f})")
            if acc:
                cells.append(_fmt(r.answer_accuracy))
            out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def bugs(rows: list[Summary]) -> list[Summary]:
    """Rows of our drafters with greedy mismatches that are not tie flips (lossy early exit excluded).

    A transformers peer's mismatches are reported in its row but fail nothing: it runs other kernels,
    so in bf16/fp16 its rounding (not only ours) differs from our plain decoding's.
    """
    return [r for r in rows if not r.lossy and r.method.split(":")[0] not in PEERS
            and (r.exact_mismatches if r.mismatches is None else r.mismatches)]


def write_outputs(cfg: BenchConfig, records: list[Record], out_dir: Path, command: str) -> list[Summary]:
    """results.json, results.csv, results.md and plots under ``out_dir``."""
    from infer.measure import plots

    out_dir.mkdir(parents=True, exist_ok=True)
    rows = summarize(records)
    meta = machine_info(cfg) | {"command": command}
    config = asdict(cfg) | {"methods": [m.label for m in cfg.methods]}
    best = recommend(rows)
    payload = {"meta": meta, "config": config, "summary": [asdict(r) for r in rows],
               "recommended": [{"model": m, "task": t, "method": v} for (m, t), v in best.items()],
               "records": [asdict(r) for r in records]}
    (out_dir / "results.json").write_text(json.dumps(payload, indent=1) + "\n")
    with open(out_dir / "results.csv", "w", newline="") as f:
        fields = [k for k in asdict(rows[0]) if k != "tps_per_repeat"] if rows else []
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow(asdict(r))
    figures = plots.write_all(rows, records, out_dir)
    lines = ["# Benchmark results\n", f"`{command}`\n",
             f"Machine: {meta['gpu'] or meta['cpu']} ({meta['device']}); torch {meta['torch']}, transformers "
             f"{meta['transformers']}, {cfg.run.threads} thread(s), {meta['dtype']}; {meta['date']}. "
             f"{cfg.n} prompts per task (held-out end of "
             f"each set), {cfg.max_new_tokens} new tokens, median tokens/s of {cfg.repeats} repeats; "
             f"{'greedy' if cfg.sampling.greedy else f'sampling T={cfg.sampling.temperature}'}.\n",
             "α = accepted/drafted, M = tokens per verification, k̄ = draft forwards per verification, "
             "c = draft forward cost / full forward cost, expected = M / (k̄·c + v). exact: greedy output equals "
             "autoregressive (identical in fp32; in bf16/fp16 a near-tie can flip: a *tie flip* is a first "
             "divergence where the full model's margin between the two tokens is within the dtype's resolution; "
             "anything else is counted as mismatched, a bug). agree: lossy early exit's tokens equal to the full "
             "model's, overall (before the first divergence); answer acc: final number equals the reference's.\n",
             markdown_table(rows), "\n**Recommended (fastest of ours) per model and task:** " +
             "; ".join(f"{m}/{t}: `{v}`" for (m, t), v in best.items()) + "\n"]
    lines += [f"\n![{p.stem}]({p.name})\n" for p in figures]
    (out_dir / "results.md").write_text("\n".join(lines))
    return rows
