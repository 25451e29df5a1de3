"""Issue 49 items 8-11: what the output tells a newcomer (a saved plan says what it is, acceptance comes with its
counts, refusals come fast)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from layerskip_cli.main import main

REPO = Path(__file__).resolve().parents[2]


def test_swift_save_plan_says_what_it_saved_even_untried(capsys, tiny_model_dir, tmp_path):
    plan = tmp_path / "plan.json"
    code = main(["generate", "--model", str(tiny_model_dir), "--prompt", "def f():", "--drafter", "swift",
                 "--max-new-tokens", "4", "--save-plan", str(plan), "--threads", "1"])
    err = capsys.readouterr().err
    assert code == 0, err
    line = next(x for x in err.splitlines() if x.startswith("layerskip: swift: wrote"))
    assert str(plan) in line and "no plan scored: the starting plan" in line and "never drafted" in line
    saved = json.loads(plan.read_text())
    assert saved["search"]["drafted_verifications"] == 0 and saved["objective"]["value"] is None


def test_every_acceptance_printed_comes_with_what_was_drafted(capsys, tiny_model_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n{"prompt": "x = 1"}\n')
    code = main(["generate", "--model", str(tiny_model_dir), "--prompt", "def add(a, b):", "--drafter", "early_exit",
                 "--exit-layer", "2", "--num-draft", "3", "--max-new-tokens", "12", "--ignore-eos"])
    err = capsys.readouterr().err
    assert code == 0 and "drafted for 12 tokens" in err and "acceptance" in err, err
    code = main(["generate", "--model", str(tiny_model_dir), "--prompts-file", str(prompts), "--drafter",
                 "early_exit", "--exit-layer", "2", "--max-new-tokens", "6", "--ignore-eos", "--stream"])
    err = capsys.readouterr().err
    stream = next(x for x in err.splitlines() if x.startswith("[stream]"))
    assert code == 0 and "drafted for 12 tokens" in stream, err


def test_the_search_says_what_its_objective_value_means(capsys, tiny_model_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n{"prompt": "import os"}\n')
    code = main(["search", "--model", str(tiny_model_dir), "--data", str(prompts), "--trials", "2", "--out",
                 str(tmp_path / "p.json"), "--cost", "weights", "--n", "2", "--max-new-tokens", "8", "--quiet"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "expected speed-up" in err and "x over plain decoding (model objective" in err
    assert "tokens drafted)" in err and "model objective 0." not in err


def test_the_search_calibration_has_a_progress_bar(capsys, tiny_model_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n{"prompt": "import os"}\n')
    code = main(["search", "--model", str(tiny_model_dir), "--data", str(prompts), "--trials", "2", "--out",
                 str(tmp_path / "p.json"), "--cost", "weights", "--n", "2", "--max-new-tokens", "8"])
    err = capsys.readouterr().err
    assert code == 0 and "calibration (the full model's outputs)" in err, err


def test_an_existing_save_plan_is_refused_before_the_heavy_imports(tmp_path):
    """The refusal comes as fast as --help: nothing of transformers or the model loading is imported first."""
    existing = tmp_path / "plan.json"
    existing.write_text("{}")
    code = ("import sys; from layerskip_cli.main import main; "
            f"code = main(['generate', '--prompt', 'hi', '--drafter', 'swift', '--save-plan', {str(existing)!r}]); "
            "print(code, 'transformers' in sys.modules, 'infer.loading' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.stdout.split() == ["2", "False", "False"], proc.stderr
    assert "exists; pass --force" in proc.stderr and proc.stderr.count("\n") == 1


def test_a_pipeline_with_do_sample_false_is_greedy_through_our_drafter(tiny_model_dir):
    """docs/HF_GENERATE.md's pipeline paragraph: do_sample=False gives the plain pipeline's greedy text."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    from infer import hf_generate

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    pipe = pipeline("text-generation", model=model, tokenizer=AutoTokenizer.from_pretrained(tiny_model_dir))
    plain = pipe("def add(a, b):", max_new_tokens=12, do_sample=False)[0]["generated_text"]
    ours = pipe("def add(a, b):", max_new_tokens=12, do_sample=False,
                custom_generate=hf_generate("early_exit", exit_layer=2, num_draft=3))[0]["generated_text"]
    assert ours == plain
