"""Tokens/s of one training step (forward + backward + AdamW) with and without LayerSkip.

    python -m tools.bench.bench_train_step --model default --threads 1,2 --repeats 3

Layer dropout makes a step cheaper (skipped rows do no work in that layer); each early exit
costs one more final-norm + LM-head pass and its CE (the LM head is 21% of SmolLM2-135M's
parameters, so exits are not free). All variants run in one process on the same real batch
(Python standard-library source), interleaved, and the median of the repeats is reported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from layerskip_core.cli import Parser, write_result
from layerskip_core.errors import UserError
from layerskip_core.settings import check_threads
from train.config import DataConfig, EarlyExitConfig, LayerDropoutConfig, SourceConfig


def variants(exits: list[int], p_maxes: list[float], rotation: int) -> dict[str, tuple[dict, dict]]:
    out = {"plain (final loss only)": ({}, {})}
    for p in p_maxes:
        out[f"layer dropout p_max={p} exp"] = ({"p_max": p, "scale": "exp"}, {})
    out[f"early exits {exits}"] = ({}, {"exits": exits, "scale": "linear"})
    if rotation > 1:
        out[f"early exits, rotational R={rotation}"] = ({}, {"exits": exits, "scale": "linear",
                                                              "curriculum": "rotational", "rotation": rotation})
    p = p_maxes[0]
    out[f"LayerSkip: dropout p_max={p} + exits"] = ({"p_max": p, "scale": "exp"}, {"exits": exits, "scale": "linear"})
    return out


def thread_counts(text: str) -> list[int]:
    """An argparse ``type``: comma-separated thread counts, each checked as every command checks --threads."""
    try:
        return [check_threads(int(t)) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    except UserError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--threads ")) from None


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--threads", default=[1, 2], type=thread_counts, help="comma-separated thread counts")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--exits", default="8,12,16,20,24")
    parser.add_argument("--p-max", default="0.1,0.5", help="layer-dropout rates to time (the first also with exits)")
    parser.add_argument("--rotation", type=int, default=0, help="also time the exits with a rotational curriculum")
    parser.add_argument("--only", default="", help="comma-separated substrings: time only matching variants")
    parser.add_argument("--json", help="write results here")
    args = parser.parse_args(argv)

    import torch

    from train.data import build_dataset  # lazy: torch, after the flags are read
    from train.model import LayerSkipLM, load_model  # lazy: torch, after the flags are read

    model, tokenizer, path = load_model(args.model)
    data = build_dataset(DataConfig(sources=[SourceConfig(type="stdlib")], block_size=args.block), tokenizer, path)
    batch = data.train.batch(list(range(args.batch)), tokenizer.pad_token_id)
    exits = [int(x) for x in args.exits.split(",")]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.0)  # lr 0: weights fixed
    lms = {name: LayerSkipLM(model, LayerDropoutConfig(**d), EarlyExitConfig(**e), max_steps=1000).train()
           for name, (d, e) in variants(exits, [float(p) for p in args.p_max.split(",")], args.rotation).items()
           if name.startswith("plain") or not args.only or any(o in name for o in args.only.split(","))}
    results = {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        times: dict[str, list[float]] = {name: [] for name in lms}
        skipped: dict[str, float] = {name: 0.0 for name in lms}
        for rep in range(args.repeats + 1):  # repeat 0 is a warm-up
            for name, lm in lms.items():
                t0 = time.perf_counter()
                out = lm(batch["input_ids"], batch["labels"], step=rep, micro=0)
                out["loss"].backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if rep:
                    times[name].append(time.perf_counter() - t0)
                    skipped[name] += float(out["skipped"].sum()) / (args.batch * lm.num_layers * args.repeats)
        tokens = args.batch * args.block
        load = os.getloadavg()[0]  # other processes on the machine make CPU timings noisy: record it
        base = statistics.median(times["plain (final loss only)"])
        for name, ts in times.items():
            med = statistics.median(ts)
            results[f"{threads}t {name}"] = {"threads": threads, "variant": name, "seconds": med,
                                              "tokens_per_s": tokens / med, "relative": base / med, "all": ts,
                                              "skipped_layer_rows": skipped[name], "loadavg_1min": load}
            print(f"threads={threads}  {name:45s} {med:6.2f} s/step  {tokens / med:7.1f} tok/s  "
                  f"skipped {skipped[name]:.3f}  "
                  f"x{base / med:.2f} vs plain  (load {load:.1f})", flush=True)
    if args.json:
        write_result(Path(args.json), {"model": str(path), "batch": args.batch, "block": args.block,
                                       "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
