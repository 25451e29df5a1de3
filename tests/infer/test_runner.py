"""Runner parity with transformers, plan semantics, cache rollback."""

import pytest
import torch

from infer.model.plan import LayerPlan
from infer.model.program import ONCE, Program, Rows
from infer.model.runner import Runner
from tiny_models import make_model


def hf_logits(model, ids):
    with torch.no_grad():
        return model(ids[None]).logits[0]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("tied", [False, True])
def test_parity_batched_and_incremental(kind, tied):
    model = make_model(kind, seed=3, tie_word_embeddings=tied)
    runner = Runner.from_model(model)
    ids = torch.randint(0, 320, (24,), generator=torch.Generator().manual_seed(0))
    ref = hf_logits(model, ids)
    cache = runner.new_cache(64)
    torch.testing.assert_close(runner.forward(cache, ids), ref, atol=1e-4, rtol=0)
    cache.reset()
    steps = [runner.forward(cache, ids[i:i + 1]) for i in range(len(ids))]
    torch.testing.assert_close(torch.cat(steps), ref, atol=1e-4, rtol=0)
    cache.reset()  # prefix as one chunk, then the rest token by token with the cache
    chunk = runner.forward(cache, ids[:10])
    rest = [runner.forward(cache, ids[i:i + 1]) for i in range(10, len(ids))]
    torch.testing.assert_close(torch.cat([chunk] + rest), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_static_executor_parity_with_transformers(kind):
    """The static-shape forwards (capacity-wide masked attention, padded rows) give transformers' logits."""
    model = make_model(kind, seed=3)
    runner = Runner.from_model(model, executor="static")
    ids = torch.randint(0, 320, (24,), generator=torch.Generator().manual_seed(0))
    ref = hf_logits(model, ids)
    cache = runner.new_cache(64)
    L = runner.num_layers
    runner.run(Program(0, L), Rows.one(cache, runner.embed(ids[:10]), torch.arange(10), kind=ONCE))  # runs eagerly
    step = Program(0, L, logits=True)
    got = [runner.run(step, Rows.one(cache, runner.embed(ids[10:15]), list(range(10, 15)))).logits]  # 8-row bucket
    got += [runner.run(step, Rows.one(cache, runner.embed(ids[i:i + 1]), [i])).logits for i in range(15, 24)]
    assert cache.lengths == [24] * L
    assert runner.static.spans(cache)  # the static executor ran them
    torch.testing.assert_close(torch.cat(got), ref[10:], atol=1e-4, rtol=0)


def test_skip_plan_equals_zeroed_sublayers():
    """Skipping a sublayer == a model whose residual branch for it is zero."""
    model = make_model("llama", seed=4)
    plan = LayerPlan(4, skip_attn={1}, skip_mlp={2, 3})
    zeroed = make_model("llama", seed=4)
    with torch.no_grad():
        zeroed.model.layers[1].self_attn.o_proj.weight.zero_()
        zeroed.model.layers[2].mlp.down_proj.weight.zero_()
        zeroed.model.layers[3].mlp.down_proj.weight.zero_()
    ids = torch.arange(5, 25)
    runner = Runner.from_model(model)
    got = runner.forward(runner.new_cache(32), ids, plan=plan)
    torch.testing.assert_close(got, hf_logits(zeroed, ids), atol=1e-4, rtol=0)


def test_early_exit_hidden_matches_hf_hidden_states():
    """Program(0, E)'s output is HF hidden_states[E] (the input of layer E)."""
    model = make_model("llama", seed=5)
    runner = Runner.from_model(model)
    ids = torch.arange(3, 15)
    with torch.no_grad():
        hs = model(ids[None], output_hidden_states=True).hidden_states
    for E in range(1, 4):
        rows = Rows.one(runner.new_cache(32), runner.embed(ids), torch.arange(len(ids)), kind=ONCE)
        h = runner.run(Program(0, E), rows).hidden
        torch.testing.assert_close(h, hs[E][0], atol=1e-5, rtol=0)


def test_per_layer_lengths_and_rollback(tiny_llama):
    runner = Runner.from_model(tiny_llama)
    cache = runner.new_cache(32)
    ids = torch.arange(1, 9)
    runner.forward(cache, ids)
    runner.run(Program(0, 2), Rows.one(cache, runner.embed(ids[:2]), torch.tensor([8, 9]), kind=ONCE))
    assert cache.lengths == [10, 10, 8, 8]
    cache.rollback(8)
    assert cache.lengths == [8] * 4
    # after rollback the next token's logits equal a fresh full forward
    ref = hf_logits(tiny_llama, torch.arange(1, 10))[-1]
    torch.testing.assert_close(runner.forward(cache, torch.tensor([9]))[0], ref, atol=1e-4, rtol=0)


def test_mask_over_appended_positions(tiny_llama):
    """A (T, W) mask hides slots: window tokens that cannot see a stale prefix equal a fresh run."""
    runner = Runner.from_model(tiny_llama)
    ids = torch.arange(2, 14)
    cache = runner.new_cache(64)
    runner.forward(cache, ids)  # 12 slots
    # re-run the last 4 tokens at their own positions, appended after slot 12, hiding slots 8..11
    window = ids[8:]
    mask = torch.cat([torch.zeros(4, 4, dtype=torch.bool), torch.ones(4, 4, dtype=torch.bool).tril()], dim=1)
    got = runner.forward(cache, window, positions=torch.arange(8, 12), mask=mask)
    ref = hf_logits(tiny_llama, ids)[8:]
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


def test_unsupported_model_type_is_refused():
    from transformers import GPT2Config

    from layerskip_core.errors import UserError

    with pytest.raises(UserError, match="not supported"):
        Runner(GPT2Config(), {})


def test_the_runner_constructors_take_the_same_options_by_keyword_only():
    """One order, keyword-only: a positional dtype (once read as the kernel by one of them) is refused."""
    import inspect

    def options(fn):
        return [(p.name, p.kind) for p in list(inspect.signature(fn).parameters.values())[1:]]

    keyword = inspect.Parameter.KEYWORD_ONLY
    want = [(name, keyword) for name in ("dtype", "device", "kernel", "executor", "compile")]
    assert options(Runner.from_pretrained) == options(Runner.from_model) == want
    assert options(Runner.__init__)[2:] == want  # after self's config and state
    with pytest.raises(TypeError):
        Runner.from_model(make_model("llama", seed=0, layers=2), torch.float32)


def test_plan_exact_prefix():
    assert LayerPlan(6).exact_prefix == 6
    assert LayerPlan(6, skip_attn={3}).exact_prefix == 3
    assert LayerPlan(6, skip_mlp={2}).exact_prefix == 2  # layer 2's MLP is skipped: its output is not exact
    assert LayerPlan(6, skip_attn={4}, skip_mlp={1}).exact_prefix == 1
    plan = LayerPlan(6, skip_attn={1, 4}, skip_mlp={0})
    assert LayerPlan.from_dict(plan.to_dict()) == plan
    with pytest.raises(ValueError):
        LayerPlan(4, skip_attn={4})


@pytest.mark.real_model
def test_parity_on_default_model(default_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_path)
    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()
    ids = torch.tensor(tok("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")["input_ids"])
    runner = Runner.from_pretrained(default_model_path)
    ref = hf_logits(model, ids)
    cache = runner.new_cache(64)
    # rtol: the AVX-512 kernel sums each output's K products in one fp32 chain (HF's BLAS in blocks): ~5e-6 apart
    torch.testing.assert_close(runner.forward(cache, ids), ref, atol=1e-4, rtol=1e-5)
    cache.rollback(len(ids) - 3)
    steps = [runner.forward(cache, ids[i:i + 1]) for i in range(len(ids) - 3, len(ids))]
    torch.testing.assert_close(torch.cat(steps), ref[-3:], atol=1e-4, rtol=1e-5)


def _kernel():
    from infer import kernels

    module = kernels.load()
    if module is None:
        pytest.skip("small-matmul kernel unavailable on this machine")
    return module


def test_small_matmul_kernel_matches_torch_and_is_batch_invariant():
    kernel = _kernel()
    gen = torch.Generator().manual_seed(0)
    for T, N, K in [(1, 37, 64), (3, 64, 128), (5, 13, 576), (9, 100, 1536), (32, 8, 8)]:
        x = torch.randn(T, K, generator=gen)
        w = torch.randn(N, K, generator=gen)
        y = kernel.small_matmul(x, w)
        torch.testing.assert_close(y, x @ w.t(), atol=2e-4, rtol=1e-5)
        for t in range(T):  # each row is bitwise what a single-token call computes
            assert torch.equal(kernel.small_matmul(x[t:t + 1], w)[0], y[t])


def test_runner_kernel_and_torch_paths_agree():
    _kernel()
    model = make_model("qwen2", seed=6)
    ids = torch.arange(7, 40)
    outs = []
    for kernel in ("auto", "torch"):
        runner = Runner.from_model(model, kernel=kernel)
        outs.append(runner.forward(runner.new_cache(64), ids))
    assert outs[0].shape == outs[1].shape
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=0)
    torch.testing.assert_close(outs[0], hf_logits(model, ids), atol=1e-4, rtol=0)


