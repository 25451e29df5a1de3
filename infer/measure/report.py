"""Summaries of ``layerskip bench``'s records and its outputs: per (model, task, method) speed, acceptance, the
draft-verify cost model, exactness and quality; the recommendation; results.json, .csv, .md and plots.

Cost model (LayerSkip, Elhoushi et al. 2024, §4; speculative decoding, Leviathan et al. 2023): one draft-verify
cycle produces M tokens and costs k̄·c + v full-forward equivalents (k̄ draft forwards per cycle, c one draft
forward's cost and v the verification's, both relative to one full single-token forward), so the expected speed-up
over autoregressive decoding is M / (k̄·c + v).
"""

from __future__ import annotations

import csv
import io
import json
import statistics
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

from infer.decode.engine import tokens_per_verify
from infer.drafters.swift import SwiftStats
from infer.measure import plots
from infer.measure.bench import Record
from infer.measure.methods import BASELINE, PEERS, BenchConfig
from infer.measure.provenance import machine_info
from infer.measure.quality import WORSE_NATS, compare_to_base, flag, quality_table
from infer.model.plan import cycle_speedup
from layerskip_core import inputs, jsonfile
from layerskip_core.errors import UserError


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
    note: str | None = None
    """Why the speed-up does not measure drafting: 'never drafted' (a drafter that took only plain steps: its
    ratio is noise around 1) or 'too few samples' (fewer than ``MIN_SAMPLES`` timed generations); None otherwise."""
    verifier_loss: float | None = None
    """The model's (the verifier's) held-out loss in nats per token (``infer.measure.quality``; None: not measured)."""
    verifier_delta_nats: float | None = None
    """That loss minus the base model's on the same split (None: not measured, or no base to compare with)."""
    verifier_flag: str | None = None
    """'verifier worse by +0.28 nats' on a lossless row whose speed-up comes with a worse model; None otherwise."""
    batch_size: int | None = None
    """The batched bench's B (its speed-ups are against autoregressive and hf_generate at the same B); None: one
    prompt at a time."""
    row_latency: float | None = None
    """Batched: median seconds from a row's start to its finish, over the prompts and repeats."""
    speedup_vs_b1: float | None = None
    """Batched: tokens/s over the same method's at B = 1 (None: B = 1 not measured)."""
    decode_tokens_per_second: float | None = None
    """Batched, ours: the tokens decoding produced (each row's first comes from its prefill) over the run's wall time
    less its rows' prefill times (each row's share of the forward that prefilled it), median of the repeats; None
    for a peer."""
    drafted: int | None = None
    """Draft tokens proposed over the first repeat's prompts, beside ``new_tokens`` (how much was drafted at all: an
    acceptance of 0.67 over 3 drafted tokens in 128 is not drafting); None for a peer."""


MIN_SAMPLES = 3
"""Timed generations (prompts x repeats) below which a row's speed-up is marked as too few to judge."""



def summarize(records: list[Record]) -> list[Summary]:
    """One row per (model, task, method), with speed-ups against autoregressive and hf_generate on the same task."""
    groups: dict[tuple[str, str, str, int | None], list[Record]] = defaultdict(list)
    for r in records:
        groups[(r.model, r.task, r.method, r.batch_size)].append(r)
    rows = {key: _summarize_group(*key[:3], recs) for key, recs in groups.items()}
    ar_step = {key[:2] + key[3:]: _step_time(groups[key]) for key in groups if key[2] == BASELINE}
    for (model, task, method, size), row in rows.items():
        ar = rows.get((model, task, BASELINE, size))
        hf = rows.get((model, task, "hf_generate", size))
        one = rows.get((model, task, method, 1)) if size is not None else None
        row.speedup_vs_autoregressive = row.tokens_per_second / ar.tokens_per_second if ar else None
        row.speedup_vs_hf_generate = row.tokens_per_second / hf.tokens_per_second if hf else None
        row.speedup_vs_b1 = row.tokens_per_second / one.tokens_per_second if one else None
        _cost_model(row, groups[(model, task, method, size)], ar_step.get((model, task, size)))
    return list(rows.values())


def _step_time(recs: list[Record]) -> float | None:
    calls = sum(r.stats.verify_calls for r in recs)
    return sum(r.stats.verify_time for r in recs) / calls if calls else None


