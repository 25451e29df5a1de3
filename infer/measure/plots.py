"""Figures for benchmark results (matplotlib, written as PNG next to results.md)."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

from layerskip_core.heldout import perplexity

MAX_BARS = 10


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _early_exit_grid(method: str) -> tuple[int, int] | None:
    m = re.fullmatch(r"early_exit:E=(\d+):k=(\d+)", method)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _bar_methods(rows) -> list[str]:
    """All methods if few; else the baseline, peers and the fastest of ours."""
    methods = list(dict.fromkeys(r.method for r in rows))
    if len(methods) <= MAX_BARS:
        return methods
    keep = [m for m in methods if m == "autoregressive" or m.split(":")[0].startswith(("hf_", "prompt_lookup"))]
    ours = sorted({r.method for r in rows if r.method not in keep},
                  key=lambda m: -max(r.tokens_per_second for r in rows if r.method == m))
    return keep + ours[:MAX_BARS - len(keep)]


def method_colours(methods: list[str]) -> dict[str, tuple]:
    """One distinct colour per method, the same in every facet (tab10, or tab20 beyond ten methods)."""
    plt = _plt()
    cmap = plt.get_cmap("tab10" if len(methods) <= 10 else "tab20")
    return {m: cmap(i % cmap.N) for i, m in enumerate(methods)}


def speedup_bars(rows, path: Path) -> Path | None:
    """Speed-up vs our autoregressive: one facet per model (e.g. base | trained), tasks on the x axis,
    one colour per method across facets, the legend outside the axes."""
    rows = [r for r in rows if r.speedup_vs_autoregressive is not None]
    if not rows:
        return None
    plt = _plt()
    models = list(dict.fromkeys(r.model for r in rows))
    tasks = list(dict.fromkeys(r.task for r in rows))
    methods = _bar_methods(rows)
    colours = method_colours(methods)
    width = 0.8 / max(len(methods), 1)
    panel = max(3.0, 0.35 * len(tasks) * len(methods) + 1.0)
    fig, axes = plt.subplots(1, len(models), figsize=(panel * len(models) + 2.8, 4.2), sharey=True, squeeze=False)
    speedup = {(r.model, r.method, r.task): r.speedup_vs_autoregressive for r in rows}
    for ax, model in zip(axes[0], models, strict=True):
        for i, method in enumerate(methods):
            vals = [speedup.get((model, method, t)) for t in tasks]
            xs = [j + i * width for j, v in enumerate(vals) if v is not None]
            ax.bar(xs, [v for v in vals if v is not None], width, color=colours[method], label=method)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(tasks))], tasks)
        ax.set_title(model)
    axes[0][0].set_ylabel("speed-up vs our autoregressive")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[m]) for m in methods]
    return _save_with_legend(fig, handles, methods, "Measured speed-up per task", path)


def exit_quality(evals: dict[str, dict], path: Path) -> Path:
    """Per-exit perplexity and top-1 agreement with the final layer, one line per evaluated model."""
    plt = _plt()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name, d in evals.items():
        exits = sorted(d["agreement"], key=int)
        xs = [int(e) for e in exits]
        right.plot(xs, [d["agreement"][e] for e in exits], marker="o", label=name)
        left.plot(xs, [perplexity(d["loss"][e]) for e in exits], marker="o", label=name)
    left.set_yscale("log")
    left.set_xlabel("exit layer")
    left.set_ylabel("perplexity (log scale)")
    right.set_xlabel("exit layer")
    right.set_ylabel("top-1 agreement with the final layer")
    right.set_ylim(0, 1)
    right.legend(loc="lower right", fontsize=8)
    fig.suptitle("Early-exit quality on held-out text")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def sweep_heatmaps(rows, out_dir: Path) -> list[Path]:
    paths = []
    groups = defaultdict(dict)
    for r in rows:
        grid = _early_exit_grid(r.method)
        if grid:
            groups[(r.model, r.task)][grid] = r.tokens_per_second
    for (model, task), cells in groups.items():
        exits = sorted({e for e, _ in cells})
        ks = sorted({k for _, k in cells})
        if len(exits) < 2 or len(ks) < 2:
            continue
        ar = next((r.tokens_per_second for r in rows if (r.model, r.task, r.method) == (model, task, "autoregressive")),
                  None)
        plt = _plt()
        grid = [[cells.get((e, k), float("nan")) for k in ks] for e in exits]
        fig, ax = plt.subplots(figsize=(1.2 * len(ks) + 2, 0.5 * len(exits) + 1.5))
        im = ax.imshow(grid, cmap="viridis", aspect="auto")
        for i in range(len(exits)):
            for j in range(len(ks)):
                ax.text(j, i, f"{grid[i][j]:.1f}", ha="center", va="center", color="white", fontsize=8)
        ax.set_xticks(range(len(ks)), [str(k) for k in ks])
        ax.set_yticks(range(len(exits)), [str(e) for e in exits])
        ax.set_xlabel("draft length k")
        ax.set_ylabel("exit layer E")
        title = f"early-exit tokens/s · {model} · {task}"
        ax.set_title(title + (f" (AR {ar:.1f})" if ar else ""), fontsize=9)
        fig.colorbar(im, ax=ax)
        fig.tight_layout()
        path = out_dir / f"sweep_{_slug(model)}_{_slug(task)}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def acceptance_by_exit(rows, path: Path) -> Path | None:
    """Mean acceptance per exit layer, one line per (model, task): before/after training side by side."""
    lines = defaultdict(lambda: defaultdict(list))
    for r in rows:
        grid = _early_exit_grid(r.method)
        if grid and r.acceptance_rate is not None:
            lines[(r.model, r.task)][grid[0]].append(r.acceptance_rate)
    lines = {k: v for k, v in lines.items() if len(v) >= 2}
    if not lines:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for (model, task), per_exit in lines.items():
        exits = sorted(per_exit)
        ax.plot(exits, [sum(per_exit[e]) / len(per_exit[e]) for e in exits], marker="o", label=f"{model} · {task}")
    ax.set_xlabel("exit layer E")
    ax.set_ylabel("acceptance rate α")
    ax.set_ylim(0, 1)
    ax.set_title("Early-exit draft acceptance per exit layer")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def matchness_over_time(records, path: Path) -> Path | None:
    """SWIFT's best-plan matchness along each stream (its drafter stats carry ``matchness_trajectory``)."""
    from infer.drafters.swift import SwiftStats  # torch-heavy: this module is imported by torch-free commands

    series = defaultdict(list)
    for r in records:
        if r.repeat == 0 and isinstance(r.stats.drafter, SwiftStats) and r.stats.drafter.matchness_trajectory:
            series[f"{r.model} · {r.task} · {r.method}"].extend(r.stats.drafter.matchness_trajectory)
    return plot_matchness(series, path, "SWIFT layer-set optimisation")


