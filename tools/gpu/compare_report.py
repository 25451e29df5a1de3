"""The GPU comparison's report: compare.json's rows from the bench, the issue's targets, and its section of
RESULTS.md, rewritten after every step."""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path

from layerskip_core import jsonfile
from tools.doc_sections import GPU_COMPARE
from tools.gpu.compare_settings import CODE_TASK, TASKS
from tools.gpu.pipeline import Pipeline


def bench_rows(results: dict) -> list[dict]:
    """compare.json rows from the bench summary (the bench's task for the held-out code file is its stem)."""
    rows = []
    for r in results["summary"]:
        mismatches = r.get("mismatches", r.get("exact_mismatches"))
        rows.append({"model": r["model"], "method": r["method"], "task": r["task"],
                     "tok_s": r["tokens_per_second"], "vs_ar": r["speedup_vs_autoregressive"],
                     "alpha": r["acceptance_rate"], "mismatches": mismatches, "tie_flips": r.get("tie_flips"),
                     "tokens_per_verify": r.get("tokens_per_verify"), "draft_cost": r.get("draft_cost_ratio"),
                     "verify_cost": r.get("verify_cost_ratio"), "prompts": r.get("prompts"),
                     "verifier_loss": r.get("verifier_loss"), "verifier_delta_nats": r.get("verifier_delta_nats"),
                     "verifier_flag": r.get("verifier_flag")})
    return rows


def targets(rows: list[dict], quality_: dict, total_s: float) -> dict:
    """The issue's targets, each with the measured value and whether it is met (None: not measured)."""

    def best(model: str, task: str, prefix: str) -> float | None:
        vals = [r["vs_ar"] for r in rows if r["model"] == model and r["task"] == task
                and r["method"].startswith(prefix) and r["vs_ar"] is not None]
        return max(vals) if vals else None

    def worst_over_tasks(model: str, prefix: str) -> float | None:
        vals = [best(model, t, prefix) for t in TASKS]
        return min(v for v in vals if v is not None) if any(v is not None for v in vals) else None

    def check(value, ok) -> dict:
        return {"value": value, "met": None if value is None else bool(ok(value))}

    base_q, trained_q = quality_.get("base", {}), quality_.get("trained", {})
    both = [q for q in (base_q, trained_q) if "gsm8k_accuracy" in q and "humaneval_prompt_loss" in q]
    acc_drop = (base_q["gsm8k_accuracy"] - trained_q["gsm8k_accuracy"]) if len(both) == 2 else None
    loss_ratio = (trained_q["humaneval_prompt_loss"] / base_q["humaneval_prompt_loss"]) if len(both) == 2 else None
    return {
        "trained early_exit vs AR, held-out code (>= 1.5)": check(best("trained", CODE_TASK, "early_exit"),
                                                                  lambda v: v >= 1.5),
        "trained early_exit vs AR, HumanEval (>= 1.0)": check(best("trained", "humaneval", "early_exit"),
                                                              lambda v: v >= 1.0),
        "GSM8K accuracy drop base -> trained (<= 0.02)": check(acc_drop, lambda v: v <= 0.02),
        "HumanEval prompt loss trained / base (<= 1.05)": check(loss_ratio, lambda v: v <= 1.05),
        "trained self_sd vs AR, worst task (>= 1.0)": check(worst_over_tasks("trained", "self_sd"),
                                                           lambda v: v >= 1.0),
        "trained swift vs AR, worst task (>= 1.0)": check(worst_over_tasks("trained", "swift"), lambda v: v >= 1.0),
        "whole run in seconds (<= 480)": check(round(total_s, 1), lambda v: v <= 480),
    }


class Report:
    """compare.json, rewritten into ``results`` after every step (a command killed midway keeps what it measured),
    with ``gpu_section.md`` beside it; rows and quality of a ``previous`` stage's compare.json are carried over."""

    def __init__(self, results: Path, head: dict, previous: dict | None):
        self.results, self.previous = results, previous or {}
        self.data = {**head, "rows": [], "quality": {}, "targets": {}, "steps": [], "notes": [], "complete": False,
                     "stage_of": self.previous.get("command")}

    def save(self, p: Pipeline, rows: list[dict], quality_: dict, total: float) -> None:
        fresh = {(r["model"], r["task"], r["method"]) for r in rows}
        carried = [r for r in self.previous.get("rows", []) if (r["model"], r["task"], r["method"]) not in fresh]
        quality_ = {**self.previous.get("quality", {}), **quality_}
        self.data |= {"rows": carried + rows, "quality": quality_, "steps": [asdict(st) for st in p.steps],
                      "notes": p.notes, "total_seconds": round(total, 1)}
        self.data["targets"] = targets(self.data["rows"], quality_, total)
        self.results.mkdir(parents=True, exist_ok=True)
        jsonfile.write(self.results / "compare.json", json.dumps(self.data, indent=1) + "\n")
        jsonfile.write((self.results / "gpu_section.md"), markdown_section(self.data))


