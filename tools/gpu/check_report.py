"""The GPU check's result as Markdown (the GPU.md block) and the reasons it fails."""

from __future__ import annotations


def failures(result: dict) -> list[str]:
    """Why the run fails (empty: it passes): fp32 greedy mismatches beyond tie flips, a sampled generation that
    did not complete, the end-to-end training check, a part that raised."""
    ex = result.get("exact", {})
    out = [f"{ex[f'{p}_fp32_failures']} fp32 greedy mismatch(es)" for p in ("greedy", "greedy_rest")
           if ex.get(f"{p}_fp32_failures")]
    out += [f"sampled generation of {name} did not complete" for name, s in ex.get("sampling", {}).items()
            if not s.get("ok")]
    quant = ex.get("quant_draft", {})
    if quant.get("ok") is False:
        out.append(f"quantized drafts on {quant.get('device')}: expected {quant.get('expected')}, got "
                   f"{quant.get('message') or 'something else'}")
    if result.get("e2e_ok") is False:
        out.append("the end-to-end training check failed")
    out += [f"part {name} raised {text}" for name, text in result.get("errors", {}).items()]
    return out


def _num(d: dict, key: str, spec: str = ".0f") -> str:
    return "–" if d.get(key) is None else format(d[key], spec)


def sizes_text(sizes: list[int]) -> str:
    """'2..32' for a contiguous range, else the sizes listed."""
    if len(sizes) > 2 and sizes == list(range(sizes[0], sizes[-1] + 1)):
        return f"{sizes[0]}..{sizes[-1]}"
    return ", ".join(str(T) for T in sizes)


def exact_lines(ex: dict, spread_sizes: list[int]) -> list[str]:
    lines = []
    for p, what in (("greedy", "tiny Llama, every executor"), ("greedy_rest", "tiny Qwen2")):
        if f"{p}_runs" in ex:
            lines.append(f"Greedy fp32 output of the drafters vs autoregressive ({what}): {ex[f'{p}_fp32_mismatches']} "
                         f"mismatch(es) in {ex[f'{p}_runs']} runs, {ex[f'{p}_fp32_tie_flips']} tie flip(s), "
                         f"{ex[f'{p}_fp32_failures']} failure(s); SWIFT verified {ex[f'{p}_swift_trees']} token "
                         f"trees ({ex[f'{p}_swift_compactions']} compacted paths).")
    sampling = ex.get("sampling", {})
    if sampling:
        done = [n for n, s in sampling.items() if s.get("ok")]
        lines.append(f"Sampled generations completed: {len(done)} of {len(sampling)} ({', '.join(done) or 'none'}).")
    quant = ex.get("quant_draft")
    if quant:
        what = "refused in one line" if quant["expected"] == "refused" else "draft, output identical to plain decoding"
        said = f" ({quant['message']})" if quant.get("message") else ""
        lines.append(f"Quantized drafts (quant_self) on {quant['device']}: {what}: {'yes' if quant.get('ok') else 'NO'}"
                     f"{said}.")
    if "parity_max_abs" in ex:
        lines.append(f"Runner vs transformers logits max |diff| {ex['parity_max_abs']:.2e} (fp32).")
    if ex.get("spread"):
        lines += ["", f"One-row vs many-row spread (max |logit difference|, T = {sizes_text(spread_sizes)}):", "",
                  "| model/dtype/executor | spread |", "|---|---:|"]
        lines += [f"| {k} | {v['max_abs']:.3g} |" for k, v in ex["spread"].items()]
    return lines


def sync_lines(result: dict) -> list[str]:
    s, targets = result.get("syncs", {}), result.get("sync_targets", {})
    if not s:
        return []
    lines = ["", "Host syncs (tiny model, fp32, greedy):", "",
             "| drafter | per cycle | per token | draft steps / cycle | in update / cycle | target |",
             "|---|---:|---:|---:|---:|---|"]
    for name, m in s.items():
        t = targets.get(name)
        goal = "–" if t is None else f"{t['target']}: {'met' if t['met'] else 'NOT met'}"
        lines.append(f"| {name} | {m['per_cycle']:.2f} | {m['per_token']:.2f} | {m['draft_steps_per_cycle']:.2f} | "
                     f"{m['update_per_cycle']:.2f} | {goal} |")
    return lines


