"""Assemble docs/RESULTS.md from the outputs of tools/results/compare_trained_vs_free.sh.

    python -m tools.results.write_results --runs runs/compare --out docs/RESULTS.md

Tables and plots are regenerated from the run folder; hand-written text between the markers
``<!-- notes:NAME -->`` and ``<!-- /notes:NAME -->`` in an existing page is kept, and so is the GPU
section that ``tools/gpu/gpu_compare.py`` writes between ``<!-- gpu-compare:begin -->`` and ``end``.
A section whose input is missing from the run folder keeps the page's committed section (said on stderr), so a
partial run folder updates what it holds and loses nothing; a run folder that does not exist is refused.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from infer.measure.plots import exit_quality
from layerskip_core import jsonfile
from layerskip_core.cli import Parser, run_main
from layerskip_core.errors import UserError
from tools.doc_sections import GPU_COMPARE

NOTE = re.compile(r"<!-- notes:(\w+) -->\n(.*?)<!-- /notes:\1 -->", re.S)
COMMANDS = "Commands of this run"
VERIFY_COST = "Cost of verifying T tokens at once"
GEMMA = "Gemma 3 270M beside the default model (preliminary)"
EXITS = "Early-exit agreement before and after LayerSkip training"
SWIFT_STREAM = "SWIFT over a stream of HumanEval and GSM8K prompts"


@contextmanager
def _reading(path: Path) -> Iterator[None]:
    """A section built from ``path``: a file that is damaged (cut off by a kill, edited) or not what its step writes
    is one line naming it, not a traceback, and the page is left as it is."""
    try:
        yield
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, StopIteration, RecursionError) as e:
        what = f"{type(e).__name__}: {' '.join(str(e).split())[:120]}"
        raise UserError(f"{path} is damaged or not what its step writes ({what}); delete it and rerun that step "
                        "(tools/results/compare_trained_vs_free.sh reruns a step whose output is missing); the page is "
                        "left as it is") from None


def _json(path: Path) -> dict:
    """A run folder's JSON file, read strictly (finite numbers, no key twice, an object)."""
    return jsonfile.read(path, "result file", hint="delete it and rerun the step that writes it")


def _notes(old: str, name: str) -> str:
    found = {m.group(1): m.group(2) for m in NOTE.finditer(old)}
    body = found.get(name, "_(findings to be written after reading the numbers)_\n")
    return f"<!-- notes:{name} -->\n{body}<!-- /notes:{name} -->\n"


def _old_section(old: str, title: str) -> str | None:
    """The page's committed section headed ``## title``: up to the next ``## `` heading or the GPU section."""
    start = old.find(f"## {title}\n")
    if start != 0 and (start < 0 or old[start - 1] != "\n"):
        return None
    ends = [i for i in (old.find("\n## ", start), old.find(GPU_COMPARE.begin, start)) if i >= 0]
    end = min(ends) + 1 if ends else len(old)
    return old[start:end].removesuffix("\n")  # the page's lines are joined with one newline


def _section(old: str, title: str, built: list[str] | None, source: Path) -> list[str]:
    """A regenerated section, or where its input is missing the committed one (said on stderr), never nothing."""
    if built is not None:
        return built
    kept = _old_section(old, title)
    if kept is None:
        return []
    print(f"kept the committed section '{title}': {source} is missing", file=sys.stderr)
    return [kept]


def _bench_section(run: Path, title: str, img_dir: Path, old: str, name: str) -> list[str]:
    path = run / "results.json"
    if not path.is_file():
        return _section(old, title, None, path)
    with _reading(path):
        return _bench_lines(run, title, img_dir, old, name, _json(path))