def partial_rows(p: Pipeline, task: str) -> list[dict]:
    """Rows of a bench stopped midway, from the records it wrote as it went (``records.jsonl``)."""
    from infer.measure.report import RECORDS_FILE, rebuild  # local: keeps gpu_compare's start-up torch-free

    out = p.out / f"bench_{task}"
    if not (out / RECORDS_FILE).is_file():
        return []
    summary = [asdict(r) for r in rebuild(out)]
    p.note(f"bench_{task} was stopped before its end: {len(summary)} row(s) from its finished records")
    return bench_rows({"summary": summary})


def _f(x, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if x is None else f"{x:{spec}}{suffix}"


def method_key(label: str) -> str:
    """A method label without its per-model plan path (``self_sd:plan=runs/x/plans/base.json`` -> ``self_sd``)."""
    return re.sub(r":plan=[^:]*", "", label)


def _exact(row: dict) -> str:
    if row["mismatches"] is None and row["tie_flips"] is None:
        return "–"
    cells = [f"{row['tie_flips']} tie flip(s)"] if row.get("tie_flips") else []
    cells += [f"**{row['mismatches']} mismatched**"] if row.get("mismatches") else []
    return ", ".join(cells) or "identical"


def _verifier(row: dict | None) -> str:
    """The trained row's verifier change against the base model: its flag, its delta, or 'not measured'."""
    if row is None or row.get("verifier_loss") is None:
        return "not measured"
    if row.get("verifier_flag"):
        return f"**{row['verifier_flag']}**"
    return _f(row.get("verifier_delta_nats"), "+.3f")


def markdown_section(c: dict) -> str:
    s = c["settings"]
    lines = [GPU_COMPARE.begin, "## GPU: trained vs training-free, one run", "",
             f"`{c['command']}` on {c['device']}, commit {c['commit']}, {c['date']}, {c['total_seconds']:.0f} s in all"
             + (" (**dry run**: CPU, tiny settings; it checks the wiring and measures nothing)" if c["dry_run"] else "")
             + ".", "",
             f"Recipe `{c['recipe']}`; bench in {s['dtype']}: {s['prompts']} held-out prompts per task, "
             f"{s['max_new_tokens']} new tokens, median of {s['repeats']} repeats, methods interleaved per prompt.",
             "", "### Quality, base -> trained", "",
             "| | base | trained |", "|---|---:|---:|"]
    qb, qt = c["quality"].get("base", {}), c["quality"].get("trained", {})
    for key, label in (("humaneval_prompt_loss", "HumanEval prompt loss"),
                       ("humaneval_solution_loss", "HumanEval solution loss (given the prompt)"),
                       ("gsm8k_accuracy", "GSM8K sample greedy accuracy")):
        lines.append(f"| {label} | {_f(qb.get(key), '.3f')} | {_f(qt.get(key), '.3f')} |")
    eb, et = qb.get("exits", {}), qt.get("exits", {})
    for e in eb.get("agreement", {}):
        lines.append(f"| held-out code, exit {e}: agreement / loss | {_f(eb['agreement'][e])} / "
                     f"{_f(eb['loss'][e])} | {_f(et.get('agreement', {}).get(e))} / "
                     f"{_f(et.get('loss', {}).get(e))} |")
    lines += ["", "### Decoding speed", "",
              "trained verifier: the trained model's held-out loss minus the base model's, in nats per token, on the "
              "bench's split (the front of HumanEval, none of it timed; `infer/measure/quality.py`): every lossless "
              "method's output is its verifier's, so a speed-up of a worse verifier is flagged.", "",
              "| task | method | base tok/s | base vs AR | base α | trained tok/s | trained vs AR | trained α "
              "| trained verifier | exact |",
              "|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    by_key = {(r["model"], r["task"], method_key(r["method"])): r for r in c["rows"]}
    methods = list(dict.fromkeys(method_key(r["method"]) for r in c["rows"]))
    for task in TASKS:
        for m in methods:
            b, t = by_key.get(("base", task, m)), by_key.get(("trained", task, m))
            if b is None and t is None:
                continue
            exact = "; ".join(x for x in (_exact(b) if b else "", _exact(t) if t else "") if x)
            lines.append(f"| {task} | `{m}` | {_f(b and b['tok_s'], '.1f')} | {_f(b and b['vs_ar'], '.2f', 'x')} | "
                         f"{_f(b and b['alpha'])} | {_f(t and t['tok_s'], '.1f')} | "
                         f"{_f(t and t['vs_ar'], '.2f', 'x')} | {_f(t and t['alpha'])} | {_verifier(t)} | {exact} |")
    lines += ["", "### Targets", "", "| target | measured | met |", "|---|---:|---|"]
    for name, t in c["targets"].items():
        met = "–" if t["met"] is None else ("yes" if t["met"] else "**no**")
        lines.append(f"| {name} | {_f(t['value'], '.3g')} | {met} |")
    lines += ["", "### Steps", "", "| step | seconds | |", "|---|---:|---|"]
    for st in c["steps"]:
        lines.append(f"| {st['name']} | {st['seconds']:.1f} | {'reused' if st['reused'] else ''} |")
    if c["notes"]:
        lines += ["", "Notes: " + " ".join(f"{n}." if not n.endswith(".") else n for n in c["notes"])]
    lines += ["", GPU_COMPARE.end, ""]
    return "\n".join(lines)
