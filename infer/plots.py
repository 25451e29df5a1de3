"""Figures for benchmark results (matplotlib, written as PNG next to results.md)."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

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


def speedup_bars(rows, path: Path) -> Path | None:
    rows = [r for r in rows if r.speedup_vs_autoregressive is not None]
    if not rows:
        return None
    plt = _plt()
    tasks = list(dict.fromkeys(r.task for r in rows))
    series = [(model, method) for model in dict.fromkeys(r.model for r in rows) for method in _bar_methods(rows)]
    series = [s for s in series if any((r.model, r.method) == s for r in rows)]
    width = 0.8 / max(len(series), 1)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(tasks) * max(1, len(series) / 4)), 4))
    for i, (model, method) in enumerate(series):
        vals = [next((r.speedup_vs_autoregressive for r in rows if (r.model, r.method, r.task) == (model, method, t)),
                     0.0) for t in tasks]
        ax.bar([j + i * width for j in range(len(tasks))], vals, width, label=f"{model} · {method}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(tasks))], tasks)
    ax.set_ylabel("speed-up vs our autoregressive")
    ax.set_title("Measured speed-up per task")
    ax.legend(fontsize=7, ncol=2)
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
    """SWIFT's best-plan matchness along each stream (drafter stats carry 'matchness_trajectory')."""
    series = defaultdict(list)
    for r in records:
        if r.repeat == 0 and r.drafter_stats.get("matchness_trajectory"):
            series[f"{r.model} · {r.task} · {r.method}"].extend(r.drafter_stats["matchness_trajectory"])
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


def write_all(rows, records, out_dir: Path) -> list[Path]:
    paths = [speedup_bars(rows, out_dir / "speedup.png")]
    paths += sweep_heatmaps(rows, out_dir)
    paths.append(acceptance_by_exit(rows, out_dir / "acceptance_by_exit.png"))
    paths.append(matchness_over_time(records, out_dir / "matchness.png"))
    return [p for p in paths if p is not None]
