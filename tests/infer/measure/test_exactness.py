"""The tie-flip classifier: constructed logits rows, divergences planted in a tiny model's output (recomputed on
the executor that ran), the run's own verification argmax, and the fp32-recomputation rounding the tie bound is
based on."""

import pytest
import torch

from infer import kernels
from infer.decode.engine import DecodeConfig, Engine
from infer.drafters import build_drafter
from infer.measure.exactness import (
    ULPS,
    DivergenceJudge,
    classify_divergence,
    classify_logits,
    decode_verified,
    first_divergence,
    measure_rounding,
    measure_spread,
    tie_bound,
    ulp,
)
from infer.model.program import STEP
from infer.model.runner import Runner
from tiny_models import make_model


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2
    assert first_divergence([], []) is None


def test_ulp_matches_the_dtype_spacing():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for x in (1.0, 3.0, 20.0, 100.0):
            t = torch.tensor(x, dtype=dtype)
            assert ulp(x, dtype) == float(torch.nextafter(t, torch.tensor(1e9, dtype=dtype)) - t)


def _row(values: dict[int, float], vocab: int = 16) -> torch.Tensor:
    row = torch.full((vocab,), -5.0)
    for i, v in values.items():
        row[i] = v
    return row


def test_bf16_near_tie_is_a_tie_flip():
    # 20 and 20 - 1 bf16 ulp (0.125 at this magnitude): one rounding apart
    margin, bound, tie, reason = classify_logits(_row({3: 20.0, 7: 19.875}), 3, 7, torch.bfloat16)
    assert margin == pytest.approx(0.125) and bound == pytest.approx(ULPS * 0.125)
    assert tie and reason == ""


def test_real_mismatch_is_not_a_tie_flip():
    margin, bound, tie, reason = classify_logits(_row({3: 20.0, 7: 17.0}), 3, 7, torch.bfloat16)
    assert margin == pytest.approx(3.0) and not tie and "exceeds the tie bound" in reason
    # the same 0.125 gap that is a tie in bf16 is a real mismatch in fp32
    margin, bound, tie, _ = classify_logits(_row({3: 20.0, 7: 19.875}), 3, 7, torch.float32)
    assert bound < 1e-4 and not tie


def test_negative_margin_is_the_reference_disagreeing_with_itself():
    # the recomputed row prefers the other run's token by a hair: the reference output is not its own argmax
    margin, bound, tie, reason = classify_logits(_row({3: 19.875, 7: 20.0}), 3, 7, torch.bfloat16)
    assert margin == pytest.approx(-0.125) and abs(margin) <= bound
    assert not tie and "reference disagrees with itself" in reason


def test_a_third_token_winning_is_the_reference_disagreeing_with_itself():
    margin, _, tie, reason = classify_logits(_row({3: 20.0, 7: 19.875, 5: 25.0}), 3, 7, torch.bfloat16)
    assert margin > 0 and not tie and "pick token 5" in reason


def test_the_bound_is_four_times_the_measured_rounding_with_an_ulp_floor():
    assert tie_bound(0.25, 20.0, torch.bfloat16) == 1.0
    assert tie_bound(0.0, 20.0, torch.bfloat16) == ULPS * 0.125
    row = _row({3: 20.0, 7: 19.0})  # margin 1.0
    assert classify_logits(row, 3, 7, torch.bfloat16, rounding=0.25)[2]
    assert not classify_logits(row, 3, 7, torch.bfloat16, rounding=0.24)[2]


def test_an_emitted_token_its_own_verification_did_not_choose_is_a_bug_however_small_the_margin():
    row = _row({3: 20.0, 7: 19.875})  # a bf16 near-tie
    assert classify_logits(row, 3, 7, torch.bfloat16, verified=7)[2]  # the verification chose 7: a tie flip
    margin, _, tie, reason = classify_logits(row, 3, 7, torch.bfloat16, rounding=10.0, verified=3)
    assert margin == pytest.approx(0.125) and not tie and "acceptance bug" in reason


def _runner_up(row: torch.Tensor, token: int) -> int:
    """The best token of a logits row (V,) other than ``token`` (exact ties included)."""
    others = row.clone()
    others[token] = -float("inf")
    return int(others.argmax())


def _plant(runner: Runner, prompt: list[int], ref: list[int], pos: int) -> list[int]:
    """ref with the token at ``pos`` replaced by the target's runner-up there (as plain decoding computes it)."""
    engine = Engine(runner, build_drafter("autoregressive", runner))
    row = engine.target_logits(prompt, ref[:pos], GEN)  # (V,)
    return ref[:pos] + [_runner_up(row, ref[pos])] + ref[pos + 1:]


