"""The GPU check's pieces on the CPU (tools.gpu): kernel counting, the markdown report, part budgets, optional
packages, every registered drafter in its drafter lists; tools/gpu/gpu_check.py's refusal of --device cuda without a
GPU. Its end-to-end run is checked in test_lease_rehearsal.py."""

import time

import pytest
import torch

from infer.drafters import DRAFTERS
from script_modules import load_script
from tools.gpu.check_report import failures, markdown
from tools.gpu.counts import uncaptured
from tools.gpu.drafters import drafter_specs, shape_drafters, sync_specs
from tools.gpu.run import Run, Settings, optional_in, part
from tools.gpu.shapes import COMPILE_RESERVE_S


def test_kernels_are_counted_on_the_forward_not_on_a_graph_replay(monkeypatch):
    """The kernel count runs the static forward itself: no graph replay (CUPTI miscounts replays on CUDA 13.0)."""
    from executor_cases import fake_capture

    from infer.model.graphs import StaticSpan
    from infer.model.program import Program, Rows
    from infer.model.runner import Runner
    from tools.seeded_models import tiny_model

    monkeypatch.setattr(StaticSpan, "capture", fake_capture)
    runner = Runner.from_model(tiny_model("llama", 0), executor="static")
    runner.static.capture = True
    cache = runner.new_cache(256)
    runner.forward(cache, torch.arange(3, 11))
    one = runner.embed(torch.tensor([5]))
    runner.run(Program(0, 4, logits=True), Rows.one(cache, one, [8]))  # captured (a stand-in graph) on first use
    cache.rollback(8)
    replays = []
    for span in runner.static.spans(cache):
        monkeypatch.setattr(span.graph, "replay", lambda: replays.append(1), raising=False)
    with uncaptured(runner):
        runner.run(Program(0, 4, logits=True), Rows.one(cache, one, [8]))
    assert replays == [] and runner.static.capture is True


def test_markdown_reports_timed_captures_and_failures():
    shape = {"ms_forward": 1.0, "v": {"1": 1.0}, "c": {"1": 0.3}, "ours_ar_tok_s": 100.0, "captures_in_timed": 2,
             "builds_in_timed": 1}
    result = {"device": "x", "torch": "t", "transformers": "h", "commit": "c", "date": "d", "tiny": False,
              "command": "python -m tools.gpu.gpu_check", "notes": [], "shapes": {"S": shape, "T": {"error": "OOM"}},
              "exact": {"greedy_fp32_failures": 1, "sampling": {"swift": {"ok": False, "error": "E"}}},
              "errors": {"syncs": "RuntimeError: boom"}, "e2e_ok": True}
    text = markdown(result)
    assert "S: the timed runs captured 2 CUDA graph(s), built 1 static forward(s) and compiled 0 time(s)" in text
    assert "T failed: OOM" in text
    assert failures(result) == ["1 fp32 greedy mismatch(es)", "sampled generation of swift did not complete",
                                          "part syncs raised RuntimeError: boom"]
    assert text.count("FAILED:") == 3


def test_a_piece_past_its_part_budget_is_cut_with_a_note():
    settings = Settings.for_run(True, budget_s=1000.0)
    settings.part_budgets_s["shapes"] = 100.0
    run = Run(torch.device("cpu"), settings)
    run.part_name, run.part_started = "shapes", time.perf_counter() - 100.0 + COMPILE_RESERVE_S / 2
    assert not run.cut("forward costs") and run.notes == []
    assert run.cut("hf_static", COMPILE_RESERVE_S) and "hf_static cut" in run.notes[0]
    spent = Run(torch.device("cpu"), settings, started=time.perf_counter() - 2000.0)
    part("greedy", lambda: 1 / 0, spent)  # never started
    assert spent.result["parts"]["greedy"]["cut"] is True and "part greedy cut" in spent.notes[0]


def test_a_missing_optional_package_in_the_training_check_is_a_note():
    assert optional_in("ModuleNotFoundError: No module named 'accelerate'") == "accelerate"
    assert optional_in("ImportError: Using the Trainer requires the `accelerate` library") == "accelerate"
    assert optional_in("ModuleNotFoundError: No module named 'torch'") is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_gpu_check_cuda_without_a_gpu(tmp_path, capsys):
    assert load_script("gpu_check").main(["--device", "cuda", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "CUDA is not available" in err and len(err.strip().splitlines()) == 1


def test_every_drafter_list_of_the_check_covers_the_registry(tmp_path):
    """The greedy, sampling, sync and per-shape drafter lists all come from the registry (dynamic_exit included)."""
    from infer.model.runner import Runner
    from tools.seeded_models import tiny_model

    runner = Runner.from_model(tiny_model("llama", 0))
    names = lambda specs: {name for name, _ in specs.values()}  # noqa: E731
    assert names(drafter_specs(runner, tmp_path)) == set(DRAFTERS) - {"autoregressive"}
    assert names(sync_specs(runner, tmp_path)) == set(DRAFTERS) == names(shape_drafters(runner, tmp_path))


def test_the_quantized_draft_case_drafts_on_a_cpu_and_must_be_refused_on_cuda(monkeypatch):
    """The check's quantized case (issue 64 item 9): on the CPU rehearsal quant_self drafts and equals plain decoding;
    on CUDA its refusal is what passes, and a quantized draft that did not refuse there fails the run."""
    from tools.gpu.check_report import failures
    from tools.gpu.exact import quant_case

    run = Run(torch.device("cpu"), Settings.for_run(True, budget_s=1000.0))
    case = quant_case(run, 8)
    assert case["expected"] == "drafts" and case["ok"] and case["drafted"] > 0, case
    assert failures({"exact": {"quant_draft": case}}) == []
    refused = {"device": "cuda:0", "expected": "refused", "ok": False, "message": ""}
    assert failures({"exact": {"quant_draft": refused}}) == ["quantized drafts on cuda:0: expected refused, got "
                                                             "something else"]