def _opt_time(recs: list[Record]) -> float:
    """Seconds SWIFT spent optimising over ``recs`` (0 for other drafters)."""
    return sum(r.stats.drafter.opt_time for r in recs if isinstance(r.stats.drafter, SwiftStats))


def _summarize_group(model: str, task: str, method: str, recs: list[Record]) -> Summary:
    by_repeat: dict[int, list[Record]] = defaultdict(list)
    for r in recs:
        by_repeat[r.repeat].append(r)
    size = recs[0].batch_size
    tps = [sum(r.stats.new_tokens for r in rs) / (rs[0].run_wall if size else sum(r.stats.wall_time for r in rs))
           for _, rs in sorted(by_repeat.items())]
    ours = any(r.stats.verify_calls for r in recs)
    drafted = sum(r.stats.drafted for r in recs)
    first = [r for r in recs if r.repeat == 0]
    wrong = [r for r in first if r.exact is False]
    flips = sum(1 for r in wrong if (r.divergence or {}).get("tie_flip"))
    judged = any(r.exact is not None for r in first)
    compared = [r for r in first if r.agree_total is not None]
    n_cmp = sum(r.stats.new_tokens for r in compared)
    answered = [r.answer_correct for r in first if r.answer_correct is not None]
    wall = sum(rs[0].run_wall for rs in by_repeat.values()) if size else sum(r.stats.wall_time for r in recs)
    return Summary(
        model=model, task=task, method=method, prompts=len(first), new_tokens=sum(r.stats.new_tokens for r in first),
        tokens_per_second=statistics.median(tps), tps_per_repeat=tps, speedup_vs_autoregressive=None,
        speedup_vs_hf_generate=None,
        acceptance_rate=sum(r.stats.accepted for r in recs) / drafted if drafted else None,
        tokens_per_verify=tokens_per_verify([r.stats for r in recs]) if ours else None,
        mean_draft_forwards=None, draft_cost_ratio=None, verify_cost_ratio=None, expected_speedup=None,
        opt_time_share=(_opt_time(recs) / wall) if ours and wall else None,
        exact_mismatches=len(wrong) if judged else None,
        tie_flips=flips if judged else None, mismatches=len(wrong) - flips if judged else None,
        lossy=any(r.lossy for r in first), drafted=sum(r.stats.drafted for r in first) if ours else None,
        agreement=sum(r.agree_total for r in compared) / n_cmp if n_cmp else None,
        prefix_agreement=sum(r.agree_prefix for r in compared) / n_cmp if n_cmp else None,
        answer_accuracy=sum(answered) / len(answered) if answered else None,
        note=_note(method, recs, drafted, ours), batch_size=size,
        row_latency=statistics.median(r.stats.wall_time for r in recs) if size else None,
        decode_tokens_per_second=statistics.median(_decode_rate(rs) for rs in by_repeat.values())
        if size and ours else None,
    )


def _decode_rate(recs: list[Record]) -> float:
    """Tokens/s of one batched run without its prefills (``Summary.decode_tokens_per_second``)."""
    decoding = recs[0].run_wall - sum(r.stats.prefill_time for r in recs)
    return sum(max(r.stats.new_tokens - 1, 0) for r in recs) / decoding if decoding > 0 else 0.0


def _note(method: str, recs: list[Record], drafted: int, ours: bool) -> str | None:
    """'never drafted' / 'too few samples' (see ``Summary.note``)."""
    if ours and method.split(":")[0] != BASELINE and not drafted and not any(r.lossy for r in recs):
        return "never drafted"
    if len(recs) < MIN_SAMPLES:  # every row, the baseline too: its peers' ratios rest on it
        return "too few samples"
    return None


def _cost_model(row: Summary, recs: list[Record], ar_step: float | None) -> None:
    """Fill k̄, c, v and the expected speed-up M / (k̄ c + v) from measured times."""
    calls = sum(r.stats.verify_calls for r in recs)
    forwards = sum(r.stats.drafter.draft_forwards for r in recs)
    if not calls or not ar_step or row.tokens_per_verify is None:
        return
    row.mean_draft_forwards = forwards / calls
    row.verify_cost_ratio = sum(r.stats.verify_time for r in recs) / calls / ar_step
    if forwards:
        row.draft_cost_ratio = sum(r.stats.draft_time for r in recs) / forwards / ar_step
    c = row.draft_cost_ratio or 0.0
    row.expected_speedup = cycle_speedup(row.tokens_per_verify, row.mean_draft_forwards, c, row.verify_cost_ratio)


