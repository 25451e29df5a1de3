"""Issue 47's families on the runner: Qwen3, Gemma 3 text, SmolLM3, and real sliding windows (Mistral, Qwen2, Gemma 3's
local layers). Logits equal transformers' in fp32 on every executor, for contexts longer than the window."""

import pytest
import torch

from infer.model.program import ONCE, Program, Rows
from infer.model.runner import Runner
from layerskip_core.errors import UserError
from layerskip_core.models import SUPPORTED_MODEL_TYPES, ModelSpec
from tiny_models import FAMILY_KINDS, TINY_WINDOW, family_config, family_model

N = 3 * TINY_WINDOW  # tokens: the context runs well past the window
ATOL = 1e-4


@pytest.fixture(scope="module", params=FAMILY_KINDS)
def model(request):
    return family_model(request.param, seed=3)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, 320, (N,), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def ref(model, ids):
    with torch.no_grad():
        return model(ids[None]).logits[0]  # (N, V)


def test_prefill_and_one_token_steps_equal_transformers(model, ids, ref):
    runner = Runner.from_model(model)
    cache = runner.new_cache(256)
    torch.testing.assert_close(runner.forward(cache, ids), ref, atol=ATOL, rtol=0)
    cache.reset()  # a prefix shorter than the window, then token by token past it
    steps = [runner.forward(cache, ids[:20])] + [runner.forward(cache, ids[i:i + 1]) for i in range(20, N)]
    torch.testing.assert_close(torch.cat(steps), ref, atol=ATOL, rtol=0)
    cache.reset()  # a prefix longer than the window, then chunks of several tokens (verification's shape)
    chunks = [runner.forward(cache, ids[:100])] + [runner.forward(cache, ids[i:i + 5]) for i in range(100, N, 5)]
    torch.testing.assert_close(torch.cat(chunks), ref, atol=ATOL, rtol=0)


def test_static_executor_equals_transformers(model, ids, ref):
    """Static-shape forwards (capacity-wide masks, padded rows, one mask per group of layers with the same window)."""
    runner = Runner.from_model(model, executor="static")
    cache = runner.new_cache(256)
    L = runner.num_layers
    runner.run(Program(0, L), Rows.one(cache, runner.embed(ids[:90]), torch.arange(90), kind=ONCE))  # runs eagerly
    step = Program(0, L, logits=True)
    got = [runner.run(step, Rows.one(cache, runner.embed(ids[90:95]), list(range(90, 95)))).logits]
    got += [runner.run(step, Rows.one(cache, runner.embed(ids[i:i + 1]), [i])).logits for i in range(95, N)]
    assert runner.static.spans(cache)
    torch.testing.assert_close(torch.cat(got), ref[90:], atol=ATOL, rtol=0)


def test_tree_mask_verification_past_the_window(model, ids, ref):
    """A masked (tree-shaped) forward after a context longer than the window: each branch sees its own ancestors and
    the prefix within each layer's window, as if decoded alone."""
    for executor in ("eager", "static"):
        runner = Runner.from_model(model, executor=executor)
        cache = runner.new_cache(256)
        P = 2 * TINY_WINDOW
        runner.run(Program(0, runner.num_layers), Rows.one(cache, runner.embed(ids[:P]), torch.arange(P), kind=ONCE))
        # two branches after the prefix: [P] -> [P+1] and [P] -> other token at depth 1
        tokens = torch.stack([ids[P], ids[P + 1], ids[P + 2]])
        mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
        rows = Rows.one(cache, runner.embed(tokens), [P, P + 1, P + 1], mask)
        out = runner.run(Program(0, runner.num_layers, logits=True), rows).logits
        torch.testing.assert_close(out[:2], ref[P:P + 2], atol=ATOL, rtol=0)
        alone = torch.cat([ids[:P + 1], ids[P + 2:P + 3]])
        with torch.no_grad():
            want = model(alone[None]).logits[0, -1]
        torch.testing.assert_close(out[2], want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["mistral_window", "qwen2_window", "gemma3_text"])
def test_the_window_changes_the_logits(kind, ids):
    """The parity above is meaningful: past the window, full attention would give other logits."""
    windowed = family_model(kind, seed=3)
    wide = family_model(kind, seed=3, window=4 * N)
    with torch.no_grad():
        a, b = windowed(ids[None]).logits[0], wide(ids[None]).logits[0]
    torch.testing.assert_close(a[:TINY_WINDOW], b[:TINY_WINDOW], atol=ATOL, rtol=0)
    assert (a[TINY_WINDOW + 1:] - b[TINY_WINDOW + 1:]).abs().max() > 1e-2
    spec = Runner.from_model(windowed).spec
    assert spec.max_position_embeddings == windowed.config.max_position_embeddings  # no cap at the window
    assert TINY_WINDOW in spec.layer_windows


