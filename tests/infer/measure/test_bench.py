"""The benchmark runs end to end on a tiny model, writes its documented outputs, and catches lossy drafters."""

import csv
import json

import pytest
import torch

from infer.drafters import DRAFTERS
from infer.drafters.early_exit import EarlyExitDrafter
from infer.model.plan import cycle_speedup, iid_tokens_per_cycle
from layerskip_cli.main import main


def bench(tiny_model_dir, prompts_file, out, drafters, *extra):
    return main(["bench", "--model", str(tiny_model_dir), "--drafters", drafters, "--data", str(prompts_file),
                 "--n", "2", "--max-new-tokens", "10", "--repeats", "2", "--out", str(out), "--quiet", *extra])


def test_bench_end_to_end_outputs(tiny_model_dir, prompts_file, tmp_path, capsys):
    out = tmp_path / "out"
    code = bench(tiny_model_dir, prompts_file, out, "early_exit:E=2:k=3", "--sweep", "--exits", "1,3", "--ks", "2,4")
    assert code == 0
    payload = json.loads((out / "results.json").read_text())
    assert set(payload) == {"meta", "config", "quality", "summary", "recommended", "records", "resolved"}
    assert {"cpu", "torch", "transformers", "threads", "command"} <= set(payload["meta"])
    methods = {row["method"] for row in payload["summary"]}
    assert {"autoregressive", "early_exit:E=2:k=3", "hf_generate", "prompt_lookup", "hf_early_exit:E=2",
            "early_exit:E=1:k=2", "early_exit:E=3:k=4", "hf_early_exit:E=3"} <= methods
    for row in payload["summary"]:
        assert row["exact_mismatches"] == 0, row["method"]  # peers included: HF generate == our AR
        assert len(row["tps_per_repeat"]) == 2 and row["tokens_per_second"] > 0
        if row["method"].startswith("early_exit"):
            assert row["acceptance_rate"] is not None and row["draft_cost_ratio"] > 0
            assert row["expected_speedup"] > 0 and row["tokens_per_verify"] >= 1.0
    ar = next(r for r in payload["summary"] if r["method"] == "autoregressive")
    assert ar["speedup_vs_autoregressive"] == 1.0 and ar["tokens_per_verify"] == 1.0
    assert len(payload["records"]) == 2 * 2 * len(methods)  # prompts x repeats x methods
    # a record is the engine's GenerationStats (every counter, the derived rates) beside its labels and judgement
    drafted = [r for r in payload["records"] if r["method"] == "early_exit:E=2:k=3"]
    fields = {"prompt_tokens", "prefill_time", "acceptance_rate", "tokens_per_verify", "drafter", "exact"}
    assert fields <= set(drafted[0])
    assert all(r["prompt_tokens"] > 0 for r in drafted) and any(r["drafter"]["draft_forwards"] for r in drafted)
    with open(out / "results.csv") as f:
        header = next(csv.reader(f))
    assert {"model", "task", "method", "tokens_per_second", "speedup_vs_autoregressive", "acceptance_rate",
            "tokens_per_verify", "draft_cost_ratio", "expected_speedup", "exact_mismatches"} <= set(header)
    md = (out / "results.md").read_text()
    assert "| early_exit:E=2:k=3 |" in md and "Recommended" in md
    for png in ("speedup.png", "acceptance_by_exit.png"):
        assert (out / png).stat().st_size > 1000
    assert list(out.glob("sweep_*.png"))


@pytest.mark.parametrize("eos", ["emitted", "in_prompt"])
def test_transformers_peers_match_autoregressive(tiny_model_dir, prompts_file, tmp_path, eos):
    """HF generate must reproduce our greedy output token for token. Two traps, planted here:
    'emitted': the bench runs to max-new-tokens, but generate() falls back to the EOS of the model's
    generation_config when given None and would stop early; 'in_prompt': the pad id (= EOS, as
    SmolLM2's <|im_end|>) occurs in the prompt, and generate() infers an attention mask from it that
    hides those prompt tokens unless it is given one."""
    import shutil

    from infer.decode.engine import DecodeConfig, Engine
    from infer.drafters import build_drafter
    from infer.loading import load_model

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    m = load_model(str(model_dir))
    ids = m.encode("def add(a, b):")
    ar = Engine(m.runner, build_drafter("autoregressive", m.runner), (), m.decode)
    emitted = ar.generate(ids, DecodeConfig(max_new_tokens=10, stop_at_eos=False)).tokens
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": emitted[2]}))
    if eos == "in_prompt":  # the tokenizer's EOS '</s>' (the bench's pad id) inside a prompt
        pad = min(load_model(str(model_dir)).eos_token_ids)
        text = "def add(a, b):</s>  return"
        assert pad in m.encode(text)
        prompts_file.write_text(json.dumps({"prompt": text}) + "\n")
    out = tmp_path / "out"
    assert bench(model_dir, prompts_file, out, "autoregressive", "--peers", "hf_generate,prompt_lookup") == 0
    payload = json.loads((out / "results.json").read_text())
    assert all(r["new_tokens"] == 10 for r in payload["records"])
    assert all(row["exact_mismatches"] == 0 for row in payload["summary"])


