"""Issue 67, a newcomer's first hour: the fast setting in one word (an adapter carries its tuned setting, ``best``),
a run that lost to plain decoding says so, batched rows in input order, errors that name what the user wrote, the
bench's screen, and flags that would do nothing."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from infer.decode.engine import GenerationStats
from infer.drafters.base import DrafterStats
from layerskip_cli.main import main
from layerskip_core.errors import UserError
from tiny_models import make_model, noisy_adapter

REPO = Path(__file__).resolve().parents[2]
TUNED = {"num_draft": 3, "confidence": 0.2, "keep_last": True, "tree": True, "max_tree_nodes": 3}


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def tuned_adapter(tmp_path_factory):
    """An exit adapter (E = 2) for the tiny model of ``tiny_model_dir``, its header carrying a tuned setting, alone
    in a folder that stands for the shipped adapters."""
    from layerskip_core.adapter_spec import TunedDecoding, write_decoding

    path = tmp_path_factory.mktemp("shipped") / "tiny-e2.safetensors"
    noisy_adapter(make_model("llama", seed=0), path, exit_layer=2, noise=0.05, seed=1)
    write_decoding(path, TunedDecoding(TUNED, speedup=1.5, measured="the tiny model's test prompts",
                                       source="tests/cli/test_issue67_newcomer.py"))
    return path


@pytest.fixture()
def shipped(tuned_adapter, monkeypatch):
    """``adapter=default`` (and so ``best``) finds the tuned tiny adapter."""
    import infer.assets.adapter as assets

    monkeypatch.setattr(assets, "BUNDLED_DIR", tuned_adapter.parent)
    return tuned_adapter


# --------------------------------------------------------------------------- item 5: an adapter's tuned setting
def test_an_adapter_carries_its_tuned_setting_and_explicit_options_win(tuned_adapter):
    from infer.drafters import drafter_spec
    from infer.model.runner import Runner

    runner = Runner.from_model(make_model("llama", seed=0))
    spec = drafter_spec("early_exit", {"adapter": str(tuned_adapter)}).resolve(runner).spec
    assert {k: getattr(spec.config, k) for k in TUNED} == TUNED
    # an option given, even at the class default (num_draft 6), is the caller's, not the adapter's
    spec = drafter_spec("early_exit", {"adapter": str(tuned_adapter), "k": 6, "tree": False}).resolve(runner).spec
    assert (spec.config.num_draft, spec.config.tree, spec.config.confidence) == (6, False, 0.2)


def test_best_is_the_shipped_adapter_at_its_tuned_setting_said_once(capsys, shipped, tiny_model_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n{"prompt": "x = 1"}\n')
    common = ["generate", "--model", tiny_model_dir, "--prompts-file", prompts, "--json", "--max-new-tokens", "12"]
    code, out, err = run_cli(capsys, *common, "--drafter", "best")
    assert code == 0, err
    said = [line for line in err.splitlines() if "best setting for this model" in line]
    assert len(said) == 1, err
    assert shipped.name in said[0] and "num_draft=3:confidence=0.2:keep_last=true:tree=true:max_tree_nodes=3" \
        in said[0] and "measured 1.50x plain decoding" in said[0] and "test_issue67_newcomer.py" in said[0]
    _, plain, _ = run_cli(capsys, *common)
    assert [json.loads(x)["tokens"] for x in out.splitlines()] == [json.loads(x)["tokens"] for x in plain.splitlines()]


def test_best_in_the_api_hf_generate_and_bench_specs(capsys, shipped, tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    from infer import DecodeConfig, hf_generate, load_model, parse_spec

    model = load_model(str(tiny_model_dir), device="cpu")
    out = model.generate("def f():", drafter="best", config=DecodeConfig(max_new_tokens=8))
    assert out.tokens == model.generate("def f():", config=DecodeConfig(max_new_tokens=8)).tokens
    assert out.stats.drafter.adapter_exit == 2
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = torch.tensor([[5, 6, 7, 8]])
    ours = hf.generate(ids, custom_generate=hf_generate("best", num_draft=2), max_new_tokens=8, do_sample=False)
    assert torch.equal(ours, hf.generate(ids, max_new_tokens=8, do_sample=False))
    spec = parse_spec("best:k=2")
    assert spec.best and spec.drafter == "early_exit" and spec.config.num_draft == 2
    assert pickle.loads(pickle.dumps(spec)) == spec  # a spec still travels (the runners it spoke on do not)
    assert "best setting for this model" in capsys.readouterr().err


def test_best_on_a_model_without_one_is_refused_in_one_line(capsys, tiny_model_dir, tmp_path, monkeypatch):
    import infer.assets.adapter as assets

    monkeypatch.setattr(assets, "BUNDLED_DIR", tmp_path)  # nothing shipped for this model
    code, _, err = run_cli(capsys, "generate", "--model", tiny_model_dir, "--prompt", "hi", "--drafter", "best")
    assert code == 2 and "no best setting is known for this model" in err and "--drafter autoregressive" in err
    assert len(err.strip().splitlines()) == 1, err


def test_a_damaged_tuned_setting_is_refused_naming_the_file(tuned_adapter, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from infer.assets.adapter import ExitAdapter
    from infer.model.runner import Runner

    with safe_open(str(tuned_adapter), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    bad = tmp_path / "bad.safetensors"
    save_file(tensors, str(bad), metadata=meta | {"decoding": json.dumps({"settings": {"num_draft": "six"}})})
    with pytest.raises(UserError, match=r"bad\.safetensors: damaged tuned decoding setting.*num_draft must be int"):
        ExitAdapter.load(bad, Runner.from_model(make_model("llama", seed=0)))


def test_the_tuning_script_writes_the_setting_into_the_adapter(tuned_adapter, tmp_path, capsys):
    import shutil

    import best_fixed

    from layerskip_core.adapter_spec import read_decoding, read_file

    adapter = tmp_path / "a.safetensors"
    shutil.copy(tuned_adapter, adapter)
    rows = [("early_exit:adapter=default:k=4:tree=true:max_tree_nodes=6", 1.3), ("early_exit:adapter=default:k=2", 1.1),
            ("early_exit:E=2:k=4", 1.6)]  # the fastest has no adapter: not this adapter's setting
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"config": {"skip": 8, "data": ["humaneval"], "n": 4, "max_new_tokens": 64},
                                   "meta": {"command": "layerskip bench ...", "dtype": "fp32"},
                                   "summary": [{"method": m, "speedup_vs_autoregressive": s} for m, s in rows]}))
    assert best_fixed.main([str(results), "--write-adapter", str(adapter)]) == 0
    decoding = read_decoding(read_file(adapter)[0], adapter)
    assert decoding.settings == {"num_draft": 4, "tree": True, "max_tree_nodes": 6}
    assert decoding.speedup == pytest.approx(1.3) and str(results) in decoding.source


def test_the_shipped_adapter_carries_the_setting_the_readme_documents():
    from layerskip_core.adapter_spec import read_decoding, read_file

    [shipped] = sorted((REPO / "infer" / "data" / "adapters").glob("*.safetensors"))
    decoding = read_decoding(read_file(shipped)[0], shipped)
    assert decoding.settings == {"num_draft": 6, "confidence": 0.5, "keep_last": True, "tree": True,
                                 "max_tree_nodes": 4}
    assert decoding.speedup > 1 and "docs/RESULTS.md" in decoding.source


# --------------------------------------------------------------------------- item 6: a run that lost says so
def _stats(calls: int, new: int, drafted: int, accepted: int, draft_s: float, verify_s: float) -> GenerationStats:
    return GenerationStats(new_tokens=new, verify_calls=calls, drafted=drafted, accepted=accepted,
                           draft_time=draft_s, verify_time=verify_s, drafter=DrafterStats(draft_forwards=drafted))


def test_the_verdict_estimates_plain_decoding_from_the_runs_own_costs():
    from infer.measure.verdict import judge

    # the untrained exit: 6 drafts a cycle at 0.3 of a step each, 5 of 240 accepted: (M 1.125) / (1.8 + 1) ~ 0.40x
    lost = judge([_stats(40, 46, 240, 5, draft_s=240 * 0.003, verify_s=40 * 0.010)])
    assert lost.slower and lost.speedup == pytest.approx((40 + 5) / 40 / 2.8, rel=0.02)
    # the adapter: 3 tokens a cycle for 0.2 + 1.1 steps: ~2.3x
    paid = judge([_stats(20, 61, 60, 40, draft_s=60 * 0.001, verify_s=20 * 0.011)])
    assert not paid.slower and paid.speedup > 2
    assert judge([_stats(3, 4, 9, 0, 0.1, 0.1)]) is None  # too few verifications to judge
    assert judge([_stats(40, 41, 0, 0, 0.0, 0.4)]) is None  # never drafted


def test_a_generation_slower_than_plain_decoding_says_so_once(capsys, tiny_model_dir):
    """The tiny model's own exit 1 drafts what its last layer almost never takes: about 0.3x."""
    code, _, err = run_cli(capsys, "generate", "--model", tiny_model_dir, "--prompt", "def add(a, b):",
                           "--drafter", "early_exit", "--exit-layer", "1", "--num-draft", "6", "--max-new-tokens",
                           "48", "--ignore-eos")
    assert code == 0, err
    said = [line for line in err.splitlines() if "slower than plain decoding" in line]
    assert len(said) == 1 and "--drafter autoregressive" in said[0] and "--adaptive" in said[0], err
    code, _, err = run_cli(capsys, "generate", "--model", tiny_model_dir, "--prompt", "def add(a, b):",
                           "--max-new-tokens", "48", "--ignore-eos")
    assert code == 0 and "slower than plain decoding" not in err


