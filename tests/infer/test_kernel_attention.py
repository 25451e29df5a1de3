"""The kernel's row attention (``attend_rows``, AVX-512 path): close to SDPA, and batch invariant: each query row of a
T-row call (any mask, gaps included) is bitwise what the row computes alone over its visible keys, whatever T and
however the rows are split; a packed forward of several sequences equals each sequence's own forward bitwise (fp32 and
bf16). The one-token call off the kernel (query groups folded into rows) against SDPA with ``enable_gqa``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from infer import kernels
from infer.model.attention import attend, row_kernel
from infer.model.program import BULK, Program, Rows, Segment
from infer.model.runner import Runner
from tiny_models import FAMILY_KINDS, family_model, make_model

DTYPES = [torch.float32, torch.bfloat16]


def _rows(dtype: torch.dtype):
    module = kernels.load()
    rows = row_kernel(module, torch.empty(0, dtype=dtype))
    if rows is None:
        pytest.skip(f"no row attention for {dtype} here (it runs on the AVX-512 path; bf16 with AVX512_BF16)")
    return rows


def _qkv(gen, Hq: int, Hkv: int, T: int, S: int, D: int, dtype: torch.dtype):
    """q (Hq, T, D) as a transposed view and k, v (Hkv, S, D) as slices of a larger cache, as the runner has them."""
    q = torch.randn(T, Hq, D, generator=gen).to(dtype).transpose(0, 1)  # (Hq, T, D), strided
    cache = torch.randn(2, Hkv, S + 7, D, generator=gen).to(dtype)  # (2, Hkv, capacity, D)
    return q, cache[0, :, :S], cache[1, :, :S]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Hq, Hkv, D", [(9, 3, 64), (4, 2, 24), (4, 4, 8), (6, 1, 40), (4, 2, 7), (2, 1, 200)])
def test_close_to_sdpa(dtype, Hq, Hkv, D):
    rows = _rows(dtype)  # any head dim on either path (AVX2: its last D % 8 dims masked)
    gen = torch.Generator().manual_seed(Hq * D)
    q, k, v = _qkv(gen, Hq, Hkv, 5, 37, D, dtype)
    mask = torch.ones(5, 37, dtype=torch.bool).tril(32)  # causal rows after 32 cached slots
    mask[3, 10:20] = False  # a gap (a token tree's other branch)
    out = rows.attend_rows(q, k, v, mask, 0.3)
    assert out.shape == (Hq, 5, D) and out.dtype == dtype
    ref = F.scaled_dot_product_attention(q.float()[None], k.float()[None], v.float()[None], attn_mask=mask, scale=0.3,
                                         enable_gqa=Hq != Hkv)[0]
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(rows.attend_rows(q, k, v, None, 0.3).float(),  # all visible
                               F.scaled_dot_product_attention(q.float()[None], k.float()[None], v.float()[None],
                                                              scale=0.3, enable_gqa=Hq != Hkv)[0], atol=tol, rtol=tol)


@pytest.mark.parametrize("D", [64, 34])
@pytest.mark.parametrize("dtype", DTYPES)
def test_each_row_is_what_it_computes_alone(dtype, D):
    """Row t of a T-row call with a mask = one row over just its visible keys (gaps closed up), bitwise; a head dim
    off the 8- and 16-lane chunks too."""
    rows = _rows(dtype)
    gen = torch.Generator().manual_seed(1)
    S, T = 45, 7
    q, k, v = _qkv(gen, 9, 3, T, S, D, dtype)
    mask = torch.rand(T, S, generator=gen) < 0.7
    mask[:, 0] = True
    out = rows.attend_rows(q, k, v, mask, 0.125)
    for t in range(T):
        keep = mask[t].nonzero()[:, 0]  # (n,)
        alone = rows.attend_rows(q[:, t:t + 1], k[:, keep], v[:, keep], None, 0.125)
        assert torch.equal(alone[:, 0], out[:, t]), t
    for split in (1, 3, 6):
        parts = [rows.attend_rows(q[:, a:b], k, v, mask[a:b], 0.125) for a, b in ((0, split), (split, T))]
        assert torch.equal(torch.cat(parts, 1), out), split


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("G, D", [(2, 64), (3, 64), (4, 136), (8, 24), (5, 256)])
def test_each_query_head_is_what_it_computes_alone(dtype, G, D):
    """The query heads sharing a KV head run together with all the call's rows (tiles of 4 queries sharing each key and
    value load): each one's output is bitwise what it computes as the only head, for any group size and head dim
    (D = 136 and 256: values in passes of 64 dims)."""
    rows = _rows(dtype)
    gen = torch.Generator().manual_seed(G * D)
    S, T = 29, 3
    q, k, v = _qkv(gen, 2 * G, 2, T, S, D, dtype)
    mask = torch.ones(T, S, dtype=torch.bool).tril(S - T)
    mask[1, 4:9] = False
    out = rows.attend_rows(q, k, v, mask, 0.2)
    for h in range(2 * G):
        j = h // G
        alone = rows.attend_rows(q[h:h + 1], k[j:j + 1], v[j:j + 1], mask, 0.2)
        assert torch.equal(alone[0], out[h]), h


@pytest.mark.parametrize("dtype", DTYPES)
def test_attend_cache_writes_the_rows_then_attends(dtype):
    """``attend_cache`` (the runner's call): k, v written at [start, start + T) of one layer of the caches, nothing else
    touched, and the result ``attend_rows`` gives over that layer's slots [0, start + T)."""
    rows = _rows(dtype)
    gen = torch.Generator().manual_seed(3)
    cache_k, cache_v = (torch.randn(3, 2, 40, 24, generator=gen).to(dtype) for _ in range(2))  # (L, Hkv, C, D)
    q, k, v = _qkv(gen, 4, 2, 5, 5, 24, dtype)  # q (4, 5, 24); k, v (2, 5, 24), strided
    mask = torch.ones(5, 35, dtype=torch.bool).tril(30)
    want_k, want_v = cache_k.clone(), cache_v.clone()
    want_k[1, :, 30:35], want_v[1, :, 30:35] = k, v
    out = rows.attend_cache(q, k, v, cache_k, cache_v, 1, 30, mask, 0.2)
    assert torch.equal(cache_k, want_k) and torch.equal(cache_v, want_v)
    assert torch.equal(out, rows.attend_rows(q, want_k[1, :, :35], want_v[1, :, :35], mask, 0.2))


def test_threads_split_rows_without_changing_any_bit():
    rows = _rows(torch.float32)
    q, k, v = _qkv(torch.Generator().manual_seed(5), 9, 3, 6, 50, 64, torch.float32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = rows.attend_rows(q, k, v, None, 0.125)
        torch.set_num_threads(2)
        assert torch.equal(rows.attend_rows(q, k, v, None, 0.125), one)
    finally:
        torch.set_num_threads(threads)
    q.requires_grad_(True)
    assert row_kernel(rows, q) is None  # autograd: SDPA (the C++ call has no backward)
    with torch.no_grad():
        assert row_kernel(rows, q) is rows


def test_one_token_off_the_kernel_folds_groups_into_rows():
    """Without the kernel (``kernel=None``) one unmasked token folds its query groups into rows: SDPA's answer to
    rounding, in fp32 and bf16."""
    gen = torch.Generator().manual_seed(2)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        q, k, v = _qkv(gen, 9, 3, 1, 201, 64, dtype)
        ref = F.scaled_dot_product_attention(q[None], k[None], v[None], enable_gqa=True)[0]
        out = attend(q, k, v, None, causal=False)
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def _runner_rows(dtype: torch.dtype) -> Runner:
    _rows(dtype)
    runner = Runner.from_model(make_model("llama", seed=7), dtype=dtype)
    assert row_kernel(runner.kernel, torch.empty(0, dtype=dtype)) is not None
    return runner


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_forward_equals_each_sequence_alone(dtype):
    """Three sequences (prompts of different lengths, 1, 3 and 4 new tokens) in one packed forward: each row's logits
    bitwise what that sequence's own forward gives."""
    runner = _runner_rows(dtype)
    prompts, news = [list(range(5, 17)), list(range(40, 47)), list(range(90, 110))], [[3], [7, 8, 9], [11, 12, 13, 14]]
    caches = [runner.new_cache(64) for _ in prompts]
    for cache, prompt in zip(caches, prompts, strict=True):
        runner.forward(cache, torch.tensor(prompt))
    alone = []
    for cache, prompt, new in zip(caches, prompts, news, strict=True):
        alone.append(runner.forward(cache, torch.tensor(new)))
        cache.rollback(len(prompt))
    segments = [Segment(c, list(range(len(p), len(p) + len(n)))) for c, p, n in zip(caches, prompts, news, strict=True)]
    hidden = runner.embed(torch.tensor([t for n in news for t in n]))  # (N, d)
    packed = runner.run(Program(0, runner.num_layers, logits=True), Rows(hidden, segments)).logits
    assert torch.equal(packed, torch.cat(alone))


def test_bulk_prefill_stays_on_sdpa(monkeypatch):
    """A prompt prefill (``bulk``) never calls the row attention (SDPA's GEMMs are faster over many rows)."""
    runner = _runner_rows(torch.float32)
    calls = []
    monkeypatch.setattr("infer.model.attention.row_kernel", lambda kernel, q: calls.append(kernel))
    cache = runner.new_cache(64)
    prompt = Program(0, runner.num_layers)
    runner.run(prompt, Rows.one(cache, runner.embed(torch.arange(5, 25)), torch.arange(20), kind=BULK))
    runner.run(prompt, Rows.one(cache, runner.embed(torch.arange(5, 25)), torch.arange(20, 40), kind=BULK))  # masked
    assert calls == [None] * runner.num_layers  # the causal prefill asks nothing; the masked one is told no kernel


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", FAMILY_KINDS)
def test_families_verify_as_they_decode(kind, dtype):
    """Every family (q/k norms, head dims 16 and 24, sliding windows shorter than the context, Gemma 3's scale and
    sandwich norms): a T-token forward's logits bitwise what one token at a time gives, past the window too."""
    _rows(dtype)
    runner = Runner.from_model(family_model(kind, seed=4), dtype=dtype)
    ids = torch.randint(3, 300, (80,), generator=torch.Generator().manual_seed(4))
    cache = runner.new_cache(128)
    runner.forward(cache, ids[:60])  # past TINY_WINDOW (48): windowed layers hide early keys
    for T in (2, 5, 12):
        batched = runner.forward(cache, ids[60:60 + T])
        cache.rollback(60)
        stepped = torch.cat([runner.forward(cache, ids[i:i + 1]) for i in range(60, 60 + T)])
        cache.rollback(60)
        assert torch.equal(batched, stepped), (kind, T)


def test_bf16_values_one_key_at_a_time_where_pairs_are_off():
    """bf16 sums the values over pairs of keys (vdpbf16ps) only where the CPU adds a pair's two products in key order,
    each rounded (checked once at run time); elsewhere one key at a time. ``LAYERSKIP_ATTENTION_PAIRS=off`` forces
    the second route in a fresh process: the attention tests pass there too, bf16 included (not skipped)."""
    module = _rows(torch.bfloat16)
    assert isinstance(module.bf16_value_pairs(), bool)
    here = os.path.dirname(__file__)
    env = dict(os.environ, LAYERSKIP_ATTENTION_PAIRS="off",
               PYTHONPATH=os.pathsep.join([here, os.path.dirname(here), *sys.path]))
    check = "from infer import kernels; m = kernels.load(); assert not m.bf16_value_pairs(); print('off')"
    out = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("off"), out.stderr[-2000:]
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:xdist",
                          "-k", "not one_key", __file__], env=env, capture_output=True, text=True,
                         timeout=600, cwd=os.path.dirname(here))
    assert out.returncode == 0 and " passed" in out.stdout and "skipped" not in out.stdout, out.stdout[-3000:]