class FaultyDrafter(EarlyExitDrafter):
    """Claims its exit hidden states are exact but perturbs them: verification becomes lossy."""

    name = "faulty"

    def propose(self, state):
        draft = super().propose(state)
        if draft is not None and draft.hidden is not None:
            draft.hidden = draft.hidden + 3.0 * torch.randn_like(draft.hidden)
        return draft


def test_bench_reports_exactness_mismatches(tiny_model_dir, prompts_file, tmp_path, monkeypatch, capsys):
    """A lossy drafter in fp32 is a bug: counted, classified (not a tie flip), and the bench exits 1 after writing."""
    monkeypatch.setitem(DRAFTERS, "faulty", FaultyDrafter)
    out = tmp_path / "out"
    assert bench(tiny_model_dir, prompts_file, out, "faulty:exit_layer=2:num_draft=4", "--peers", "none") == 1
    assert "beyond a near-tie" in capsys.readouterr().err
    payload = json.loads((out / "results.json").read_text())
    rows = {r["method"]: r for r in payload["summary"]}
    assert rows["autoregressive"]["exact_mismatches"] == 0
    faulty = rows["faulty:exit_layer=2:num_draft=4"]
    assert faulty["exact_mismatches"] > 0 and faulty["mismatches"] == faulty["exact_mismatches"]
    assert faulty["tie_flips"] == 0
    wrong = [r for r in payload["records"] if r["method"].startswith("faulty") and r["exact"] is False]
    assert wrong and all(r["divergence"]["position"] >= 0 and not r["divergence"]["tie_flip"] for r in wrong)
    assert "mismatched" in (out / "results.md").read_text()


def test_bench_tie_flips_are_reported_not_failed(tiny_model_dir, prompts_file, tmp_path, monkeypatch):
    """A mismatch the classifier calls a near-tie goes to the tie_flips column and the bench still exits 0."""
    from infer.measure import exactness

    monkeypatch.setitem(DRAFTERS, "faulty", FaultyDrafter)
    monkeypatch.setattr(exactness, "classify_divergence", lambda runner, prompt, ref, out, *rest: exactness.Divergence(
        exactness.first_divergence(ref, out), 0, 1, 0.01, 0.5, True))
    out = tmp_path / "out"
    assert bench(tiny_model_dir, prompts_file, out, "faulty:exit_layer=2:num_draft=4", "--peers", "none") == 0
    summary = json.loads((out / "results.json").read_text())["summary"]
    faulty = next(r for r in summary if r["method"] != "autoregressive")
    assert faulty["tie_flips"] == faulty["exact_mismatches"] > 0 and faulty["mismatches"] == 0
    assert "tie flip" in (out / "results.md").read_text()


def test_hf_static_peer_matches_autoregressive(tiny_model_dir, prompts_file, tmp_path):
    out = tmp_path / "out"
    assert bench(tiny_model_dir, prompts_file, out, "autoregressive", "--peers", "hf_static,hf_generate") == 0
    rows = {r["method"]: r for r in json.loads((out / "results.json").read_text())["summary"]}
    assert rows["hf_static"]["exact_mismatches"] == 0 and rows["hf_static"]["tokens_per_second"] > 0


def test_expected_speedup_formulas():
    """The bench's expected speed-up is the one cost model of infer.model.plan: M / (k̄ c + v)."""
    # M tokens per cycle over k̄ c + v: 3 tokens, 4 drafts at c = 0.25, v = 1 -> 3 / 2
    assert cycle_speedup(3.0, 4.0, 0.25, 1.0) == pytest.approx(1.5)
    assert cycle_speedup(1.0, 0.0, 0.0, 1.0) == pytest.approx(1.0)
    # Leviathan et al. Thm 3.8: alpha 0.5, k 2, c 0 -> (1 - 0.125) / 0.5 = 1.75
    assert cycle_speedup(iid_tokens_per_cycle(0.5, 2), 2, 0.0, 1.0) == pytest.approx(1.75)
    # alpha 0.8, k 4, c 0.1: (1 - 0.8^5) / 0.2 / 1.4
    assert cycle_speedup(iid_tokens_per_cycle(0.8, 4), 4, 0.1, 1.0) == pytest.approx((1 - 0.8 ** 5) / 0.2 / 1.4)
    assert cycle_speedup(iid_tokens_per_cycle(1.0, 3), 3, 0.2, 1.0) == pytest.approx(4 / 1.6)