def shape_row(name: str, s: dict) -> str:
    first = lambda d: d[min(d, key=int)] if d else None  # noqa: E731  (c at the smallest E: L/4)
    c, c_vocab = first(s.get("c", {})), first(s.get("c_vocab", {}))
    ratio = s["ours_ar_tok_s"] / s["hf_static_tok_s"] if s.get("hf_static_tok_s") and s.get("ours_ar_tok_s") else None
    v = s.get("v", {})
    cells = [name, _num(s, "ours_ar_tok_s"), _num(s, "hf_static_tok_s"), "–" if ratio is None else f"{ratio:.2f}x",
             _num(s, "ms_forward", ".2f"), _num(v, "2", ".2f"), _num(v, "8", ".2f"), _num(v, "32", ".2f"),
             "–" if c is None else f"{c:.2f}", "–" if c_vocab is None else f"{c_vocab:.2f}",
             _num(s, "kernels_per_layer", ".1f"), _num(s, "kernels_per_forward_eager"),
             _num(s, "hf_dynamic_tok_s"), _num(s, "hf_early_exit_tok_s")]
    return "| " + " | ".join(cells) + " |"


def shape_lines(shapes: dict) -> list[str]:
    lines = ["", "| shape | ours AR tok/s | HF static tok/s | AR / HF static | ms/forward | v(2) | v(8) | v(32) | "
             "c(L/4) | c(L/4), 8K draft vocab | kernels/layer | eager kernels/forward | HF dynamic | HF early exit |",
             "|---|" + "---:|" * 13]
    notes = []
    for name, s in shapes.items():
        if "error" in s:
            notes.append(f"{name} failed: {s['error']}")
        lines.append(shape_row(name, s))
        if s.get("captures_in_timed") or s.get("builds_in_timed") or s.get("compiles_in_timed"):
            notes.append(f"{name}: the timed runs captured {s['captures_in_timed']} CUDA graph(s), built "
                         f"{s['builds_in_timed']} static forward(s) and compiled {s.get('compiles_in_timed', 0)} "
                         "time(s) (should be 0: warm-up missed a shape)")
        if s.get("kernels_at_least_one_per_layer") is False:
            notes.append(f"{name}: fewer kernels than layers counted: the profiler missed kernels")
    for name, s in shapes.items():
        if s.get("drafters"):
            lines += ["", f"Per-cycle cost of each drafter at the {name} shape (E = {s['drafters']['E']}):", "",
                      "| drafter | tok/s | tokens / cycle | drafted / cycle | draft ms / cycle | verify ms / cycle |",
                      "|---|---:|---:|---:|---:|---:|"]
            lines += [f"| {k} | " + (f"failed: {d['error']} | | | | |" if "error" in d else
                                     f"{d['tok_s']:.0f} | {d['tokens_per_cycle']:.2f} | {d['drafted_per_cycle']:.2f} | "
                                     f"{d['draft_ms_per_cycle']:.2f} | {d['verify_ms_per_cycle']:.2f} |")
                      for k, d in s["drafters"].items() if k != "E"]
    return lines + [f"\nNote: {n}" for n in notes]


def part_lines(result: dict) -> list[str]:
    parts = result.get("parts", {})
    c = result.get("compiles", {})
    line = "; ".join(f"{name} {p.get('seconds', 0):.0f} s from {p['start_s']:.0f} s, {p.get('compiles', 0)} compile(s)"
                     + (" (cut)" if p.get("cut") else "") for name, p in parts.items())
    return ["", f"Parts: {line}. Dynamo graphs compiled: {c.get('dynamo_graphs', 0)} in all, {c.get('ours', 0)} of "
            f"them ours ({c.get('backend') or 'not compiled'})."] if parts else []


def markdown(result: dict) -> str:
    """The GPU.md block: machine, versions, commit, command, the shapes, exactness, syncs, parts."""
    lines = [f"Device: {result['device']}; torch {result['torch']}, transformers {result['transformers']}; "
             f"commit {result['commit']}; {result['date']}{' (tiny stand-in shapes)' if result['tiny'] else ''}; "
             f"{result.get('seconds', 0):.0f} s.", "", f"```\n{result['command']}\n```"]
    lines += shape_lines(result.get("shapes", {}))
    if "exact" in result:
        lines += [""] + exact_lines(result["exact"], result.get("settings", {}).get("spread_sizes", []))
    lines += sync_lines(result)
    lines += part_lines(result)
    for note in result["notes"]:
        lines.append(f"\nNote: {note}")
    for why in failures(result):
        lines.append(f"\nFAILED: {why}")
    return "\n".join(lines)
