"""Prefill's room (``infer.decode.prefill``): prompts prefilled together give, per prompt, bitwise (fp32) the cache, the
kept streams and the logits that prefilling that prompt alone gives, at 1, 2 and 4 prompts of different lengths, on
several families and target depths; where packing is not provably exact every prompt runs alone; a batch's joining rows
prefill together and decode as each prompt alone."""

import dataclasses
import random

import pytest
import torch

from infer.decode import prefill as prefill_module
from infer.decode.batch import BatchEngine
from infer.decode.engine import DecodeConfig, Engine
from infer.decode.prefill import Prompt, prefill
from infer.drafters import ExampleModel, build_drafter, example_cases
from infer.drafters.base import DecodeState
from infer.model.loop import packs
from infer.model.runner import Runner
from infer.model.sampling import SamplingConfig
from tiny_models import family_model, make_model, noisy_adapter

L = 6
LENGTHS = [1, 37, 5, 12, 3, 24, 64, 9]  # 1-3 token prompts too: the kernel's rows need no minimum


@pytest.fixture(scope="module")
def model():
    return make_model("llama", seed=0, layers=L)


@pytest.fixture(scope="module")
def runner(model):
    return Runner.from_model(model)


def token_lists(lengths, seed=3, vocab=320):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def fresh(runner, prompt, depth=None):
    """A state holding ``prompt`` in an empty cache of its own."""
    return DecodeState(runner, runner.new_cache(128), SamplingConfig(), torch.Generator(), tokens=list(prompt),
                       prompt_len=len(prompt), depth=depth)


def snapshot(state, logits):
    """Everything a prefill leaves: logits, the cache's filled rows and lengths (and window positions), kept streams."""
    cache, P = state.cache, state.prompt_len
    pos = None if cache.pos is None else cache.pos[:, :P].clone()
    kept = None if state.prompt_observed is None else {k: v.clone() for k, v in state.prompt_observed.items()}
    return logits.clone(), cache.k[:, :, :P].clone(), cache.v[:, :, :P].clone(), list(cache.lengths), pos, kept, state.n


def assert_same(a, b, what):
    for x, y in zip(a, b, strict=True):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), what
        elif isinstance(x, dict):
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), what
        else:
            assert x == y, what


def compare(runner, prompts, layers=(), rows=0, depths=None):
    """Prefill ``prompts`` one by one and in groups of 2 and 4 (one ``prefill`` call per group); every prompt's
    snapshot must be the same. Returns the number of forwards the groups of 4 ran."""
    depths = depths or [None] * len(prompts)

    def run(group):
        states = [fresh(runner, prompts[j], depths[j]) for j in group]
        logits = prefill(runner, [Prompt(s, tuple(x for x in layers if x < s.depth), rows) for s in states])
        return [snapshot(s, lg) for s, lg in zip(states, logits, strict=True)]

    alone = [run([j])[0] for j in range(len(prompts))]
    for size in (2, 4):
        for g in range(0, len(prompts), size):
            group = list(range(g, min(g + size, len(prompts))))
            for j, snap in zip(group, run(group), strict=True):
                assert_same(alone[j], snap, (size, len(prompts[j])))