@pytest.mark.parametrize("argv,message", [
    (["--drafters", "early_exit:E=x"], "option E of drafter 'early_exit': expected an integer, got 'x'"),
    (["--drafters", "nope"], "unknown drafter"),
    (["--drafters", ","], "has an empty entry"),
    (["--drafters", "autoregressive,,early_exit"], "has an empty entry"),
    (["--peers", "hf_magic"], "unknown peer"),
    (["--peers", "hf_early_exit:E=x"], "E='x': expected an integer"),
    (["--peers", "hf_early_exit:Q=3"], "bad option"),
    (["--peers", ","], "has an empty entry"),
    (["--temperature", "0.5"], "needs --sample"),
    (["--exits", ","], "expected comma-separated integers"),
    (["--model", "x=default", "--model", "x=runs/other"], "same name"),
    (["--model", "trained="], "expected NAME=PATH"),
    (["--device", "cuda:x"], "bad device"),
])
def test_bench_bad_input(argv, message, tmp_path, capsys):
    """Refused before any model loads (the model path does not even exist)."""
    try:
        code = main(["bench", "--out", str(tmp_path / "o"), "--data", "humaneval", "--model", str(tmp_path / "none"),
                     *argv])
    except SystemExit as e:  # argparse's own type errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1 or "usage:" in err


def test_bench_peer_exit_beyond_the_model_refused(tiny_model_dir, prompts_file, tmp_path, capsys):
    code = bench(tiny_model_dir, prompts_file, tmp_path / "o", "autoregressive", "--peers", "hf_early_exit:E=40")
    err = capsys.readouterr().err
    assert code == 2 and "exit layer 40 is out of range" in err and "4 layers" in err
    assert not (tmp_path / "o").exists()


def test_bench_out_existing_file_refused(tiny_model_dir, prompts_file, tmp_path, capsys):
    target = tmp_path / "results"
    target.write_text("keep me")
    code = bench(tiny_model_dir, prompts_file, target, "autoregressive")
    assert code == 2 and "existing file" in capsys.readouterr().err
    assert target.read_text() == "keep me"
    code = bench(tiny_model_dir, prompts_file, target / "sub", "autoregressive")  # a folder under a file
    assert code == 2 and "cannot create it" in capsys.readouterr().err


