"""The batched engine: every row's greedy output equals that prompt decoded alone by plain decoding, for every
drafter, with rows of very different lengths and finishing times and rows joining from a queue; sampled rows are
the same at any batch size; a batch whose caches do not fit is refused in one line."""

import dataclasses
import random

import pytest
import torch

from infer.decode import batch as batch_module
from infer.decode.batch import BatchEngine
from infer.decode.batch_gate import PROBE, BatchGate
from infer.decode.cycle import CycleObserver
from infer.decode.engine import DecodeConfig, Engine
from infer.drafters import ExampleModel, build_drafter, example_cases
from infer.drafters.registry import drafter_class
from infer.model.runner import Runner
from infer.model.sampling import SamplingConfig
from layerskip_core.errors import UserError
from tiny_models import make_model, noisy_adapter

L = 6
PLAIN = "autoregressive"
LENGTHS = [1, 37, 5, 12, 3, 24]  # very different prompt lengths; more prompts than rows: later ones join


@pytest.fixture(scope="module")
def model():
    return make_model("llama", seed=0, layers=L)


@pytest.fixture(scope="module")
def runner(model):
    return Runner.from_model(model)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(3)
    return [[rng.randrange(320) for _ in range(n)] for n in LENGTHS]


REFERENCE: dict = {}


def alone(runner, prompt, config, eos=(), decode=None):
    """Plain decoding of ``prompt`` on its own (tokens, finish reason), computed once per case."""
    key = (tuple(prompt), config, eos, decode)
    if key not in REFERENCE:
        result = Engine(runner, build_drafter("autoregressive", runner), eos, decode).generate(prompt, config)
        REFERENCE[key] = result.tokens, result.finish_reason
    return REFERENCE[key]


@pytest.fixture(scope="module")
def eos(runner, prompts):
    """An end-of-sequence id that ends some rows early and not others (different finishing times)."""
    return (alone(runner, prompts[1], DecodeConfig(max_new_tokens=16))[0][6],)


def adapter_file(model, path):
    noisy_adapter(model, path, 3, noise=0.05)
    return path


EARLY_EXIT = {
    "early_exit_confidence": {"E": 4, "k": 5, "confidence": 0.013},  # stops some chains early
    "early_exit_adaptive": {"E": 2, "k": 3, "adaptive": True, "recheck_interval": 1, "remember": "off",
                            "watch": False},
    "early_exit_prefix_copy": {"E": 3, "k": 3, "prefix": "copy", "draft_dtype": "bf16"},
    "early_exit_prefix_copy_adaptive": {"E": 2, "k": 3, "prefix": "copy", "adaptive": True, "recheck_interval": 1,
                                        "remember": "off"},
    "early_exit_tree_stop": {"E": 3, "k": 3, "tree": True, "max_tree_nodes": 6, "confidence": 0.013,
                             "keep_last": True},  # rows verify trees of different shapes together
}
"""Early exit's own variants in a batch: its gate, copied prefix and stops."""
CASES = example_cases(ExampleModel(L)) | {case: ("early_exit", options) for case, options in EARLY_EXIT.items()}
"""Every registered drafter's examples (dynamic exit's rows choose their own exits: packed per exit), and early
exit's variants."""


ADAPTER_CASES = {"adapter": {}, "adapter_prefix_copy": {"prefix": "copy"},
                 "adapter_tree": {"tree": True, "max_tree_nodes": 5, "confidence": 0.013, "keep_last": True}}


@pytest.mark.parametrize("case", [*CASES, *ADAPTER_CASES])
def test_every_row_equals_plain_decoding_alone(model, runner, prompts, eos, case, tmp_path):
    with_adapter = {"adapter": str(adapter_file(model, tmp_path / "a.safetensors")), "k": 3}
    name, options = ("early_exit", with_adapter | ADAPTER_CASES[case]) if case in ADAPTER_CASES else CASES[case]
    config = DecodeConfig(max_new_tokens=16)
    with BatchEngine(runner, lambda: build_drafter(name, runner, options), 3, eos) as engine:
        results = engine.generate(prompts, config)
    finished = set()
    for prompt, result in zip(prompts, results, strict=True):
        assert (result.tokens, result.finish_reason) == alone(runner, prompt, config, eos), (case, len(prompt))
        finished.add(result.finish_reason)
    assert finished == {"eos", "length"}
    if CASES.get(case, ("",))[0] != PLAIN:
        assert sum(r.stats.drafted for r in results) > 0


def letters(ids):
    return "".join(chr(97 + t % 26) for t in ids)