@pytest.fixture(autouse=True)
def _one_thread():
    """Packing needs one intra-op thread (the module's rule); a test worker may run more: one for each test here."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _packs_on_one_thread() -> bool:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return packs(Runner.from_model(make_model("llama", seed=0, layers=2)))
    finally:
        torch.set_num_threads(before)


needs_packing = pytest.mark.skipif(not _packs_on_one_thread(),
                                   reason="prompts pack only on the kernel's AVX-512 fp32 path")


@needs_packing
def test_packed_prompts_equal_each_prompt_alone(runner, monkeypatch):
    forwards = []
    real = prefill_module.forward
    monkeypatch.setattr(prefill_module, "forward", lambda r, ps, bulk: forwards.append((len(ps), bulk)) or
                        real(r, ps, bulk))
    compare(runner, token_lists(LENGTHS))
    assert (4, False) in forwards and (2, False) in forwards  # groups ran as one packed forward each


@needs_packing
@pytest.mark.parametrize("kind", ["gemma3_text", "qwen3"])
def test_packed_prompts_equal_alone_on_other_families(kind):
    """Gemma 3 (sliding windows shorter than the prompts, sandwich norms, GELU, capped logits), Qwen3 (q/k norms)."""
    runner = Runner.from_model(family_model(kind, seed=1))
    assert packs(runner)
    compare(runner, token_lists([40, 3, 17, 29, 1, 33], seed=5))


@needs_packing
def test_kept_streams_and_lossy_depths_pack_exactly(runner):
    """Streams kept at a drafter's prompt layers (a prompt shorter than the rows kept too), and prompts of different
    target depths in one call (grouped by depth), each as alone."""
    prompts = token_lists([30, 4, 17, 11, 26, 8], seed=7)
    compare(runner, prompts, layers=(2, 4), rows=5)
    compare(runner, prompts, depths=[6, 3, 3, 6, 4, 3])


def test_where_packing_is_not_exact_every_prompt_runs_alone(model, runner, monkeypatch):
    """More than one thread, bf16, or the torch matmul: one forward per prompt on F.linear (the rule in
    ``infer.decode.prefill``); too many positions for one packed forward: several."""
    torch_runner = Runner.from_model(model, kernel="torch")
    bf16 = Runner.from_model(model, dtype=torch.bfloat16)
    assert not packs(torch_runner) and not packs(bf16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert not packs(runner)
    finally:
        torch.set_num_threads(threads)
    prompts = token_lists([9, 14, 6])
    for r in (torch_runner, bf16):
        assert prefill_module.groups([Prompt(fresh(r, p)) for p in prompts], packs(r)) == [[0], [1], [2]]
    monkeypatch.setattr(prefill_module, "PACK_ROWS", 20)
    assert prefill_module.groups([Prompt(fresh(runner, p)) for p in prompts], True) == [[0], [1, 2]]


EXAMPLES = example_cases(ExampleModel(L))
CASES = EXAMPLES | {"dynamic_exit_prompt_rows": ("dynamic_exit", EXAMPLES["dynamic_exit"][1] | {"prompt_rows": 6})}
"""Every registered drafter's examples (early exit drafts over the prefill's exact layers [0, E)), and dynamic exit
asking the prefill for rows."""


@pytest.mark.parametrize("case", [*CASES, "adapter"])
def test_batches_of_1_2_4_decode_each_prompt_as_alone(model, runner, case, tmp_path, monkeypatch):
    """Rows prefilled together (the first rows, and rows joining as others finish) decode what each prompt decodes
    alone with the same drafter, at batch sizes 1, 2 and 4; the first round prefills B prompts in one call."""
    if case == "adapter":
        noisy_adapter(model, tmp_path / "a.safetensors", 3, noise=0.05)
        name, options = "early_exit", {"adapter": str(tmp_path / "a.safetensors"), "k": 3}
    else:
        name, options = CASES[case]
    prompts = token_lists([23, 2, 41, 9, 17, 30], seed=11)
    config = DecodeConfig(max_new_tokens=12)
    alone = [Engine(runner, build_drafter(name, runner, options)).generate(p, config) for p in prompts]
    calls = []
    real = prefill_module.prefill
    monkeypatch.setattr("infer.decode.engine.prefill", lambda r, ps: calls.append(len(ps)) or real(r, ps))
    for size in (1, 2, 4):
        calls.clear()
        with BatchEngine(runner, lambda: build_drafter(name, runner, options), size) as engine:
            results = engine.generate(prompts, config)
        assert calls[0] == size and sum(calls) == len(prompts)
        if case == "autoregressive":  # rows finish together (a token per cycle, no EOS): they join together too
            assert calls == [min(size, len(prompts) - i) for i in range(0, len(prompts), size)]
        for want, got in zip(alone, results, strict=True):
            assert (got.tokens, got.finish_reason) == (want.tokens, want.finish_reason), (case, size)
            assert counts(got.stats.drafter) == counts(want.stats.drafter), (case, size)


def counts(stats):
    """A drafter's statistics without its clock readings (what it drafted and learned, not how long it took)."""
    return {k: v for k, v in dataclasses.asdict(stats).items() if not any(w in k for w in ("seconds", "time", "tps"))}


def test_prefill_time_is_shared_by_prompt_length(runner):
    with BatchEngine(runner, lambda: build_drafter("autoregressive", runner), 3) as engine:
        results = engine.generate(token_lists([10, 20, 30]), DecodeConfig(max_new_tokens=2))
    times = [r.stats.prefill_time for r in results]
    assert times[0] > 0 and times[1] == pytest.approx(2 * times[0]) and times[2] == pytest.approx(3 * times[0])