GEN = DecodeConfig(max_new_tokens=12, stop_at_eos=False)


def test_classify_divergence_on_a_tiny_model():
    runner = Runner.from_model(make_model("llama", seed=0, layers=4))
    prompt = [5, 6, 7, 8, 9]
    engine = Engine(runner, build_drafter("autoregressive", runner))
    ref = engine.generate(prompt, GEN).tokens
    assert classify_divergence(runner, prompt, ref, list(ref), GEN) is None
    pos = 6
    full = runner.forward(runner.new_cache(32), torch.tensor(prompt + ref[:pos]))[-1]  # (V,)
    out = _plant(runner, prompt, ref, pos)
    div = classify_divergence(runner, prompt, ref, out, GEN)
    assert (div.position, div.ref_token, div.out_token) == (pos, ref[pos], out[pos])
    assert div.margin == pytest.approx(float(full[ref[pos]] - full[out[pos]]), abs=1e-4)
    assert div.margin > 0 and not div.tie_flip  # fp32: a different token is a bug, never a tie
    short = classify_divergence(runner, prompt, ref, ref[:4], GEN)
    assert short.position == 4 and short.out_token == -1 and not short.tie_flip


def test_a_corrupted_reference_is_a_bug_not_a_tie_flip():
    """The reference's token replaced by the runner-up: the margin is negative, however small."""
    runner = Runner.from_model(make_model("llama", seed=0, layers=4))
    prompt = [5, 6, 7, 8, 9]
    ref = Engine(runner, build_drafter("autoregressive", runner)).generate(prompt, GEN).tokens
    for pos in (2, 6):
        corrupted = _plant(runner, prompt, ref, pos)
        div = classify_divergence(runner, prompt, corrupted, ref, GEN, rounding=100.0)  # even a huge bound
        assert div.margin < 0 and not div.tie_flip and "reference disagrees with itself" in div.reason


def test_bf16_margins_are_those_of_the_static_path_that_ran():
    """Reference and run on the static executor in bf16: every planted divergence is judged on the reference's own
    row (the eager path differs from it by up to ~0.02 here), so its margin is exactly that row's and >= 0."""
    model = make_model("llama", seed=0, layers=4)
    runner = Runner.from_model(model, dtype=torch.bfloat16, executor="static")
    prompt = [5, 6, 7, 8, 9]
    gen = DecodeConfig(max_new_tokens=16, stop_at_eos=False)
    ref = Engine(runner, build_drafter("autoregressive", runner)).generate(prompt, gen).tokens
    own = Engine(runner, build_drafter("autoregressive", runner))
    for pos in range(len(ref)):
        row = own.target_logits(prompt, ref[:pos], gen)  # (V,) as the reference run computed it
        assert int(row.argmax()) == ref[pos]
        second = _runner_up(row, ref[pos])
        out = ref[:pos] + [second] + ref[pos + 1:]
        div = classify_divergence(runner, prompt, ref, out, gen)
        assert div.margin == float(row[ref[pos]] - row[second]) and div.margin >= 0, pos
        assert div.tie_flip == (div.margin <= div.resolution) and (div.reason == "") == div.tie_flip


def test_spread_of_one_row_vs_many_rows():
    model = make_model("llama", seed=0, layers=4)
    fp32 = measure_spread(Runner.from_model(model, executor="static"), sizes=(2, 3, 8))
    assert set(fp32["per_size"]) == {2, 3, 8} and fp32["executor"] == "static" and fp32["dtype"] == "float32"
    assert 0.0 <= fp32["max_abs"] < 1e-4 and fp32["prompts"] == 3
    bf16 = measure_spread(Runner.from_model(model, dtype=torch.bfloat16, executor="eager", kernel="torch"),
                          sizes=(2, 8))  # torch's route: a many-row bf16 verification rounds otherwise
    assert bf16["max_abs"] == max(bf16["per_size"].values()) and 0.0 < bf16["max_abs"] < 0.5
    if kernels.supports(kernels.load(), torch.bfloat16):  # the CPU kernel's bf16 path: batch invariant, no spread
        kernel = measure_spread(Runner.from_model(model, dtype=torch.bfloat16, executor="eager"), sizes=(2, 8))
        assert kernel["max_abs"] == 0.0