def test_stop_strings_and_one_token_rows(runner, prompts):
    decode = letters
    ref = alone(runner, prompts[2], DecodeConfig(max_new_tokens=16))[0]
    stop = decode(ref[5:7])
    for config in (DecodeConfig(max_new_tokens=16, stop_strings=(stop,)), DecodeConfig(max_new_tokens=1)):
        with BatchEngine(runner, lambda: build_drafter("early_exit", runner, {"E": 3, "k": 4}), 4,
                         decode=decode) as engine:
            results = engine.generate(prompts, config)
        for prompt, result in zip(prompts, results, strict=True):
            assert (result.tokens, result.finish_reason) == alone(runner, prompt, config, decode=decode)


CLOCK_FREE = {case: c for case, c in example_cases(ExampleModel(L), main_only=True).items() if c[0] != PLAIN} | {
    "early_exit_confidence": CASES["early_exit_confidence"]}
"""Every drafter's main example (their choices are counts, not clocks: Self-SD's threshold gamma, dynamic exit's
estimates and SWIFT's plan search carry from one prompt to the next), and early exit with a confidence stop."""


@pytest.mark.parametrize("case", sorted(CLOCK_FREE))
def test_a_sampled_row_is_the_same_at_any_batch_size(runner, prompts, case):
    """Each prompt meets a fresh drafter, so what it samples does not depend on the batch size, its slot or when the
    other rows finish: the same as a fresh engine per prompt (what ``layerskip generate`` does without --stream)."""
    name, options = CLOCK_FREE[case]
    config = DecodeConfig(max_new_tokens=20, sampling=SamplingConfig(temperature=0.9, top_p=0.95, seed=11))
    outputs = []
    for size in (1, 2, 4):
        with BatchEngine(runner, lambda: build_drafter(name, runner, options), size) as engine:
            outputs.append([r.tokens for r in engine.generate(prompts[:5], config)])
    assert outputs[0] == outputs[1] == outputs[2]
    for i, prompt in enumerate(prompts[:5]):  # and it is what a fresh one-row engine samples with the same seed
        assert Engine(runner, build_drafter(name, runner, options)).generate(prompt, config).tokens == outputs[1][i]


def test_carry_state_keeps_a_slots_drafter():
    """``carry_state=True``: a slot's drafter decodes the prompts the slot takes in turn (a stream per slot)."""
    runner = Runner.from_model(make_model("llama", seed=0, layers=4))
    built = []

    def make():
        built.append(build_drafter("early_exit", runner, {"E": 2, "k": 2}))
        return built[-1]

    for carry, drafters in ((True, 2), (False, 5)):
        built.clear()
        with BatchEngine(runner, make, 2, carry_state=carry) as engine:
            engine.generate([[1, 2, 3]] * 5, DecodeConfig(max_new_tokens=3))
        assert len(built) == drafters


def test_the_verification_is_one_packed_forward(runner, prompts):
    """A greedy cycle over three running rows: one packed target forward (every row's token through every layer
    once) and one host read for the batch."""
    engine = BatchEngine(runner, lambda: build_drafter("autoregressive", runner), 3)
    gens = [(e, e.start(p, DecodeConfig(max_new_tokens=8))) for e, p in zip(engine.slots, prompts[:3], strict=True)]
    runner.counters.reset()
    reads = []
    original = torch.Tensor.tolist

    def counted(self):
        reads.append(self.shape)
        return original(self)

    torch.Tensor.tolist = counted
    try:
        engine.step(gens)
    finally:
        torch.Tensor.tolist = original
    assert runner.counters.layer_tokens == [3] * L
    assert len(reads) == 1


def test_bad_batches_are_one_line_errors(runner, prompts, monkeypatch):
    make = lambda: build_drafter("autoregressive", runner)  # noqa: E731
    for size in (0, -2, 1.5, True):
        with pytest.raises(UserError, match="batch size"):
            BatchEngine(runner, make, size)
    engine = BatchEngine(runner, make, 4)
    with pytest.raises(UserError, match="no prompts"):
        engine.generate([])
    with pytest.raises(UserError, match="empty"):
        engine.generate([prompts[0], []])
    monkeypatch.setattr(batch_module, "available_bytes", lambda device: 1024)
    with pytest.raises(UserError, match=r"KV caches need .* GiB \(4 rows"):
        engine.generate(prompts, DecodeConfig(max_new_tokens=8))


