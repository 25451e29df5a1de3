"""A runner built ``from_model`` holds each unfused matrix (o_proj, down_proj) once: the model's parameters point at the
runner's copies (in the kernel's arena where the kernel runs), with the same values, and neither the model's nor the
runner's outputs change."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from infer.kernels import arena
from infer.model.runner import Runner
from infer.model.weights import UNFUSED, share_unfused
from tiny_models import make_model


def _unfused(model, i: int) -> list[torch.nn.Parameter]:
    layer = model.model.layers[i]
    return [layer.get_parameter(name) for name in UNFUSED.values()]


def test_from_model_points_o_and_down_at_the_runner_copies():
    """Where the runner keeps its matrices plain (torch's matmul here; the AVX2 kernel's path too), the model's o_proj
    and down_proj weights become the runner's: one copy each."""
    model = make_model("llama", seed=11)
    twin = copy.deepcopy(model)  # untouched: the reference for values and outputs
    ids = torch.arange(3, 30)
    with torch.no_grad():
        before = model(ids[None]).logits
    runner = Runner.from_model(model, kernel="torch")
    for i, layer in enumerate(runner.layers):
        mine = (layer.o.weight, layer.down.weight)
        for p, w, ref in zip(_unfused(model, i), mine, _unfused(twin, i), strict=True):
            assert p.data_ptr() == w.data_ptr()  # one copy
            assert torch.equal(p, ref)
            assert isinstance(p, torch.nn.Parameter) and p.requires_grad == ref.requires_grad
    with torch.no_grad():
        assert torch.equal(model(ids[None]).logits, before)  # the model computes what it did
    other = Runner.from_model(copy.deepcopy(twin), kernel="torch")  # (a runner whose model keeps nothing of ours)
    assert torch.equal(runner.forward(runner.new_cache(64), ids), other.forward(other.new_cache(64), ids))


def test_share_unfused_frees_each_matrix_once_and_skips_other_dtypes():
    model = make_model("llama", seed=12)
    runner = Runner.from_model(model, kernel="torch")
    assert share_unfused(model, runner.layers) == 0  # already shared: nothing more to free
    fresh = make_model("llama", seed=12)
    expected = sum(p.numel() * p.element_size() for i in range(len(runner.layers)) for p in _unfused(fresh, i))
    assert share_unfused(fresh, runner.layers) == expected  # a same-valued model of its own: every matrix re-pointed
    bf16 = Runner.from_model(make_model("llama", seed=12), dtype=torch.bfloat16, kernel="torch")
    kept = make_model("llama", seed=12)  # fp32 parameters, bf16 runner: each keeps its own
    ptrs = [p.data_ptr() for i in range(len(bf16.layers)) for p in _unfused(kept, i)]
    assert share_unfused(kept, bf16.layers) == 0
    assert ptrs == [p.data_ptr() for i in range(len(bf16.layers)) for p in _unfused(kept, i)]


def test_a_packed_runner_leaves_the_model_its_weights():
    """On the kernel's AVX-512 path the runner's layer matrices are packed panels only: nothing of the model is
    shared or changed, and the runner computes what a runner on torch's matmul computes, to rounding."""
    model = make_model("llama", seed=14)
    runner = Runner.from_model(model)
    if runner.layers[0].o.panels is None:
        pytest.skip("the kernel's AVX-512 path is not this CPU's (no packed panels)")
    twin = copy.deepcopy(model)
    for i, layer in enumerate(runner.layers):
        assert all(m.plain is None for m in (layer.qkv, layer.o, layer.gate_up, layer.down))
        for p, ref in zip(_unfused(model, i), _unfused(twin, i), strict=True):
            assert torch.equal(p, ref)
    assert share_unfused(model, runner.layers) == 0
    ids = torch.arange(3, 30)
    plain = Runner.from_model(twin, kernel="torch")
    torch.testing.assert_close(runner.forward(runner.new_cache(64), ids), plain.forward(plain.new_cache(64), ids),
                               atol=1e-4, rtol=1e-5)


def test_arena_slabs_start_on_huge_page_boundaries():
    """A CPU slab's first matrix sits on a 2 MB boundary (its slab advised to transparent huge pages on Linux; where
    the advice is refused the slab still works, in small pages)."""
    arena.release()
    try:
        first = arena.place(torch.randn(64, 64))
        assert first.data_ptr() % arena.HUGE_PAGE == 0
        second = arena.place(torch.randn(8, 64))
        assert second.data_ptr() - first.data_ptr() == 64 * 64 * 4  # back to back after it
    finally:
        arena.release()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="file mappings are read from /proc/self/maps")
def test_a_large_matrix_in_a_file_mapping_gets_its_own_copy(tmp_path):
    """A matrix over MAX_BYTES read by mmap from a checkpoint (an LM head tied to the embedding) is copied to a buffer
    of its own on a 2 MB boundary, with the same values; an anonymous one stays where it is."""
    rows = arena.MAX_BYTES // (64 * 4) + 8  # just over MAX_BYTES of fp32
    save_file({"w": torch.randn(rows, 64)}, tmp_path / "w.safetensors")
    mapped = load_file(tmp_path / "w.safetensors")["w"]
    assert arena.file_backed(mapped.data_ptr())
    placed = arena.place(mapped)
    assert placed.data_ptr() != mapped.data_ptr() and placed.data_ptr() % arena.HUGE_PAGE == 0
    assert not arena.file_backed(placed.data_ptr()) and torch.equal(placed, mapped)
    anonymous = torch.randn(rows, 64)
    assert not arena.file_backed(anonymous.data_ptr())
    assert arena.place(anonymous).data_ptr() == anonymous.data_ptr()


def test_a_tied_embedding_reads_the_lm_head_matrix(tmp_path):
    """With tied embeddings the runner holds one matrix for both (the LM head's: packed panels on the kernel's AVX-512
    path, whose rows the embedding gathers; the matrix itself, wherever the arena put it, elsewhere), and no tensor of
    the checkpoint's own: its file can be unmapped."""
    model = make_model("llama", seed=13, tie_word_embeddings=True)
    model.save_pretrained(tmp_path)
    runner = Runner.from_pretrained(tmp_path)
    assert runner.embed_w is None
    ids = torch.tensor([0, 47, 48, 95, 5, model.config.vocab_size - 1])  # on and off the 48-row panel groups
    assert torch.equal(runner.embed(ids), model.get_input_embeddings().weight[ids].detach())
    head = [t for t in (runner.lm_head.plain, runner.lm_head.panels) if t is not None]
    tensors = [runner.final_norm, *head, *(t for layer in runner.layers for t in vars(layer).values()
                                           if isinstance(t, torch.Tensor))]
    assert not any(arena.file_backed(t.data_ptr()) for t in tensors)