def test_judge_measures_the_rounding_once_and_only_when_needed(monkeypatch):
    from infer.measure import exactness

    runner = Runner.from_model(make_model("llama", seed=0, layers=4))
    calls = []
    monkeypatch.setattr(exactness, "measure_rounding", lambda r, ref: calls.append(r) or {"max_abs": 0.125})
    judge = DivergenceJudge(runner, GEN)
    prompt = [5, 6, 7, 8, 9]
    ref = Engine(runner, build_drafter("autoregressive", runner)).generate(prompt, GEN).tokens
    assert judge.classify(prompt, ref, list(ref)) is None and not calls
    for pos in (3, 5):
        div = judge.classify(prompt, ref, _plant(runner, prompt, ref, pos))
        assert div.resolution >= 0.5
    assert len(calls) == 1 and judge.rounding == 0.125 and judge.bound_source == "fp32 recomputation"


def test_rounding_is_measured_against_an_fp32_recomputation_not_the_many_row_path(monkeypatch):
    """fp32: the one-row path and a full-sequence fp32 forward agree to ~1e-6; bf16 weights upcast to fp32 give the
    bf16 runner's own rounding. Breaking the many-row verification path leaves the bound unchanged."""
    model = make_model("llama", seed=0, layers=4)
    fp32 = measure_rounding(Runner.from_model(model, executor="static"), n=8)
    assert 0.0 <= fp32["max_abs"] < 1e-4 and fp32["prompts"] == 3 and "fp32" in fp32["path"]
    bf16_model = make_model("llama", seed=0, layers=4).to(torch.bfloat16)
    runner = Runner.from_model(bf16_model, dtype=torch.bfloat16, executor="eager")
    reference = Runner.from_model(bf16_model, dtype=torch.float32)
    bf16 = measure_rounding(runner, reference, n=8)
    assert 0.0 < bf16["max_abs"] < 0.5 and bf16["dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="fp32 reference"):
        measure_rounding(runner)
    run = Runner.run

    def broken(self, program, rows):  # a many-row path that rounds badly
        out = run(self, program, rows)
        if rows.size > 1 and rows.kind == STEP and out.logits is not None:
            out.logits = out.logits + 5.0 * torch.randn_like(out.logits)
        return out
    monkeypatch.setattr(Runner, "run", broken)
    assert measure_rounding(runner, reference, n=8)["max_abs"] == bf16["max_abs"]
    assert measure_spread(runner, sizes=(2, 4))["max_abs"] > 1.0  # the old bound would have widened


def test_a_runner_up_emitted_by_an_acceptance_bug_is_a_bug(monkeypatch):
    """An early exit whose acceptance emits the target's runner-up at one position: even with a bound wide enough
    to call the margin a tie, the run's own verification chose the reference's token there, so it is a bug."""
    import infer.decode.verify as engine_module  # where acceptance runs (one row or a batch)

    runner = Runner.from_model(make_model("llama", seed=0, layers=4))
    prompt = [5, 6, 7, 8, 9]
    ref = Engine(runner, build_drafter("autoregressive", runner)).generate(prompt, GEN).tokens
    pos = 6
    planted = _plant(runner, prompt, ref, pos)
    accept = engine_module.greedy_accept
    emitted = []

    def buggy(tree, tokens, argmax):  # emits the runner-up as the token at output position ``pos``
        path, bonus = accept(tree, tokens, argmax)
        if len(emitted) <= pos < len(emitted) + len(path):  # accept up to just before pos, then the runner-up
            path, bonus = path[:pos - len(emitted) + 1], planted[pos]
        emitted.extend([0] * len(path))
        return path, bonus
    monkeypatch.setattr(engine_module, "greedy_accept", buggy)
    engine = Engine(runner, build_drafter("early_exit", runner, {"exit_layer": 2, "num_draft": 3}))
    emitted.append(0)  # the prefill's token
    out, verified, _ = decode_verified(engine, prompt, GEN)
    assert out[pos] == planted[pos] != ref[pos] and verified[pos] == ref[pos]
    div = DivergenceJudge(runner, GEN, rounding=100.0).classify(prompt, ref, out, verified)
    assert div.position == pos and not div.tie_flip and "acceptance bug" in div.reason


def test_a_bf16_judge_without_an_fp32_reference_keeps_the_old_bound(monkeypatch):
    """No fp32 reference: the one-row vs many-row spread, a bound of 2 x spread as before (``bound_source`` says so)."""
    from infer.measure import exactness

    runner = Runner.from_model(make_model("llama", seed=0, layers=4), dtype=torch.bfloat16)
    monkeypatch.setattr(exactness, "measure_spread", lambda r: {"max_abs": 0.5})
    judge = DivergenceJudge(runner, GEN)
    assert judge.rounding == 0.25 and judge.bound_source == "many-row spread"
    assert tie_bound(judge.rounding, 20.0, torch.bfloat16) == 1.0