def test_the_python_api_decodes_a_list_of_prompts(tiny_model_dir):
    from infer import load_model

    model = load_model(tiny_model_dir, device="cpu")
    texts = ["a", "def add(a, b): return a + b", "xy"]
    config = DecodeConfig(max_new_tokens=8)
    batched = model.generate(texts, "early_exit", config, batch_size=2, exit_layer=2, num_draft=3)
    assert [r.text for r in batched] == [model.generate(t, "autoregressive", config).text for t in texts]
    with pytest.raises(UserError, match="batch_size needs a list"):
        model.generate("a", config=config, batch_size=2)


def test_the_default_model_batched_equals_alone(default_model_path):
    from infer import load_model

    model = load_model(default_model_path, device="cpu", dtype="fp32")
    texts = ["def fibonacci(n):", "The capital of France is", "Write a haiku about a cat sitting in the sun."]
    config = DecodeConfig(max_new_tokens=8)
    alone_ = [model.generate(t, "autoregressive", config).tokens for t in texts]
    for drafter, options in [("autoregressive", {}), ("early_exit", {"exit_layer": 24, "num_draft": 3})]:
        batched = model.generate(texts, drafter, config, batch_size=2, **options)
        assert [r.tokens for r in batched] == alone_, drafter


class AlternatingGate(BatchGate):
    """A batch gate that takes plain steps for every row on every other cycle, whatever it measures."""

    def __init__(self):
        super().__init__()
        self.cycles = 0

    def drafts(self, rows: int) -> bool:
        self.cycles += 1
        return self.cycles % 2 == 0


@pytest.mark.parametrize("case", [*CASES, *ADAPTER_CASES])
def test_plain_cycles_chosen_by_the_batch_keep_every_row_exact(model, runner, prompts, eos, case, tmp_path):
    """Every drafter takes the batch's plain steps (``Drafter.skip``) and drafts again after them, an adapter's own
    caches catching up: every row still equals plain decoding alone."""
    with_adapter = {"adapter": str(adapter_file(model, tmp_path / "a.safetensors")), "k": 3}
    name, options = ("early_exit", with_adapter | ADAPTER_CASES[case]) if case in ADAPTER_CASES else CASES[case]
    config = DecodeConfig(max_new_tokens=16)
    with BatchEngine(runner, lambda: build_drafter(name, runner, options), 3, eos) as engine:
        engine.gate = AlternatingGate()
        results = engine.generate(prompts, config)
    for prompt, result in zip(prompts, results, strict=True):
        assert (result.tokens, result.finish_reason) == alone(runner, prompt, config, eos), (case, len(prompt))
    assert engine.gate.cycles > 0
    if name != PLAIN:
        assert sum(r.stats.drafted for r in results) > 0


ADAPTIVE = {case: (name, options | {"adaptive": True, "remember": "on"})
            for case, (name, options) in example_cases(ExampleModel(L), main_only=True).items()
            if "adaptive" in {f.name for f in dataclasses.fields(drafter_class(name).Config)}}
"""Every registered drafter with a fallback gate of its own (an ``adaptive`` option), at its main example."""


@pytest.mark.parametrize("case", sorted(ADAPTIVE))
def test_adaptive_drafters_hand_their_gates_to_the_batch(runner, prompts, case, tmp_path, monkeypatch):
    """With adaptive drafters, a batch of several rows decides plain steps once for every row, per number of running
    rows, from the batch's cycles; the rows' own gates stop choosing and save nothing, the batch's keeps its own
    memory beside theirs (the next batch starts from it; remember=off: nothing kept); one row keeps its own gate."""
    name, options = ADAPTIVE[case]
    monkeypatch.setenv("LAYERSKIP_CACHE", str(tmp_path))
    config = DecodeConfig(max_new_tokens=24)
    with BatchEngine(runner, lambda: build_drafter(name, runner, options), 3) as engine:
        assert engine.gate is not None
        assert all(not e.drafter.gate.enabled for e in engine.slots)
        results = engine.generate(prompts, config)
        engine.generate(prompts[:2], config)  # slots take fresh drafters: they hand their gates over too
        assert all(not e.drafter.gate.enabled for e in engine.slots)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.tokens == alone(runner, prompt, config)[0]
    summary = engine.gate.summary()
    assert 3 in summary and summary[3]["plain_cycles"] >= PROBE["plain"]
    saved = list(tmp_path.rglob("*.json"))  # what the batch's gate decided is never saved as a drafter's memory
    assert [p.name.endswith("-batch.json") for p in saved] == [True]
    with BatchEngine(runner, lambda: build_drafter(name, runner, options), 3) as again:
        assert again.gate.start_state == f"warm from {saved[0]}" and 3 in again.gate.choices
        assert not again.gate.choices[3].probing
    off = options | {"remember": "off"}
    saved[0].unlink()
    with BatchEngine(runner, lambda: build_drafter(name, runner, off), 3) as cold:
        cold.generate(prompts[:2], config)
        assert cold.gate.start_state == "cold"
    assert not list(tmp_path.rglob("*.json"))
    with BatchEngine(runner, lambda: build_drafter(name, runner, options), 1) as one:
        assert one.gate is None and one.slots[0].drafter.gate.enabled


