"""What ``layerskip bench`` prints: per task one short table under readable method labels, a legend of its columns,
and the recommendation with why. The full specs, every column (the cost model's k̄, c and expected speed-up, the
optimiser's share, the verifier's quality) and their legend stay in results.md (``infer.measure.report``).
"""

from __future__ import annotations

from pathlib import Path

from infer.measure.report import alpha_cell, batch_table, exact_cell, noted_cell, recommend

LABEL_WIDTH = 40
"""The widest method label on screen; a longer one is cut (the full spec is in results.md)."""
SHORT_KEYS = {"exit_layer": "E", "num_draft": "k", "confidence": "c", "draft_vocab": "V", "keep_last": "keep",
              "target_exit": "exit", "max_tree_nodes": "tree"}
"""Option names as the screen shows them: the compact specs' short names and a few words."""
NOISE = 0.02
"""A speed-up within this of 1 is within the run's noise: plain decoding serves as well."""
LEGEND = [
    "tok/s: median tokens/s over the repeats; vs plain: over plain decoding (autoregressive) on the same prompts; "
    "vs HF: over transformers' generate",
    "α: share of drafted tokens accepted (beside it: tokens drafted / generated); M: tokens per verification "
    "(1 = plain decoding)",
    "exact: output identical to plain decoding (lossless); 'never drafted': only plain steps, its ratio is noise",
]


def short_label(label: str) -> str:
    """``label`` as the screen shows it: as written when it fits 28 characters, else its drafter and its options as
    short words (``early_exit:adapter=default:k=6:confidence=0.5:keep_last=true:tree=true:max_tree_nodes=4`` ->
    ``early_exit adapter k=6 c=0.5 keep tree=4``; a file by its name's stem), cut at ``LABEL_WIDTH``."""
    if len(label) <= 28:
        return label
    name, *parts = label.split(":")
    options = dict(part.partition("=")[::2] for part in parts)
    if options.get("tree") in ("true", "True") and "max_tree_nodes" in options:
        options.pop("tree")  # tree4 says both
    words = []
    for key, value in options.items():
        short = SHORT_KEYS.get(key, key)
        if value in ("true", "True") or value == "default":
            words.append(short)
        elif value in ("false", "False"):
            words.append(f"no-{short}")
        else:
            if "/" in value or value.endswith((".json", ".safetensors")):  # a file: its name (a run's: its folder)
                path = Path(value)
                value = path.parent.name if path.stem == "adapter" and path.parent.name else path.stem
            words.append(f"{short}={value}")
    text = " ".join([name, *words])
    return text if len(text) <= LABEL_WIDTH else text[:LABEL_WIDTH - 1] + "…"


def short_labels(labels: list[str]) -> dict[str, str]:
    """Each label's screen label, made unique (``#2``, ``#3`` after a repeated one)."""
    out: dict[str, str] = {}
    for label in dict.fromkeys(labels):
        short, n = short_label(label), 2
        while short in out.values():
            short = f"{short_label(label)[:LABEL_WIDTH - 3]}#{n}"
            n += 1
        out[label] = short
    return out


def _cell(x, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if x is None else format(x, spec) + suffix


def _row(r, label: str, several_models: bool, hf: bool) -> list[str]:
    """One summary row's cells (``infer.measure.report.Summary``)."""
    cells = ([r.model] if several_models else []) + [label, f"{r.tokens_per_second:.1f}",
                                                     noted_cell(r.speedup_vs_autoregressive, r.note)]
    cells += [noted_cell(r.speedup_vs_hf_generate, r.note)] if hf else []
    return cells + [alpha_cell(r), _cell(r.tokens_per_verify), exact_cell(r)]


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()  # noqa: E731
    return [line(head), line(["-" * w for w in widths]), *map(line, rows)]


def recommendation(rows: list, labels: dict[str, str]) -> str:
    """The recommendation for one (model, task) and why: the fastest lossless method of ours measured, its speed-up,
    M and exactness, and the runner-up; plain decoding when nothing beat it beyond ``NOISE``."""
    eligible = sorted((r for r in rows if recommend([r])), key=lambda r: -r.tokens_per_second)  # report's rule
    if not eligible:
        return "no recommendation: no lossless method of ours has enough timed generations"
    top, runner_up = eligible[0], eligible[1] if len(eligible) > 1 else None
    best = top.method
    nxt = f"; next: {labels[runner_up.method]} {_cell(runner_up.speedup_vs_autoregressive, suffix='x')}" \
        if runner_up else ""
    if best == "autoregressive" or (top.speedup_vs_autoregressive or 0) < 1 + NOISE:
        return (f"plain decoding (autoregressive): no drafter measured faster by more than {NOISE:.0%} on these "
                f"prompts{nxt}")
    alpha = "" if top.acceptance_rate is None else f", α {top.acceptance_rate:.2f}"
    exact = exact_cell(top)
    output = "output identical to plain decoding" if exact == "yes" else f"exact: {exact}"
    return (f"{labels[best]}, {top.speedup_vs_autoregressive:.2f}x plain decoding ({top.tokens_per_second:.1f} tok/s; "
            f"M {_cell(top.tokens_per_verify)}{alpha}; {output}); why: the fastest lossless method measured on these "
            f"prompts{nxt}")


def screen(rows: list, out_dir: Path | None = None) -> str:
    """The bench's printed summary of ``rows`` (``Summary`` rows, one prompt at a time; batched rows keep the results
    page's table): per task a table, the legend once, and per (model, task) the recommendation."""
    single = [r for r in rows if r.batch_size is None]
    labels = short_labels([r.method for r in rows])
    several = len({r.model for r in single}) > 1
    hf = any(r.speedup_vs_hf_generate is not None for r in single)
    head = (["model"] if several else []) + ["method", "tok/s", "vs plain"] + (["vs HF"] if hf else []) + \
        ["α (drafted/generated)", "M", "exact"]
    out = []
    for task in dict.fromkeys(r.task for r in single):
        task_rows = [r for r in single if r.task == task]
        out += ["", f"{task}:"] + _table(head, [_row(r, labels[r.method], several, hf) for r in task_rows])
        for model in dict.fromkeys(r.model for r in task_rows):
            mine = [r for r in task_rows if r.model == model]
            out.append(f"recommended{f' for {model}' if several else ''}: {recommendation(mine, labels)}")
    if single:
        out += [""] + LEGEND
    where = f" ({out_dir / 'results.md'})" if out_dir is not None else ""
    cut = [f"{short} = {label}" for label, short in labels.items() if short != label]
    if cut:
        out.append("labels cut short here, in full in results.md" + where + ": " + "; ".join(cut))
    out.append("results.md also has the cost model (k̄, c, expected), the optimiser's share and the verifier's "
               f"quality{where}")
    return "\n".join(out) + "\n" + batch_table(rows)