def test_speedup_plot_facets_by_model(tmp_path):
    """One panel per model, one colour per method shared by the panels, the legend outside the axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from infer.measure import plots
    from infer.measure.report import Summary

    def row(model, method, speedup):
        return Summary(model, "humaneval", method, 1, 8, 10.0, [10.0], speedup, None, None, None, None, None, None,
                       None, None, 0)

    methods = ["autoregressive", "hf_generate"] + [f"early_exit:E={e}:k=4" for e in range(2, 10)]
    rows = [row(m, meth, 1.0 + i / 10) for m in ("base", "trained") for i, meth in enumerate(methods)]
    figures = []
    real_savefig = plt.Figure.savefig
    plt.Figure.savefig = lambda self, *a, **k: (figures.append(self), real_savefig(self, *a, **k))[1]
    try:
        assert plots.speedup_bars(rows, tmp_path / "s.png").stat().st_size > 1000
    finally:
        plt.Figure.savefig = real_savefig
    fig = figures[0]
    axes = [ax for ax in fig.axes if ax.patches]
    assert [ax.get_title() for ax in axes] == ["base", "trained"]
    colours = [[tuple(p.get_facecolor()) for p in ax.patches] for ax in axes]
    assert colours[0] == colours[1] and len(set(colours[0])) == len(methods)  # distinct, same in both panels
    assert fig.legends and not any(ax.get_legend() for ax in fig.axes)


def test_baseline_runs_first_whatever_the_order(tiny_model_dir, prompts_file, tmp_path):
    """Listed after a drafter, autoregressive still runs first, so the drafter is judged on every prompt."""
    out = tmp_path / "out"
    assert bench(tiny_model_dir, prompts_file, out, "early_exit:E=2:k=3,autoregressive", "--peers", "none") == 0
    payload = json.loads((out / "results.json").read_text())
    assert payload["config"]["methods"] == ["autoregressive", "early_exit:E=2:k=3"]
    row = next(r for r in payload["summary"] if r["method"] == "early_exit:E=2:k=3")
    assert row["exact_mismatches"] == 0 and row["mismatches"] == 0
    judged = [r for r in payload["records"] if r["method"] != "autoregressive" and r["repeat"] == 0]
    assert judged and all(r["exact"] is True for r in judged)


def test_bench_runs_each_drafters_finish_once_per_engine(tiny_model_dir, prompts_file, tmp_path, monkeypatch):
    """Whoever runs a drafter to the end calls finish() once: bench does too, so swift:save_plan=P writes P."""
    from infer.drafters.swift import SwiftDrafter

    plan = tmp_path / "swift-plan.json"
    calls = []
    original = SwiftDrafter.finish
    # the drafters themselves, held: an id alone can be reused once its drafter is freed
    monkeypatch.setattr(SwiftDrafter, "finish", lambda self: (calls.append(self), original(self))[1])
    code = bench(tiny_model_dir, prompts_file, tmp_path / "out", f"swift:save_plan={plan}:context_window=4",
                 "--peers", "none")
    assert code == 0 and plan.is_file()
    assert json.loads(plan.read_text())["source"] == "swift"
    assert len(calls) == len({id(d) for d in calls}) == 3  # the warm-up engine and one per repeat, once each


def test_hf_static_warms_up_on_the_longest_prompt_at_full_length(tiny_model_dir, tmp_path, monkeypatch):
    """The static cache (compiled on CUDA) is sized by the longest prompt and max_new_tokens: its warm-up uses both,
    so no timed call rebuilds it; the other peers warm up briefly."""
    from infer.measure.peers import Peer

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "ab"}\n{"prompt": "a much longer prompt than the first"}\n')
    calls = []
    original = Peer.generate

    def recording(self, method, ids, cfg, eos):
        calls.append((method.name, len(ids), cfg.max_new_tokens))
        return original(self, method, ids, cfg, eos)
    monkeypatch.setattr(Peer, "generate", recording)
    code = main(["bench", "--model", str(tiny_model_dir), "--drafters", "autoregressive", "--data", str(prompts),
                 "--n", "2", "--max-new-tokens", "10", "--repeats", "1", "--out", str(tmp_path / "out"), "--quiet",
                 "--peers", "hf_generate,hf_static"])
    assert code == 0
    longest = max(n for name, n, _ in calls)
    assert calls[:2] == [("hf_generate", calls[0][1], 4), ("hf_static", longest, 10)]


def test_bench_calls_an_emitted_token_its_verification_did_not_choose_an_acceptance_bug(
        tiny_model_dir, prompts_file, tmp_path, monkeypatch):
    """An acceptance step that emits another token than the verification's argmax (only where a draft was verified:
    autoregressive stays right) is classified from the run's own verification argmax, whatever the margin."""
    import infer.decode.verify as engine_module  # where acceptance runs (one row or a batch)

    accept = engine_module.greedy_accept

    def buggy(tree, tokens, argmax):
        path, bonus = accept(tree, tokens, argmax)
        return path, (bonus + 1) % 256 if len(tokens) > 1 else bonus
    monkeypatch.setattr(engine_module, "greedy_accept", buggy)
    out = tmp_path / "out"
    assert bench(tiny_model_dir, prompts_file, out, "early_exit:exit_layer=2:num_draft=3", "--peers", "none") == 1
    wrong = [r for r in json.loads((out / "results.json").read_text())["records"]
             if r["method"].startswith("early_exit") and r["exact"] is False]
    assert wrong and all("acceptance bug" in r["divergence"]["reason"] for r in wrong)


def test_bench_skip_times_the_span_before_the_held_out_end(tiny_model_dir, tmp_path):
    """--skip 2 times the 2 prompts before the last 2 (to tune settings there) and says so; without it, the last 2."""
    prompts = tmp_path / "four.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"def f{i}(x):"}) + "\n" for i in range(4)))
    ids = {}
    for skip in ("0", "2"):
        out = tmp_path / f"skip{skip}"
        assert main(["bench", "--model", str(tiny_model_dir), "--drafters", "autoregressive", "--peers", "none",
                     "--data", str(prompts), "--n", "2", "--skip", skip, "--max-new-tokens", "4", "--repeats", "1",
                     "--quality-data", "none", "--out", str(out), "--quiet"]) == 0
        records = json.loads((out / "results.json").read_text())["records"]
        ids[skip] = {r["prompt_id"] for r in records}
        md = (out / "results.md").read_text()
        assert ("a tuning span, not the held-out end" in md) == (skip == "2")
    assert ids == {"0": {"p2", "p3"}, "2": {"p0", "p1"}}
