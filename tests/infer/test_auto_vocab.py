"""The draft vocabulary built for a model that ships none (infer.assets.auto_vocab): counted on the model's own greedy
continuations of built-in prompts, its held-out coverage printed, kept in the toolkit cache tied to the model, used
by draft_vocab=auto (and a size N) from then on; a model with a small vocabulary keeps the full head. The tiny model
stands in for Gemma 3 (its 320-token vocabulary counts as large here)."""

import pytest

from infer.assets import auto_vocab
from infer.decode.engine import DecodeConfig
from infer.loading import load_model
from layerskip_core import draft_vocab
from layerskip_core.draft_vocab import TokenCounts, resolve_draft_vocab
from tiny_models import save_tiny


@pytest.fixture
def small_auto(monkeypatch, tmp_path):
    """Thresholds scaled to the tiny model, a few short prompts, a cache of this test's own."""
    monkeypatch.setattr(auto_vocab, "AUTO_MIN_VOCAB", 256)
    monkeypatch.setattr(auto_vocab, "AUTO_SIZE", 64)
    monkeypatch.setattr(draft_vocab, "AUTO_SIZE", 64)
    monkeypatch.setattr(auto_vocab, "PROMPTS", ("def add(a, b):", "hello there", "x = [1, 2", "The cat sat"))
    monkeypatch.setattr(auto_vocab, "HELD_OUT", 1)
    monkeypatch.setattr(auto_vocab, "NEW_TOKENS", 12)
    monkeypatch.setattr(auto_vocab, "BACKOFF_CHARS", 20_000)
    monkeypatch.setattr(draft_vocab, "cache_root", lambda: tmp_path / "cache")
    return tmp_path / "cache" / "draft_vocab"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(str(save_tiny(tmp_path_factory.mktemp("tiny"))))


def test_auto_builds_counts_once_from_the_models_own_output(tiny, small_auto, capsys, monkeypatch):
    with tiny.engine("early_exit", exit_layer=2, num_draft=3) as engine:
        vocab = engine.drafter.vocab
        result = engine.generate(tiny.encode("def add(a, b):"), DecodeConfig(max_new_tokens=12))
    err = capsys.readouterr().err
    assert "building one once from its own greedy continuations of 3 built-in prompts" in err
    assert "cover" in err and "held-out prompts" in err and str(small_auto) in err
    assert vocab is not None and vocab.size == 64
    (path,) = small_auto.glob("*.json")
    counts = TokenCounts.load(path)
    assert counts.source["mode"] == "generate" and counts.source["items"] == 3
    assert 0 <= counts.source["coverage"]["coverage"] <= 1 and counts.source["coverage"]["tokens"] > 0
    generated = auto_vocab.greedy(tiny.runner, tiny.encode("def add(a, b):"), 12, set(tiny.eos_token_ids))
    assert generated == result.tokens[:len(generated)]  # its continuations are plain decoding's
    assert set(generated) <= set(counts.counts)  # counted (the first prompt is a calibration prompt)
    assert set(counts.special) <= set(counts.top(64).ids)

    def no_build(*args, **kwargs):
        raise AssertionError("built again")

    monkeypatch.setattr(auto_vocab, "build_counts", no_build)
    with tiny.engine("dynamic_exit", exits="1/2") as engine:  # the next drafter reads the kept counts
        assert engine.drafter.vocab.size == 64
    assert "building" not in capsys.readouterr().err
    assert resolve_draft_vocab(32, tiny.runner, tiny.tokenizer).size == 32  # a size N: the top N of them


def test_a_small_vocabulary_keeps_the_full_head(tiny, small_auto, monkeypatch):
    monkeypatch.setattr(auto_vocab, "AUTO_MIN_VOCAB", 321)  # the tiny model's 320 ids are under it
    with tiny.engine("early_exit", exit_layer=2) as engine:
        assert engine.drafter.vocab is None
    assert not small_auto.exists()


def test_off_or_a_given_vocabulary_builds_nothing(tiny, small_auto):
    with tiny.engine("early_exit", exit_layer=2, draft_vocab="off") as engine:
        assert engine.drafter.vocab is None
    assert not small_auto.exists()


def test_a_finetuned_copy_shares_the_counts_another_model_gets_its_own(tiny, small_auto, tmp_path, capsys):
    """Counts fit by architecture and tokenizer (as shipped ones): a checkpoint finetuned from the model (other
    weights, same shape and tokenizer) uses them; another architecture builds its own."""
    with tiny.engine("early_exit", exit_layer=2):
        pass
    finetuned = load_model(str(save_tiny(tmp_path / "finetuned", seed=4)))
    capsys.readouterr()
    with finetuned.engine("early_exit", exit_layer=2) as engine:
        assert engine.drafter.vocab.size == 64
    assert "building" not in capsys.readouterr().err and len(list(small_auto.glob("*.json"))) == 1
    other = load_model(str(save_tiny(tmp_path / "other", layers=3)))
    with other.engine("early_exit", exit_layer=2) as engine:
        assert engine.drafter.vocab.size == 64
    assert len(list(small_auto.glob("*.json"))) == 2