def test_family_specs_read_from_the_config():
    qwen2 = ModelSpec.from_config(family_config("qwen2_window", layers=6))
    assert qwen2.layer_windows == (None,) * 3 + (TINY_WINDOW,) * 3  # from max_window_layers on
    smol = ModelSpec.from_config(family_config("smollm3", layers=8))
    assert smol.layer_ropes == ("default", "default", "default", "none") * 2
    gemma = ModelSpec.from_config(family_config("gemma3_text", layers=6))
    assert gemma.layer_windows == (TINY_WINDOW, TINY_WINDOW, None) * 2
    assert gemma.family.norm_offset and gemma.family.activation == "gelu_tanh"
    assert gemma.attn_scale == pytest.approx(24 ** -0.5) and gemma.final_softcap == 30.0
    assert ModelSpec.from_config(family_config("qwen3")).head_dim == 24


def test_an_unsupported_model_type_is_refused_in_one_line():
    from transformers import GPT2Config

    with pytest.raises(UserError) as e:
        ModelSpec.from_config(GPT2Config())
    message = str(e.value)
    assert "\n" not in message and "gpt2" in message
    assert all(t in message for t in SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("kind", FAMILY_KINDS)
def test_sublayer_weight_counts_are_the_models_parameters(kind):
    """The cost model's per-layer weight counts (``ModelSpec.sublayer_weights``; ``infer.model.plan.weights_cost``) are
    the layer's parameters of each family (biases aside), its extra norms included."""
    from infer.model.plan import weights_cost

    model = family_model(kind, layers=2)
    spec = ModelSpec.from_config(model.config)
    mlp_norm = "pre_feedforward" if spec.family.sandwich_norms else "post_attention"

    def in_mlp(name: str) -> bool:
        return name.startswith(("mlp.", mlp_norm, "post_feedforward"))

    params = dict(model.model.layers[0].named_parameters())
    attn = sum(p.numel() for n, p in params.items() if not in_mlp(n) and not n.endswith("bias"))
    mlp = sum(p.numel() for n, p in params.items() if in_mlp(n))
    assert spec.sublayer_weights() == (attn, mlp)
    cost = weights_cost(spec, 4)
    assert cost.attn / cost.mlp == pytest.approx(attn / mlp)


def test_a_skipped_sublayer_with_a_post_norm_is_skipped_whole():
    """Self-SD's plans on Gemma 3: skipping an attention or MLP sublayer skips its post-norm too, as a model whose
    sublayer output is zero (the post-norm of zero is zero)."""
    from infer.model.plan import LayerPlan

    model, zeroed = family_model("gemma3_text", seed=4, layers=4), family_model("gemma3_text", seed=4, layers=4)
    with torch.no_grad():
        zeroed.model.layers[1].self_attn.o_proj.weight.zero_()
        zeroed.model.layers[2].mlp.down_proj.weight.zero_()
    ids = torch.arange(5, 85)
    runner = Runner.from_model(model)
    got = runner.forward(runner.new_cache(128), ids, plan=LayerPlan(4, skip_attn={1}, skip_mlp={2}))
    with torch.no_grad():
        want = zeroed(ids[None]).logits[0]
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["gemma3_text", "smollm3", "qwen3"])
def test_adapter_train_and_infer_forwards_agree(kind, tmp_path):
    """An exit adapter's training module (``train.adapter``: the model's norm class, the global RoPE) and its layer on
    the runner (``ModelSpec.adapter_layer``) compute the same logits on the new families (Gemma 3: softcapped)."""
    from infer.assets.adapter import ExitAdapter
    from train.adapter import AdapterLM
    from train.config import AdapterConfig
    from train.model import decoder_parts

    model = family_model(kind, seed=2, layers=4)
    lm = AdapterLM(model, AdapterConfig(enabled=True, exit_layer=2, mlp_size=24))
    with torch.no_grad():
        for p in lm.adapter.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
    lm.save(tmp_path / "a.safetensors", {"test": True})
    runner = Runner.from_model(model)
    adapter = ExitAdapter.load(tmp_path / "a.safetensors", runner)
    hidden = torch.randn(1, 7, runner.spec.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = lm.adapter_logits(hidden, decoder_parts(model).global_rope(hidden, torch.arange(7)[None]))[0]
    cache = adapter.new_cache(16)
    got = torch.cat([adapter.forward(cache, hidden[0, :3], 0, logits=True).logits] +
                    [adapter.forward(cache, hidden[0, i:i + 1], i, logits=True).logits for i in range(3, 7)])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