def recommend(rows: list[Summary]) -> dict[tuple[str, str], str]:
    """Fastest of our lossless methods per (model, task) (what a user should run; lossy early exit excluded)."""
    best: dict[tuple[str, str], Summary] = {}
    for row in rows:
        if row.method.split(":")[0] in PEERS or row.lossy or row.note or row.batch_size is not None:
            continue
        key = (row.model, row.task)
        if key not in best or row.tokens_per_second > best[key].tokens_per_second:
            best[key] = row
    return {k: v.method for k, v in best.items()}



def attach_quality(rows: list[Summary], quality: dict[str, dict], labels: list[str], base: str | None) -> None:
    """Each model's verifier quality on its rows (deltas against ``base``, or the first model); lossy rows (their
    output is not the verifier's) carry the loss but no flag."""
    compare_to_base(quality, labels, base)
    for r in rows:
        q = quality.get(r.model)
        if q is not None:
            r.verifier_loss, r.verifier_delta_nats = q["loss"], q["delta_nats"]
            r.verifier_flag = None if r.lossy else flag(q)


def _verifier_cell(r: Summary) -> str:
    if r.lossy:
        return "– (lossy)"
    if r.verifier_loss is None:
        return "not measured"
    if r.verifier_flag:
        return f"**{r.verifier_flag}**"
    return "–" if r.verifier_delta_nats is None else f"{r.verifier_delta_nats:+.3f}"


def _fmt(x, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if x is None else format(x, spec) + suffix


def noted_cell(ratio: float | None, note: str | None) -> str:
    """A measured ratio with the note that says why it does not measure drafting beside it: '0.88x (never drafted)'."""
    cell = _fmt(ratio, suffix="x")
    return cell if note is None else f"{cell} ({note})"


def exact_cell(r: Summary) -> str:
    """yes / n tie flip(s) / **n mismatched** (bugs), 'lossy' for early-exit decoding, n/a when sampling."""
    if r.lossy:
        return "lossy"
    if r.exact_mismatches is None:
        return "n/a"
    bugs = r.exact_mismatches if r.mismatches is None else r.mismatches
    cells = [f"{r.tie_flips} tie flip{'s' if r.tie_flips != 1 else ''}"] if r.tie_flips else []
    cells += [f"**{bugs} mismatched**"] if bugs else []
    return ", ".join(cells) or "yes"


ALPHA = "α (drafted/tokens)"
"""The acceptance column: α, and beside it how many tokens were drafted for how many generated."""


def alpha_cell(r: Summary) -> str:
    """α with the drafted tokens and the generated ones beside it (``0.67 (3/128)``): a high α over a handful of
    drafts is not drafting."""
    return _fmt(r.acceptance_rate) if r.drafted is None else f"{_fmt(r.acceptance_rate)} ({r.drafted}/{r.new_tokens})"


def markdown_table(rows: list[Summary]) -> str:
    """Per task: one row per (model, method); quality columns appear when some row has them. Batched rows are in
    tables of their own (``batch_table``)."""
    out = []
    for task in dict.fromkeys(r.task for r in rows if r.batch_size is None):
        task_rows = [r for r in rows if r.task == task and r.batch_size is None]
        agree = any(r.agreement is not None for r in task_rows)
        acc = any(r.answer_accuracy is not None for r in task_rows)
        verifier = any(r.verifier_loss is not None for r in task_rows)
        head = ["model", "method", "tok/s", "vs AR", "vs HF generate", ALPHA, "M", "k̄", "c", "expected", "opt share",
                "exact"] + (["agree (prefix)"] if agree else []) + (["answer acc"] if acc else []) \
            + (["verifier Δ nats"] if verifier else [])
        out.append(f"\n#### {task}\n")
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "---|" * len(head))
        for r in task_rows:
            cells = [r.model, r.method, f"{r.tokens_per_second:.1f}",
                     noted_cell(r.speedup_vs_autoregressive, r.note), noted_cell(r.speedup_vs_hf_generate, r.note),
                     alpha_cell(r),
                     _fmt(r.tokens_per_verify), _fmt(r.mean_draft_forwards), _fmt(r.draft_cost_ratio),
                     "–" if r.note == "never drafted" else _fmt(r.expected_speedup, suffix="x"),
                     _fmt(r.opt_time_share, ".1%"), exact_cell(r)]
            if agree:
                cells.append("–" if r.agreement is None else f"{r.agreement:.2f} ({r.prefix_agreement:.2f})")
            if acc:
                cells.append(_fmt(r.answer_accuracy))
            if verifier:
                cells.append(_verifier_cell(r))
            out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n" + batch_table(rows)