def test_plan_forward_drafts_exactly_the_plan(tiny_llama):
    """The draft step runs the plan itself (an MLP skipped in the first skipping layer included)."""
    from infer.drafters.chain import PlanForward

    runner = Runner.from_model(tiny_llama)
    token = torch.tensor([17])
    for plan in (LayerPlan(4, skip_mlp={1}), LayerPlan(4, skip_attn={2}, skip_mlp={0, 3})):
        forward = PlanForward(runner, plan)
        exact, logits = forward(runner.new_cache(8), token, 0)
        torch.testing.assert_close(logits, runner.forward(runner.new_cache(8), token, plan=plan), atol=1e-5, rtol=0)
        rows = Rows.one(runner.new_cache(8), runner.embed(token), torch.tensor([0]), kind=ONCE)
        ref = runner.run(Program(0, plan.exact_prefix), rows).hidden
        torch.testing.assert_close(exact, ref, atol=0, rtol=0)


def test_prefill_takes_the_causal_kernel_and_masked_calls_fold_groups():
    """Prefill from an empty cache passes no mask (is_causal: the flash kernel's path); a masked call (a tree, a
    chunk after a prefix) never combines a mask with enable_gqa (the math kernel's path); results agree."""
    from torch.overrides import TorchFunctionMode

    calls = []

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.nn.functional.scaled_dot_product_attention:
                calls.append((kwargs.get("attn_mask") is not None, kwargs.get("is_causal", False),
                              kwargs.get("enable_gqa", False)))
            return func(*args, **kwargs)

    model = make_model("llama", seed=3)
    runner = Runner.from_model(model, kernel="torch")  # SDPA's route (the CPU kernel attends rows itself)
    assert runner.spec.num_heads != runner.spec.num_kv_heads
    ids = torch.randint(0, 320, (24,), generator=torch.Generator().manual_seed(0))
    cache = runner.new_cache(64)
    with Spy():
        logits = runner.forward(cache, ids[:10])
    assert calls and all(not masked and causal for masked, causal, _ in calls)
    calls.clear()
    with Spy():
        logits = torch.cat([logits, runner.forward(cache, ids[10:])])  # 14 rows after 10: a causal mask
    assert calls and all(masked and not gqa for masked, _, gqa in calls)
    torch.testing.assert_close(logits, hf_logits(model, ids), atol=1e-4, rtol=0)