class Recorder(CycleObserver):
    def __init__(self):
        self.made, self.before, self.after = [], [], []

    def begin(self, rows):
        self.before.append([len(gen.tokens) for _, gen in rows])

    def advanced(self, rows, outcomes):
        self.made.append([len(o.tokens) for o in outcomes])
        self.after.append([len(gen.tokens) for _, gen in rows])


def test_the_batch_gate_weighs_the_slowest_row_when_no_prompt_waits(runner, prompts):
    """While prompts wait for a slot the gate counts every row's tokens; once none waits, B times the advance of the
    row that has advanced least (the batch ends with its slowest row), and the gate's horizon is the tokens the slowest
    row has left. The first cycle after each prefill is marked cold (left out of the verification line)."""
    recorded, horizons, colds = [], [], []

    class Listening(BatchGate):
        def record(self, rows, tokens, seconds, drafted, detail=None):
            recorded.append(tokens)
            horizons.append(self.horizon)
            colds.append(detail.cold)
            super().record(rows, tokens, seconds, drafted, detail)

    config = DecodeConfig(max_new_tokens=12)
    for n in (3, 6):  # no queue; a queue of three at first
        recorded.clear(), horizons.clear(), colds.clear()
        with BatchEngine(runner, lambda: build_drafter("early_exit", runner, {"E": 2, "k": 4}), 3) as engine:
            engine.gate, seen = Listening(), Recorder()
            engine.observers.append(seen)
            engine.generate(prompts[:n], config)
        closed = [len(b) * (min(a) - min(b)) for b, a in zip(seen.before, seen.after, strict=True)]
        assert len(recorded) == len(seen.made) and any(len(set(m)) > 1 for m in seen.made)
        assert colds[0] and colds.count(True) <= n and not colds[1]
        if n == 3:
            assert recorded == closed
            assert horizons == [12 - min(b) for b in seen.before]  # every row asked for 12 tokens
        else:
            assert recorded[0] == sum(seen.made[0]) and recorded[-1] == closed[-1]
            assert horizons[0] is None and horizons[-1] == 12 - min(seen.before[-1])
            assert any(r == sum(m) != c for r, m, c in zip(recorded, seen.made, closed, strict=True))


class Capped(BatchGate):
    """A gate that drafts every cycle, at most ``cap`` tokens a row."""

    def __init__(self, cap):
        super().__init__()
        self.fixed = cap

    def drafts(self, rows):
        return True

    def cap(self, rows):
        return self.fixed


@pytest.mark.parametrize("cap", [1, 2])
@pytest.mark.parametrize("case", [*CASES, *ADAPTER_CASES])
def test_the_gates_cap_bounds_every_drafters_draft_and_output_stays_exact(model, runner, prompts, case, cap,
                                                                         tmp_path):
    """The batch's gate caps each row's draft at k tokens (``DecodeState.draft_cap``): every registered drafter's
    chains and trees hold at most k, and every row still equals plain decoding alone."""
    with_adapter = {"adapter": str(adapter_file(model, tmp_path / "a.safetensors")), "k": 3}
    name, options = ("early_exit", with_adapter | ADAPTER_CASES[case]) if case in ADAPTER_CASES else CASES[case]
    config, seen = DecodeConfig(max_new_tokens=16), Recorder()
    with BatchEngine(runner, lambda: build_drafter(name, runner, options), 3) as engine:
        engine.gate = Capped(cap)
        engine.observers.append(seen)
        drafted = []
        engine.observers.append(type("Sizes", (CycleObserver,), {
            "verified": lambda self, rows, outcomes: drafted.extend(o.drafted for o in outcomes)})())
        results = engine.generate(prompts, config)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.tokens == alone(runner, prompt, config)[0], case
    assert max(drafted) <= cap
    if name != PLAIN:
        assert max(drafted) >= 1, case  # the cap bounds the draft; it does not stop drafting