def batch_table(rows: list[Summary]) -> str:
    """Per task, the batched rows by B, then method: total tokens/s, per-row latency, speed-ups at the same B and
    against the method's own B = 1, acceptance, tokens per verification and per-row exactness ('' when none)."""
    out = []
    head = ["model", "method", "B", "tok/s", "decode tok/s", "row latency (s)", "vs AR (same B)",
            "vs HF generate (same B)", "vs B=1", ALPHA, "M", "exact"]
    for task in dict.fromkeys(r.task for r in rows if r.batch_size is not None):
        task_rows = sorted((r for r in rows if r.task == task and r.batch_size is not None),
                           key=lambda r: r.batch_size)
        out += [f"\n#### {task}, batched\n", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in task_rows:
            cells = [r.model, r.method, str(r.batch_size), f"{r.tokens_per_second:.1f}",
                     _fmt(r.decode_tokens_per_second, ".1f"), _fmt(r.row_latency),
                     noted_cell(r.speedup_vs_autoregressive, r.note), noted_cell(r.speedup_vs_hf_generate, r.note),
                     _fmt(r.speedup_vs_b1, suffix="x"), alpha_cell(r), _fmt(r.tokens_per_verify),
                     exact_cell(r)]
            out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n" if out else ""


def bugs(rows: list[Summary]) -> list[Summary]:
    """Rows of our drafters with greedy mismatches that are not tie flips (lossy early exit excluded).

    A transformers peer's mismatches are reported in its row but fail nothing: it runs other kernels,
    so in bf16/fp16 its rounding (not only ours) differs from our plain decoding's.
    """
    return [r for r in rows if not r.lossy and r.method.split(":")[0] not in PEERS
            and (r.exact_mismatches if r.mismatches is None else r.mismatches)]


RESULT_FILES = ("results.json", "results.csv", "results.md", "records.jsonl")
"""What a bench writes in its folder (beside the plots): an earlier run's results, refused without --force."""
RECORDS_FILE = "records.jsonl"
"""One JSON object per line: a header ``{"command", "config", "meta"}``, then every finished record as the bench
finishes it (``RecordLog``), so a bench killed midway leaves its finished rows (``read_records``, ``rebuild``)."""


class RecordLog:
    """Appends each finished record to ``out_dir/records.jsonl`` (flushed per line), after a header line with the
    command and configuration. The file (and the folder) is made at the first record, so a bench refused before
    it runs leaves nothing; a new log starts the file afresh."""

    def __init__(self, cfg: BenchConfig, out_dir: Path, command: str):
        self.path = out_dir / RECORDS_FILE
        self._header = {"command": command, "config": _config_dict(cfg), "meta": machine_info(cfg.run)}
        self._file = None
        self.quality: dict[str, dict] = {}
        """Each model's verifier quality as the bench measured it (``add_quality``)."""

    def _write(self, value: dict) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "w", encoding="utf-8")  # noqa: SIM115  (open for the bench's whole run)
            self._file.write(json.dumps(self._header) + "\n")
        self._file.write(json.dumps(value) + "\n")
        self._file.flush()

    def __call__(self, record: Record) -> None:
        self._write({"record": record.to_dict()})

    def add_quality(self, label: str, quality: dict) -> None:
        """Keep and log a model's verifier quality (``infer.measure.quality``) as soon as it is measured."""
        self.quality[label] = quality
        self._write({"quality": {label: quality}})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def read_records(out_dir: Path) -> tuple[dict, list[Record]]:
    """(header, records) of ``out_dir/records.jsonl``. Only its last line can be cut (a kill mid-write: a bench writes
    whole lines): it is dropped with a note. A damaged line elsewhere (an edited or corrupted file) is refused naming
    the file and line, not skipped: a skipped record would change the rebuilt averages, and a note is easily missed."""
    path = out_dir / RECORDS_FILE
    lines = inputs.read_text(path, "bench records file", "give the --out folder of a bench").splitlines()
    header, records = {}, []
    for number, line in enumerate(lines, 1):
        try:
            value = _record_line(line)
        except ValueError as e:
            if number < len(lines) or not line.strip():
                raise UserError(f"{path}: line {number} is damaged ({e}); only the last line of a killed bench can be "
                                "cut short: restore the file or delete the line (its record is then lost)") from None
            print(f"layerskip: note: {path}: last line {number} cut short (a killed bench), dropped", file=sys.stderr)
            break
        if isinstance(value, Record):
            records.append(value)
        elif "quality" in value:
            header.setdefault("quality", {}).update(value["quality"])
        else:
            header = value | {"quality": header.get("quality", {})}
    return header, records


