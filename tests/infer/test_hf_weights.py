"""``hf_generate``'s runner follows the model's weights (issue 67, items 1 and 8): a callable reused after
``load_state_dict``, a change of the norms only, one optimizer step (for-loop, foreach and fused, which torch's version
counter does not see) or ``param.data = ...`` decodes exactly as plain ``generate`` of the changed model, on every
kernel path, and a drafter's own copies (a copied prefix, a draft head's rows) follow too. The runner is kept per
model, so a new callable per call (an inline ``hf_generate(...)``, the folder form) does not build it again."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time

import pytest
import torch

from infer import hf_generate, kernels
from infer.hf import runners
from infer.hf.decoding import FOLDER
from infer.model import runner as runner_module
from infer.model.runner import Runner
from layerskip_core.draft_vocab import DraftVocab
from tiny_models import make_model

PROMPT = torch.tensor([[5, 17, 99, 3, 44, 120, 7]])
NEW = 24
AVX2_RUN = "LAYERSKIP_HF_WEIGHTS_AVX2"
"""Set in the subprocess that reruns this file's kernel tests on the AVX2 path."""


@pytest.fixture(params=["kernel", "torch"])
def path(request, monkeypatch):
    """The runner's matmul path: the kernel's (AVX-512 panels on this CPU, AVX2 in the subprocess of
    ``test_the_avx2_path_follows_too``), or torch's (no kernel: every matrix shared with the model)."""
    if request.param == "torch":
        monkeypatch.setattr(runner_module, "load_kernel", lambda *args: None)
    elif os.environ.get(AVX2_RUN):
        assert kernels.load().path() == "avx2"
    return request.param


def plain(model) -> torch.Tensor:
    return model.generate(PROMPT, max_new_tokens=NEW, do_sample=False)


def sgd_step(model, **options) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, **options)
    model(PROMPT, labels=PROMPT).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def fused_adamw_step(model) -> None:
    """One fused AdamW step: it writes every parameter without bumping torch's version counter."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    model(PROMPT, labels=PROMPT).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def scale_norms(model) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.linspace(0.2, 3.0, p.numel()).reshape(p.shape))


def new_data(model) -> None:
    """``param.data = ...``: new storage under the same parameter object (no version bump)."""
    layer = model.model.layers[1].mlp.down_proj
    layer.weight.data = torch.randn_like(layer.weight) * 0.2


CHANGES = {
    "load_state_dict": lambda model: model.load_state_dict(make_model("llama", seed=11).state_dict()),
    "norms only": scale_norms,
    "sgd step": sgd_step,
    "sgd step, foreach": lambda model: sgd_step(model, foreach=True),
    "fused adamw step": fused_adamw_step,
    "param.data =": new_data,
}


def test_a_reused_callable_decodes_the_changed_weights(path):
    """After each change (to a model the callable has decoded with) the reused callable's greedy output equals plain
    ``generate`` of the changed model; the change did change that output, so a stale runner would be caught."""
    custom = hf_generate("early_exit", exit_layer=2, num_draft=3)
    for name, change in CHANGES.items():
        model = make_model("llama", seed=3)
        before = plain(model)
        assert torch.equal(model.generate(PROMPT, custom_generate=custom, max_new_tokens=NEW), before), name
        change(model)
        after = plain(model)
        assert not torch.equal(after, before), f"{name} left the output as it was: the test would not see staleness"
        assert torch.equal(model.generate(PROMPT, custom_generate=custom, max_new_tokens=NEW), after), name


def test_a_drafters_copies_follow_the_weights(path):
    """Early exit at the full depth over a copied prefix and a draft head of every token drafts exactly what the
    model decodes, so every draft is accepted while the copies follow the weights; a copy kept from the old
    weights would draft the old model's tokens."""
    vocab = DraftVocab(ids=tuple(range(320)), model={"vocab_size": 320})  # every token of the tiny models
    custom = hf_generate("early_exit", exit_layer=4, num_draft=4, prefix="copy", draft_dtype="model",
                         draft_vocab=vocab)
    for name, change in CHANGES.items():
        model = make_model("llama", seed=3)
        model.generate(PROMPT, custom_generate=custom, max_new_tokens=NEW)
        change(model)
        out = model.generate(PROMPT, custom_generate=custom, max_new_tokens=NEW, return_dict_in_generate=True)
        stats = out.stats[0]
        assert torch.equal(out.sequences, plain(model)), name
        assert stats.drafted > 0 and stats.accepted == stats.drafted, (name, stats.accepted, stats.drafted)


def test_the_avx2_path_follows_too():
    """The kernel tests above on the AVX2 path (what CPUs without AVX-512 run: plain matrices in the arena, shared
    with the model), forced on this CPU in a fresh process."""
    if kernels.load() is None:
        pytest.skip("no small-matmul kernel on this machine")
    if os.environ.get(AVX2_RUN):
        pytest.skip("already on the AVX2 path")
    tests_dir = os.path.dirname(os.path.dirname(__file__))
    root = os.path.dirname(tests_dir)
    env = dict(os.environ, LAYERSKIP_KERNEL_ISA="avx2", **{AVX2_RUN: "1"},
               PYTHONPATH=os.pathsep.join([root, tests_dir, *sys.path]))
    tests = [f"{__file__}::test_a_reused_callable_decodes_the_changed_weights[kernel]",
             f"{__file__}::test_a_drafters_copies_follow_the_weights[kernel]"]
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *tests],
                         env=env, capture_output=True, text=True, timeout=600, cwd=root)
    assert out.returncode == 0 and "2 passed" in out.stdout, out.stdout[-3000:] + out.stderr[-2000:]