def _bench_lines(run: Path, title: str, img_dir: Path, old: str, name: str, payload: dict) -> list[str]:
    from infer.measure.quality import quality_table  # lazy: torch, only for the bench sections
    from infer.measure.report import BATCH_NOTE, Summary, markdown_table  # lazy: torch, as above

    rows = [Summary(**r) for r in payload["summary"]]
    labels = payload["config"].get("labels") or list(dict.fromkeys(r.model for r in rows))
    meta = payload["meta"]
    out = [f"## {title}\n", f"```\n{meta['command']}\n```\n",
           f"{meta.get('gpu') or meta['cpu']}, {meta.get('device', 'cpu')} {meta.get('dtype', 'fp32')}, "
           f"{meta['threads']} thread(s), torch {meta['torch']}, transformers {meta['transformers']}, "
           f"{meta['date']}, commit {meta.get('git') or 'not recorded'}; "
           f"{_span(payload['config'])} per task, "
           f"{payload['config']['max_new_tokens']} new tokens, median of {payload['config']['repeats']} repeat(s).\n",
           BATCH_NOTE if payload["config"].get("batch_sizes") else "",
           quality_table(payload.get("quality", {}), rows, labels), markdown_table(rows)]
    best = payload.get("recommended", [])
    if best:
        out.append("Fastest of ours per model and task: " +
                   "; ".join(f"{b['model']}/{b['task']}: `{b['method']}`" for b in best) + "\n")
    for png in sorted(run.glob("*.png")):
        if png.name.startswith("sweep_") and not name.endswith("sweep"):
            continue  # E x k heatmaps only mean something for a sweep
        target = img_dir / f"{name}_{png.name}"
        shutil.copyfile(png, target)
        out.append(f"![{png.stem}]({target.parent.name}/{target.name})\n")
    out.append(_notes(old, name))
    return out


def _span(config: dict) -> str:
    """The prompts a bench timed: the held-out end of each set, or (``--skip``) the tuning span before it."""
    n, skip = config["n"], config.get("skip", 0)
    return f"{n} held-out prompts" if not skip else f"{n} tuning prompts (before the last {skip}: not held out)"