def test_no_readme_generate_example_drafts_without_an_adapter_or_best():
    """The README's generate examples on the default model draft with the adapter (its tuned setting) or best: the
    untrained exit, which loses, is not an example to copy."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    block = text.split("## Generate", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    lines = [x for x in block.splitlines() if x.startswith("layerskip generate")]
    assert lines and not any("--drafter early_exit" in x and "--adapter" not in x for x in lines), lines
    chat = next(x for x in lines if "--chat" in x)
    assert "--drafter best" in chat and "--temperature" in chat


# --------------------------------------------------------------------------- item 7: batched rows in input order
@pytest.fixture()
def finishing_out_of_order(monkeypatch):
    """The batch engine reports its rows as 1, 0, 2 (as rows of different lengths do), after decoding them all."""
    from infer.decode.batch import BatchEngine

    original = BatchEngine.generate

    def generate(self, prompts, config=None, generators=None, processors=None, on_result=None):
        results = original(self, prompts, config, generators, processors)
        for i in (1, 0, 2):
            on_result(i, results[i])
        return results

    monkeypatch.setattr(BatchEngine, "generate", generate)


def _batch(tiny_model_dir, tmp_path, *more):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(f'{{"id": "p{i}", "prompt": "{t}"}}\n' for i, t in enumerate(["a", "bb", "ccc"])))
    return ["generate", "--model", tiny_model_dir, "--prompts-file", prompts, "--max-new-tokens", "4",
            "--batch-size", "3", *more]


def test_a_batch_prints_in_input_order_unless_asked(capsys, tiny_model_dir, tmp_path, finishing_out_of_order):
    code, out, err = run_cli(capsys, *_batch(tiny_model_dir, tmp_path, "--json"))
    assert code == 0 and [json.loads(x)["id"] for x in out.splitlines()] == ["p0", "p1", "p2"], err
    code, out, _ = run_cli(capsys, *_batch(tiny_model_dir, tmp_path))
    assert [x for x in out.splitlines() if x.startswith("### ")] == ["### p0", "### p1", "### p2"]
    code, out, _ = run_cli(capsys, *_batch(tiny_model_dir, tmp_path, "--json", "--order", "finish"))
    assert [json.loads(x)["id"] for x in out.splitlines()] == ["p1", "p0", "p2"]


@pytest.mark.parametrize("stop", ["ctrl-c", "sigterm"])
def test_a_stopped_batch_prints_every_row_that_finished(capsys, tiny_model_dir, tmp_path, monkeypatch, stop):
    """Row 1 finished, row 0 had not when the run was stopped: row 1 still reaches the output."""
    from infer.decode.batch import BatchEngine

    original = BatchEngine.generate

    def generate(self, prompts, config=None, generators=None, processors=None, on_result=None):
        results = original(self, prompts, config, generators, processors)
        on_result(1, results[1])
        if stop == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        raise KeyboardInterrupt

    def outside(signum, _frame):  # what SIGTERM does outside the command here: not the test run's end
        raise SystemExit(99)

    monkeypatch.setattr(BatchEngine, "generate", generate)
    previous = signal.signal(signal.SIGTERM, outside)
    try:
        code = main([str(a) for a in _batch(tiny_model_dir, tmp_path, "--json")])
    except SystemExit as e:
        code = e.code
    finally:
        restored = signal.signal(signal.SIGTERM, previous)
    out, err = capsys.readouterr()
    assert code == (130 if stop == "ctrl-c" else 143), err
    assert [json.loads(x)["id"] for x in out.splitlines()] == ["p1"]
    assert restored is outside  # the command's own handler lasted only while it decoded


# --------------------------------------------------------------------------- item 9: errors about what was written
def test_a_drafter_option_without_a_drafter_suggests_one(capsys, tiny_model_dir):
    code, _, err = run_cli(capsys, "generate", "--model", tiny_model_dir, "--prompt", "hi", "--num-draft", "4")
    assert code == 2 and "--num-draft" in err and "--drafter" in err and "target_exit" not in err, err
    assert "early_exit" in err and "best" in err and len(err.strip().splitlines()) == 1


def test_the_bench_blames_the_drafter_the_user_named(capsys, tiny_model_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n')
    code, _, err = run_cli(capsys, "bench", "--model", tiny_model_dir, "--drafters", "autoregressive,early_exit:E=99",
                           "--data", prompts, "--n", "1", "--max-new-tokens", "4", "--repeats", "1", "--quiet",
                           "--quality-data", "none", "--out", tmp_path / "out")
    assert code == 2 and "early_exit:E=99" in err and "hf_early_exit" not in err, err


# --------------------------------------------------------------------------- item 10: the bench's screen
def test_the_bench_screen_has_short_labels_a_legend_and_a_recommendation_with_why(capsys, tiny_model_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n{"prompt": "x = 1"}\n{"prompt": "for i in"}\n')
    long = "early_exit:E=2:k=3:confidence=0.1:keep_last=true:tree=true:max_tree_nodes=4"
    out_dir = tmp_path / "out"
    code, out, err = run_cli(capsys, "bench", "--model", tiny_model_dir, "--drafters", f"autoregressive,{long}",
                             "--peers", "none", "--data", prompts, "--n", "3", "--max-new-tokens", "8", "--repeats",
                             "1", "--quiet", "--quality-data", "none", "--out", out_dir)
    assert code == 0, err
    table = [line for line in out.splitlines() if line.startswith(("autoregressive", "early_exit"))]
    assert len(table) == 2 and long not in out.split("labels cut short")[0], out
    assert all(len(line.split("  ")[0]) <= 40 for line in table), table
    assert "early_exit E=2 k=3 c=0.1 keep tree=4" in out and f"= {long}" in out  # the full spec said once
    head = next(line for line in out.splitlines() if line.startswith("method"))
    assert not {"k̄", "c", "expected", "opt share", "verifier Δ nats"} & set(head.split("  ")), head
    assert "α: share of drafted tokens accepted" in out and "M: tokens per verification" in out  # the legend
    said = next(line for line in out.splitlines() if line.startswith("recommended:"))
    assert "why:" in said or "no drafter measured faster" in said, said
    results = (out_dir / "results.md").read_text()
    assert long in results and "early_exit:tree=true:max_tree_nodes=4:exit_layer=2" in results  # full spec, as ran


# --------------------------------------------------------------------------- item 16 (part): flags that do nothing
def test_an_explicit_exit_layer_other_than_the_adapters_is_refused(capsys, tiny_model_dir, tmp_path):
    adapter = tmp_path / "a.safetensors"
    noisy_adapter(make_model("llama", seed=0), adapter, exit_layer=2)
    for exit_layer in ("8", "3"):  # 8 was the option's default, and was taken silently
        code, _, err = run_cli(capsys, "generate", "--model", tiny_model_dir, "--prompt", "hi", "--drafter",
                               "early_exit", "--adapter", adapter, "--exit-layer", exit_layer)
        assert code == 2 and "trained at exit layer 2" in err and len(err.strip().splitlines()) == 1, err
    code, _, err = run_cli(capsys, "generate", "--model", tiny_model_dir, "--prompt", "hi", "--drafter",
                           "early_exit", "--adapter", adapter, "--exit-layer", "2", "--max-new-tokens", "4")
    assert code == 0, err


@pytest.mark.parametrize("flags,message", [
    (["--top-p", "0.9"], "--top-p shapes sampling, and this run is greedy"),
    (["--top-k", "5", "--top-p", "0.9"], "--top-k and --top-p shape sampling"),
    (["--drafter", "early_exit", "--exit-layer", "2", "--max-tree-nodes", "4"], "add tree (--tree"),
    (["--drafter", "early_exit", "--exit-layer", "2", "--keep-last"], "add confidence (--confidence"),
])
def test_a_flag_that_would_do_nothing_is_refused(capsys, tiny_model_dir, flags, message):
    code, _, err = run_cli(capsys, "generate", "--model", tiny_model_dir, "--prompt", "hi", *flags)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_the_tuned_setting_supplies_what_those_flags_need(capsys, shipped, tiny_model_dir):
    """With the adapter's setting (a tree, a confidence stop) --max-tree-nodes and --keep-last have their effect."""
    code, _, err = run_cli(capsys, "generate", "--model", tiny_model_dir, "--prompt", "hi", "--drafter", "best",
                           "--max-tree-nodes", "2", "--keep-last", "--max-new-tokens", "4")
    assert code == 0, err
    code, _, err = run_cli(capsys, "bench", "--model", tiny_model_dir, "--top-p", "0.9", "--out", "unused")
    assert code == 2 and "add --sample" in err, err


@pytest.mark.parametrize("argv,codes", [
    (["generate", "--prompt", "hi", "--json", "--max-new-tokens", "3", "--model", "{tiny}"], (141,)),
    (["generate", "--prompts-file", "{prompts}", "--batch-size", "2", "--max-new-tokens", "3", "--model", "{tiny}"],
     (141,)),
    (["plan", "show", str(REPO / "plans" / "smollm2-135m-humaneval.json")], (141,)),
    (["generate", "--help"], (0, 141)),  # argparse's own help printing already ignores a closed output
])
def test_a_reader_that_leaves_early_ends_the_command_quietly(tiny_model_dir, tmp_path, argv, codes):
    """``layerskip ... | head -c 10``: the reader is gone before the first line; no traceback, status 141."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c"}\n')
    argv = [a.format(tiny=tiny_model_dir, prompts=prompts) for a in argv]
    read, write = os.pipe()
    os.close(read)  # the reader left
    proc = subprocess.run([sys.executable, "-m", "layerskip_cli", *argv], stdout=write, stderr=subprocess.PIPE,
                          text=True, timeout=300, cwd=REPO)
    os.close(write)
    assert proc.returncode in codes and "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, \
        proc.stderr