@pytest.fixture
def builds(monkeypatch) -> list:
    """Every ``Runner.from_model`` call (the model it was built for)."""
    calls = []
    build = Runner.from_model.__func__

    def counted(cls, model, **options):
        calls.append(model)
        return build(cls, model, **options)

    monkeypatch.setattr(Runner, "from_model", classmethod(counted))
    return calls


def test_the_runner_is_built_once_per_model(builds):
    """Two callables, an inline ``hf_generate(...)`` per call and the folder form share one runner per model and
    settings; a weight change rebuilds it once; another executor or model gets its own."""
    model, other = make_model("llama", seed=3), make_model("llama", seed=4)
    ref = plain(model)
    for _ in range(2):
        assert torch.equal(model.generate(PROMPT, custom_generate=hf_generate("early_exit", exit_layer=2),
                                          max_new_tokens=NEW), ref)
        assert torch.equal(model.generate(PROMPT, custom_generate=str(FOLDER), trust_remote_code=True,
                                          drafter="early_exit", exit_layer=2, max_new_tokens=NEW), ref)
    assert builds == [model]
    first = hf_generate("swift").runner_for(model)
    assert hf_generate("early_exit", exit_layer=3).runner_for(model) is first and len(builds) == 1
    sgd_step(model)
    assert hf_generate().runner_for(model) is not first and builds == [model, model]
    assert hf_generate(executor="static").runner_for(model) is not hf_generate().runner_for(model)
    hf_generate().runner_for(other)
    assert builds == [model, model, model, other]


def test_shared_weights_after_a_rebuild(monkeypatch):
    """Where the runner keeps plain matrices (torch's path here) the model's q/k/v, gate/up, o and down parameters are
    views of the rebuilt runner's matrices, holding the loaded values, and the model still decodes as before."""
    monkeypatch.setattr(runner_module, "load_kernel", lambda *args: None)
    model, source = make_model("llama", seed=3), make_model("llama", seed=11)
    custom = hf_generate()
    old = custom.runner_for(model)
    model.load_state_dict(source.state_dict())
    ref = plain(model)
    assert torch.equal(model.generate(PROMPT, custom_generate=custom, max_new_tokens=NEW), ref)
    new = custom.runner_for(model)
    assert new is not old
    for i, layer in enumerate(model.model.layers):
        for module, fused in ((layer.self_attn.q_proj, new.layers[i].qkv), (layer.mlp.up_proj, new.layers[i].gate_up),
                              (layer.self_attn.o_proj, new.layers[i].o), (layer.mlp.down_proj, new.layers[i].down)):
            assert module.weight.untyped_storage().data_ptr() == fused.plain.untyped_storage().data_ptr()
    for name, p in model.named_parameters():
        assert torch.equal(p, source.state_dict()[name]), name
    assert torch.equal(plain(model), ref)


def test_unchanged_weights_keep_the_runner(builds):
    """Decoding, plain ``generate``, ``eval()``, a forward under no_grad and ``requires_grad_`` change no weight."""
    model = make_model("llama", seed=3)
    custom = hf_generate()
    runner = custom.runner_for(model)
    plain(model)
    model.eval().requires_grad_(False)
    with torch.no_grad():
        model(PROMPT)
    model.generate(PROMPT, custom_generate=custom, max_new_tokens=4)
    assert custom.runner_for(model) is runner and builds == [model]


def test_a_nan_weight_is_not_a_change_on_every_call():
    """Sampled values are compared bit for bit: a NaN among them (which never equals itself as a float) is the same
    weight on the next call, so the stamp still holds (a runner is not built on NaN weights at all: issue 67,
    item 11)."""
    model = make_model("llama", seed=3)
    with torch.no_grad():
        model.model.norm.weight.view(-1)[::2] = float("nan")  # every other value: some are sampled
    stamp = runners.WeightStamp.of(model)
    assert stamp.holds(model) and stamp.holds(model)


def test_release_frees_the_kept_runner(builds):
    model = make_model("llama", seed=3)
    runner = hf_generate().runner_for(model)
    runners.release(model)
    assert hf_generate().runner_for(model) is not runner and builds == [model, model]


def test_a_models_runners_go_with_it():
    """The cache holds its models weakly: a model no longer used frees its runner (and the runner's copies)."""
    model = make_model("llama", seed=3)
    hf_generate().runner_for(model)
    assert model in runners.RUNNERS.kept
    kept = len(runners.RUNNERS.kept)
    del model
    gc.collect()
    assert len(runners.RUNNERS.kept) == kept - 1


@pytest.mark.real_model
def test_the_check_is_cheap_on_the_default_model(default_model_path):
    """The check before every call (each parameter's identity, version, storage, shape and a sample of its values)
    costs well under the time of one decoded token: measured ~0.7 ms for the default model's 272 parameters
    (1 thread, on a loaded 2-core machine)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32)
    stamp = runners.WeightStamp.of(model)
    assert stamp.holds(model)
    times = []
    for _ in range(20):
        start = time.perf_counter()
        stamp.holds(model)
        times.append(time.perf_counter() - start)
    assert sorted(times)[10] < 0.005  # 5 ms: a loose bound for a shared machine