def _table(head: list[str], rows: list[list[str]], sep: str = "---") -> list[str]:
    """Markdown table lines: a header row, a separator (``sep`` per column), one line per row."""
    return ["| " + " | ".join(head) + " |", "|" + f"{sep}|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


def _verify_cost(path: Path, old: str) -> list[str]:
    if not path.is_file():
        return _section(old, VERIFY_COST, None, path)
    with _reading(path):
        return _verify_cost_lines(_json(path), old)


def _verify_cost_lines(data: dict, old: str) -> list[str]:
    result = data["result"]
    kinds = list(result)
    sizes = list(next(iter(result.values())))
    lines = [f"## {VERIFY_COST}\n",
             "```\npython -m tools.bench.bench_verify_cost --model default --threads 1 --repeats 7\n```\n",
             f"Forward over T new tokens with {data['context']} tokens in the cache, {data['threads']} thread(s); "
             "v(T) = time(T) / time(1).\n"]
    head = ["T"] + [f"{k} {col}" for k in kinds for col in ("ms", "v(T)")]
    rows = [[str(T)] + [f"{result[k][T][f]:{spec}}" for k in kinds for f, spec in (("ms", ".1f"), ("v", ".2f"))]
            for T in sizes]
    lines += _table(head, rows)
    return lines + ["", _notes(old, "verify_cost")]


def _exit_eval(runs: Path, img_dir: Path, old: str) -> list[str]:
    """Per-exit loss / agreement with the final layer, one column pair per evaluated model, and a plot."""

    files = sorted(runs.glob("exits_*.json")) + sorted(runs.glob("exits_*/exits.json"))
    evals = {}
    for f in files:
        with _reading(f):
            evals[(f.stem if f.name != "exits.json" else f.parent.name).removeprefix("exits_")] = _json(f)
    if not evals:
        return _section(old, EXITS, None, runs / "exits_*.json")
    with _reading(files[0] if len(files) == 1 else runs / "exits_*"):
        return _exit_lines(evals, img_dir, old)


def _exit_lines(evals: dict, img_dir: Path, old: str) -> list[str]:

    first = next(iter(evals.values()))
    exits = sorted(first["agreement"], key=int)
    lines = [f"## {EXITS}\n",
             "```\nlayerskip eval-exits --model M --config recipes/cpu-demo-stdlib.yaml --threads 1 --device cpu "
             "--dtype fp32 --out runs/compare/exits_NAME\n```\n",
             f"Held-out stdlib blocks ({first['examples']} blocks, {first['tokens'][exits[0]]} tokens): "
             "cross-entropy of the exit (final norm + shared LM head) and top-1 agreement with the final layer.\n"]
    head = ["exit"] + [f"{m} {col}" for m in evals for col in ("loss", "agreement")]
    cols = (("loss", ".2f"), ("agreement", ".3f"))
    rows = [[e] + [f"{d[key][e]:{spec}}" for d in evals.values() for key, spec in cols] for e in exits]
    lines += _table(head, rows, sep="---:")
    lines.append("")
    png = exit_quality(evals, img_dir / "exits_agreement.png")
    lines.append(f"![exit agreement]({png.parent.name}/{png.name})\n")
    return lines + [_notes(old, "exits")]


def _swift_stream(run: Path, img_dir: Path, old: str) -> list[str]:
    """SWIFT over a mixed-task stream (tools/bench/swift_stream.py)."""
    if not (run / "stream.md").is_file():
        return _section(old, SWIFT_STREAM, None, run / "stream.md")
    lines = [f"## {SWIFT_STREAM}\n",
             "```\npython -m tools.bench.swift_stream --model base=default --model trained=runs/cpu-demo/final "
             "--data humaneval,gsm8k --n 4 --max-new-tokens 128 --repeats 2 --threads 1 "
             "--out runs/compare/swift_stream\n```\n",
             "Prompts alternate between the tasks. `autoregressive` and each SWIFT variant run as their own "
             "stream (one drafter state across all prompts) and take turns prompt by prompt. `swift` is ours "
             "(falls back to plain steps while drafting measures slower); `swift:adaptive=false:opt_budget=0.9` "
             "behaves like the paper (always drafts, optimises at will). tok/s are medians over repeats, each "
             "repeat with fresh drafters; α, M and the shares are over all repeats.\n",
             (run / "stream.md").read_text()]
    if (run / "matchness.png").is_file():
        target = img_dir / "swift_stream_matchness.png"
        shutil.copyfile(run / "matchness.png", target)
        lines.append(f"![SWIFT matchness]({target.parent.name}/{target.name})\n")
    return lines + [_notes(old, "swift_stream")]


def _independent(run: Path, title: str, old: str, name: str) -> list[str]:
    """A fresh drafter per prompt (tools/bench/bench_independent.py): the ratios to autoregressive, per prompt too."""
    path = run / "independent.json"
    if not path.is_file():
        return _section(old, title, None, path)
    with _reading(path):
        return _independent_lines(_json(path), title, old, name)


def _independent_lines(payload: dict, title: str, old: str, name: str) -> list[str]:
    args, rows = payload["args"], payload["rows"]
    lines = [f"## {title}\n", f"```\npython -m tools.bench.bench_independent --data {args['data']} --n {args['n']} "
             f"--max-new-tokens {args['max_new_tokens']} --repeats {args['repeats']} --threads 1 --device cpu\n```\n"]
    head = ["method", "tok/s", "vs autoregressive (median)", "per repeat", "min / max per prompt", "plain steps",
            "greedy exact"]
    body = [[f"`{r['method']}`", f"{r['tok_s']:.2f}", f"{r['vs_ar']:.3f}x",
             ", ".join(f"{x:.2f}" for x in r["vs_ar_per_repeat"]),
             f"{min(r['vs_ar_per_prompt'].values()):.2f} / {max(r['vs_ar_per_prompt'].values()):.2f}",
             f"{r['plain_steps']}/{r['verify_calls']}", r["exact"]] for r in rows]
    lines += _table(head, body) + [""]
    prompts = list(rows[0]["vs_ar_per_prompt"])
    lines += _table(["prompt"] + [f"`{r['method']}`" for r in rows[1:]],
                    [[p] + [f"{r['vs_ar_per_prompt'][p]:.2f}x" for r in rows[1:]] for p in prompts], sep="---:")
    return lines + ["", _notes(old, name)]


def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=Path, default=Path("runs/compare"))
    p.add_argument("--out", type=Path, default=Path("docs/RESULTS.md"))
    args = p.parse_args(argv)
    return run_main("write_results.py", lambda: write_page(args))