def _record_line(line: str) -> Record | dict:
    """One line of the records file: a ``Record``, or the header / a quality object; ValueError saying why not."""
    value = json.loads(line)  # a JSONDecodeError is a ValueError
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    if "record" not in value and not isinstance(value.get("quality", {}), dict):
        raise ValueError("its 'quality' is not an object")
    if "record" not in value:
        return value
    try:
        return Record.from_dict(value["record"])
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"its record does not read back: {type(e).__name__} {e}") from None


def _config_dict(cfg: BenchConfig) -> dict:
    return asdict(cfg) | {"methods": [m.label for m in cfg.methods], "run": cfg.run.to_dict()}


def write_outputs(cfg: BenchConfig, records: list[Record], out_dir: Path, command: str,
                  quality: dict[str, dict] | None = None, resolved: dict[str, dict[str, str]] | None = None) \
        -> list[Summary]:
    """results.json, results.csv, results.md and plots under ``out_dir``; ``quality``: each model's verifier quality
    (label -> ``infer.measure.quality.verifier_quality``), a model without one reported as not measured;
    ``resolved``: each model's drafters as they ran (model -> method -> spec: ``bench.check_methods``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = summarize(records)
    quality = dict(quality or {})
    attach_quality(rows, quality, cfg.labels, cfg.quality.base)
    meta = machine_info(cfg.run) | {"command": command}
    config = _config_dict(cfg)
    best = recommend(rows)
    payload = {"meta": meta, "config": config, "quality": quality, "resolved": resolved or {},
               "summary": [asdict(r) for r in rows],
               "recommended": [{"model": m, "task": t, "method": v} for (m, t), v in best.items()],
               "records": [r.to_dict() for r in records]}
    table = io.StringIO(newline="")
    fields = [k for k in asdict(rows[0]) if k != "tps_per_repeat"] if rows else []
    writer = csv.DictWriter(table, fieldnames=fields, extrasaction="ignore")
    writer.writeheader()
    for r in rows:
        writer.writerow(asdict(r))
    jsonfile.write(out_dir / "results.csv", table.getvalue())
    figures = plots.write_all(rows, records, out_dir)
    lines = ["# Benchmark results\n", f"`{command}`\n",
             f"Machine: {meta['gpu'] or meta['cpu']} ({meta['device']}); torch {meta['torch']}, transformers "
             f"{meta['transformers']}, {cfg.run.threads} thread(s), {meta['dtype']}; {meta['date']}. "
             f"{cfg.n} prompts per task ({_prompt_span(cfg)}), {cfg.max_new_tokens} new tokens, "
             f"median tokens/s of {cfg.repeats} repeats; "
             f"{'greedy' if cfg.sampling.greedy else f'sampling T={cfg.sampling.temperature}'}.\n",
             "α = accepted/drafted (beside it: tokens drafted / tokens generated), M = tokens per verification, "
             "k̄ = draft forwards per verification, "
             "c = draft forward cost / full forward cost, expected = M / (k̄·c + v). exact: greedy output equals "
             "autoregressive (identical in fp32; in bf16/fp16 a near-tie can flip: a *tie flip* is a first "
             "divergence where the full model's margin between the two tokens is within the dtype's resolution; "
             "anything else is counted as mismatched, a bug). 'never drafted': the drafter took only plain steps, "
             f"so its ratio is noise around 1; 'too few samples': fewer than {MIN_SAMPLES} timed generations. "
             "agree: lossy early exit's tokens equal to the full "
             "model's, overall (before the first divergence); answer acc: final number equals the reference's. "
             "verifier Δ nats: the model's held-out loss minus the base model's (the verifier's quality is every "
             "lossless method's output quality; worse by more than "
             f"{WORSE_NATS} nats is flagged).\n",
             BATCH_NOTE if cfg.batch_sizes else "", quality_table(quality, rows, cfg.labels), markdown_table(rows),
             "\n**Recommended (fastest of ours) per model and task:** " +
             "; ".join(f"{m}/{t}: `{v}`" for (m, t), v in best.items()) + "\n", methods_section(resolved or {})]
    lines += [f"\n![{p.stem}]({p.name})\n" for p in figures]
    jsonfile.write(out_dir / "results.md", "\n".join(lines))
    jsonfile.write(out_dir / "results.json", json.dumps(payload, indent=1) + "\n")  # whole, and last: it marks a
    return rows  # finished run (what the comparison script's steps look for)


def methods_section(resolved: dict[str, dict[str, str]]) -> str:
    """results.md's list of each method as written and as it ran where the two differ (options an exit adapter's
    tuned setting filled, a drafter's defaults spelled out): the full specs the bench's screen shortens."""
    lines = [f"- `{method}` on {model}: `{spec}`" for model, methods in resolved.items()
             for method, spec in methods.items() if spec != method]
    if not lines:
        return ""
    return "\n**Methods as they ran** (the options each drafter ran with beyond its defaults):\n\n" + "\n".join(lines) \
        + "\n"


BATCH_NOTE = ("Batched (`--batch-size B`): each method decodes the task's prompts B at a time (ours through the "
              "batched engine, a finished row's slot taken by the next prompt; `hf_generate` as left-padded batched "
              "`generate`, B prompts per call). tok/s = all generated tokens / the run's wall time (median of the "
              "repeats); decode tok/s = the same without the rows' prefill time (ours; "
              "– for a peer); row latency = median seconds from a row's start to its finish (a peer's row: its batch's "
              "wall time); vs AR and vs HF generate at the same B, vs B=1 against the same method at B = 1; exact: "
              "each row's greedy output equals that prompt decoded alone by plain decoding.\n")


def rebuild(out_dir: Path) -> list[Summary]:
    """results.json and a results.md table from ``out_dir/records.jsonl`` alone (a bench killed midway: its finished
    records, marked ``"partial": true``); returns the rows."""
    header, records = read_records(out_dir)
    rows = summarize(records)
    config, quality = header.get("config", {}), header.get("quality", {})
    labels = config.get("labels") or list(dict.fromkeys(r.model for r in rows))
    attach_quality(rows, quality, labels, (config.get("quality") or {}).get("base"))
    best = recommend(rows)
    payload = {"meta": header.get("meta", {}) | {"command": header.get("command")}, "config": header.get("config", {}),
               "quality": quality, "summary": [asdict(r) for r in rows], "partial": True, "rebuilt_from": RECORDS_FILE,
               "recommended": [{"model": m, "task": t, "method": v} for (m, t), v in best.items()],
               "records": [r.to_dict() for r in records]}
    head = f"# Benchmark results (rebuilt from {RECORDS_FILE}: {len(records)} finished records)\n\n"
    jsonfile.write(out_dir / "results.md", head + f"`{header.get('command')}`\n" + quality_table(quality, rows, labels)
                   + markdown_table(rows))
    jsonfile.write(out_dir / "results.json", json.dumps(payload, indent=1) + "\n")
    return rows


def _prompt_span(cfg) -> str:
    """Which prompts of each set a run timed: the held-out end, or the tuning span before it (``--skip``)."""
    if not cfg.skip:
        return "held-out end of each set"
    return f"the {cfg.n} before each set's last {cfg.skip}: a tuning span, not the held-out end"