def plot_matchness(series: dict[str, list], path: Path, title: str) -> Path | None:
    """One line per label: [(optimisation step, best matchness), ...]; None when every series is empty."""
    series = {label: traj for label, traj in series.items() if traj}
    if not series:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, traj in series.items():
        ax.plot([p[0] for p in traj], [p[1] for p in traj], label=label, linewidth=1)
    ax.set_xlabel("optimisation step (cumulative over the stream)")
    ax.set_ylabel("best matchness")
    ax.set_ylim(0, 1)
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", s)


def tokens_per_second_by_batch(rows, path: Path) -> Path | None:
    """Batched rows: total tokens/s against the batch size B, one line per method (the colours of
    ``method_colours``), one facet per (model, task), B on a log-2 axis; None without batched rows."""
    rows = [r for r in rows if r.batch_size is not None]
    if not rows:
        return None
    plt = _plt()
    facets = list(dict.fromkeys((r.model, r.task) for r in rows))
    methods = list(dict.fromkeys(r.method for r in rows))
    colours = method_colours(methods)
    sizes = sorted({r.batch_size for r in rows})
    fig, axes = plt.subplots(1, len(facets), figsize=(4.5 * len(facets) + 2.8, 4.2), squeeze=False)
    for ax, (model, task) in zip(axes[0], facets, strict=True):
        for method in methods:
            line = sorted((r.batch_size, r.tokens_per_second) for r in rows
                          if (r.model, r.task, r.method) == (model, task, method))
            if line:
                ax.plot([b for b, _ in line], [t for _, t in line], marker="o", color=colours[method], label=method)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("batch size B")
        ax.set_title(f"{model} · {task}", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("total tokens/s (all rows)")
    handles = [plt.Line2D([0], [0], color=colours[m], marker="o") for m in methods]
    return _save_with_legend(fig, handles, methods, "Batched decoding: throughput vs batch size", path)


def _save_with_legend(fig, handles, labels: list[str], title: str, path: Path) -> Path:
    """One legend to the right of every panel, the title, and the figure saved to ``path`` (and closed)."""
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    _plt().close(fig)
    return path


def write_all(rows, records, out_dir: Path) -> list[Path]:
    paths = [speedup_bars([r for r in rows if r.batch_size is None], out_dir / "speedup.png"),
             tokens_per_second_by_batch(rows, out_dir / "batch_tokens_per_second.png")]
    paths += sweep_heatmaps(rows, out_dir)
    paths.append(acceptance_by_exit(rows, out_dir / "acceptance_by_exit.png"))
    paths.append(matchness_over_time(records, out_dir / "matchness.png"))
    return [p for p in paths if p is not None]