def write_page(args: argparse.Namespace) -> None:
    """The page from the run folder ``args.runs`` into ``args.out`` (written whole, or not at all)."""
    if not args.runs.is_dir():
        raise UserError(f"{args.runs} does not exist (make compare writes it); {args.out} left as it is")
    old = args.out.read_text() if args.out.is_file() else ""
    img = args.out.parent / "img"
    img.mkdir(parents=True, exist_ok=True)
    commands = args.runs / "commands.txt"
    page = ["# Results: training-free vs trained self-speculative decoding\n",
            "Every number below was measured by the commands shown, on the machine named with them; "
            "regenerate the page with `tools/results/compare_trained_vs_free.sh`. Absolute tok/s are that machine's "
            "under its load at the time (see Machine below): another machine, or the same one busier, gives "
            "other absolute numbers, so read ratios within one table.\n",
            _notes(old, "summary")]
    page += _section(old, COMMANDS, [f"## {COMMANDS}\n", "```bash", commands.read_text().strip(), "```\n"]
                     if commands.is_file() else None, commands)
    page += _bench_section(args.runs / "bench", "Drafters vs peers, base and trained model", img, old, "bench")
    page += [f"## {GEMMA}\n", _notes(old, "gemma")]  # its commands and tables are in its notes (not in a run folder)
    page += _bench_section(args.runs / "peers_gsm8k", "transformers peers on GSM8K, rerun with an attention mask",
                           img, old, "peers_gsm8k")
    page += _bench_section(args.runs / "adaptive", "Early exit, fixed k vs adaptive, against transformers' assistant",
                           img, old, "adaptive")
    page += _bench_section(args.runs / "sweep", "Early-exit E x k sweep", img, old, "sweep")
    page += _swift_stream(args.runs / "swift_stream", img, old)
    page += _exit_eval(args.runs, img, old)
    page += ["## LayerSkip that keeps the final layer (keep_final)\n", _notes(old, "keep_final")]
    page += _verify_cost(args.runs / "verify_cost.json", old)
    page += _bench_section(args.runs / "draft_vocab", "Reduced draft vocabulary: cost and acceptance, base and "
                           "trained", img, old, "draft_vocab")
    page += _bench_section(args.runs / "draft_vocab_sweep", "Draft vocabulary size x exit x k, trained model", img,
                           old, "draft_vocab_sweep")
    page += _bench_section(args.runs / "draft_vocab_confidence", "Trained early exit with a confidence stop and a "
                           "reduced draft vocabulary", img, old, "draft_vocab_confidence")
    page += _bench_section(args.runs / "ar_vs_hf_long", "Plain decoding vs transformers on long prompts", img, old,
                           "ar_vs_hf_long")
    page += _bench_section(args.runs / "batch", "Batched decoding vs transformers' batched generate", img, old,
                           "batch")
    page += _independent(args.runs / "independent_long", "A fresh drafter per long prompt, from a cold cache", old,
                         "independent_long")
    page += _independent(args.runs / "independent", "A fresh drafter per prompt, HumanEval and GSM8K", old,
                         "independent")
    page += _bench_section(args.runs / "tune_fixed", "Choosing the fixed early exit on tuning prompts", img, old,
                           "tune_fixed")
    page += _bench_section(args.runs / "dynamic_exit", "Dynamic exit vs the best fixed early exit, held out, with the "
                           "verifier's quality", img, old, "dynamic_exit")
    page += _bench_section(args.runs / "dynamic_exit_fresh", "Dynamic exit confirmed on fresh prompts, three "
                           "verifiers", img, old, "dynamic_exit_fresh")
    page += _bench_section(args.runs / "families_held_out", "Training-free families on the same held-out prompts "
                           "(unchanged verifier)", img, old, "families_held_out")
    page += _bench_section(args.runs / "keep_final_bench", "The keep_final checkpoint as a drafter", img, old,
                           "keep_final_bench")
    page += ["## Where self-speculation pays: CPU vs GPU, untrained vs trained\n", _notes(old, "where_it_pays")]
    page += ["## Exit adapter on the frozen model (Kangaroo-style)\n", _notes(old, "exit_adapter")]
    gpu = GPU_COMPARE.section(old, args.out)
    if gpu:
        page.append(gpu)
    jsonfile.write(args.out, "\n".join(page).rstrip("\n") + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
