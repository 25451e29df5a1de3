"""Data: sources, packing, held-out split, finetuning labels, tokenisation cache, batch order."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest

import train.data as data
from layerskip_core.errors import UserError
from tiny_models import byte_tokenizer
from train.config import DataConfig, SourceConfig
from train.data import IGNORE, BatchOrder, Document, Examples, build_dataset, encode_pair, pack_blocks, read_source


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def test_stdlib_source_is_found_with_sysconfig():
    root = data.stdlib_dir()
    assert root == Path(sysconfig.get_paths()["stdlib"])
    files = data.source_files(SourceConfig(type="stdlib"))
    names = {f.name for f in files}
    assert {"os.py", "json.py" if (root / "json.py").exists() else "__init__.py"} & names
    assert all("site-packages" not in f.parts and "test" not in f.parts for f in files)
    assert len(files) > 200
    # deterministic order: by a hash of the relative path (held-out files spread over the tree)
    assert files == data.source_files(SourceConfig(type="stdlib"))


def test_pack_blocks_puts_eos_between_documents():
    ex = pack_blocks([[5, 6, 7], [8, 9]], block_size=3, eos_id=2)
    assert len(ex) == 2
    assert ex.ids.tolist() == [5, 6, 7, 2, 8, 9]  # the trailing EOS does not fill a block and is dropped
    assert np.array_equal(ex.labels, ex.ids)


def test_split_front_train_back_validation():
    docs = [Document(str(i), text="x") for i in range(10)]
    train, val = data.split_documents(docs, 0.2)
    assert [d.id for d in train] == [str(i) for i in range(8)] and [d.id for d in val] == ["8", "9"]
    assert data.split_documents(docs, 0.0) == (docs, [])
    assert len(data.split_documents(docs, 0.01)[1]) == 1


def test_files_source_and_packing(text_dir, tok, tmp_path):
    cfg = DataConfig(sources=[SourceConfig(type="files", path=str(text_dir))], block_size=64, val_fraction=0.25,
                     cache_dir=str(tmp_path))
    ds = build_dataset(cfg, tok, Path(tmp_path))
    assert ds.meta["train_documents"] == 18 and ds.meta["val_documents"] == 6
    assert all(ds.train.offsets[i + 1] - ds.train.offsets[i] == 64 for i in range(len(ds.train)))
    text_tokens = sum(len(p.read_bytes()) for p in text_dir.rglob("*.py"))
    assert 0.9 * text_tokens < ds.train.num_tokens + ds.val.num_tokens <= text_tokens + 24
    batch = ds.train.batch([0, 1], pad_id=2)
    assert batch["input_ids"].shape == (2, 64) and bool((batch["labels"] == batch["input_ids"]).all())


def test_tokenisation_is_cached(text_dir, tok, tmp_path, monkeypatch):
    cfg = DataConfig(sources=[SourceConfig(type="files", path=str(text_dir))], block_size=32, cache_dir=str(tmp_path))
    first = build_dataset(cfg, tok, Path(tmp_path))
    assert len(list(tmp_path.glob("*.npz"))) == 1
    monkeypatch.setattr(data, "tokenize_documents", lambda *a: pytest.fail("cache miss"))
    second = build_dataset(cfg, tok, Path(tmp_path))
    assert np.array_equal(first.train.ids, second.train.ids) and second.meta == first.meta
    # a change in the config is a different cache entry
    monkeypatch.undo()
    build_dataset(DataConfig(sources=cfg.sources, block_size=16, cache_dir=str(tmp_path)), tok, Path(tmp_path))
    assert len(list(tmp_path.glob("*.npz"))) == 2


def test_text_and_jsonl_sources_through_datasets(tmp_path, tok, monkeypatch):
    monkeypatch.setenv("LAYERSKIP_CACHE", str(tmp_path / "cache"))
    (tmp_path / "a.txt").write_text("first document\nline two\n")
    (tmp_path / "b.txt").write_text("second document\n")
    docs = read_source(SourceConfig(type="text", path=str(tmp_path / "*.txt")), "pretrain")
    assert [d.text for d in docs] == ["first document\nline two\n", "second document\n"]
    lines = read_source(SourceConfig(type="text", path=str(tmp_path / "a.txt"), sample_by="line"), "pretrain")
    assert [d.text for d in lines] == ["first document", "line two"]
    rows = [{"question": f"q{i}", "answer": f"a{i}", "body": f"text {i}"} for i in range(3)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pre = read_source(SourceConfig(type="jsonl", path=str(tmp_path / "d.jsonl"), text_field="body"), "pretrain")
    assert [d.text for d in pre] == ["text 0", "text 1", "text 2"]
    sft = read_source(SourceConfig(type="jsonl", path=str(tmp_path / "d.jsonl"), prompt_field="question",
                                   response_field="answer"), "sft")
    assert (sft[1].prompt, sft[1].response) == ("q1", "a1")
    with pytest.raises(UserError, match="no field 'prompt'"):
        read_source(SourceConfig(type="jsonl", path=str(tmp_path / "d.jsonl")), "sft")
    with pytest.raises(UserError, match="prompt/response"):
        read_source(SourceConfig(type="text", path=str(tmp_path / "a.txt")), "sft")


def test_sft_labels_cover_only_the_response(tok):
    ids, labels = encode_pair(tok, "What is 2+2?", "4, of course.", chat=True, add_eos=True, max_len=512)
    text = tok.decode(ids)
    assert text == "<|user|>What is 2+2?</s><|assistant|>4, of course.</s>"
    n_prompt = len(tok("<|user|>What is 2+2?</s><|assistant|>", add_special_tokens=False)["input_ids"])
    assert labels[:n_prompt] == [IGNORE] * n_prompt
    assert tok.decode([t for t in labels if t != IGNORE]) == "4, of course.</s>"
    plain_ids, plain_labels = encode_pair(tok, "Q: hi\nA:", " yo", chat=False, add_eos=True, max_len=512)
    assert tok.decode([t for t in plain_labels if t != IGNORE]) == " yo</s>"
    cut_ids, cut_labels = encode_pair(tok, "Q", "a long answer", chat=False, add_eos=True, max_len=4)
    assert len(cut_ids) == len(cut_labels) == 4


def test_sft_batches_are_right_padded(tmp_path, tok, monkeypatch):
    monkeypatch.setenv("LAYERSKIP_CACHE", str(tmp_path / "cache"))
    rows = [{"prompt": "p" * (i + 1), "response": "r" * (2 * i + 1)} for i in range(6)]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(task="sft", sources=[SourceConfig(type="jsonl", path=str(tmp_path / "sft.jsonl"))],
                     block_size=64, val_fraction=0.0, cache_dir=str(tmp_path))
    ds = build_dataset(cfg, tok, Path(tmp_path))
    batch = ds.train.batch([0, 5], pad_id=2)
    ids, labels = batch["input_ids"], batch["labels"]
    n0 = int(ds.train.offsets[1] - ds.train.offsets[0])
    assert ids.shape[1] == int(ds.train.offsets[6] - ds.train.offsets[5]) > n0
    assert bool((ids[0, n0:] == 2).all()) and bool((labels[0, n0:] == IGNORE).all())
    assert int((labels[1] != IGNORE).sum()) == 11 + 1  # 11 'r' bytes + the '</s>' token


def test_prompt_set_source_needs_the_package(monkeypatch):
    import layerskip_core.prompts as prompts

    items = [prompts.PromptItem(str(i), f"question {i}", f"answer {i}", "gsm8k") for i in range(10)]
    monkeypatch.setattr(data, "load_prompts", lambda name, *a, **k: items)
    docs = read_source(SourceConfig(type="prompt_set", path="gsm8k"), "sft")
    assert [(d.prompt, d.response) for d in docs[:2]] == [("question 0", "answer 0"), ("question 1", "answer 1")]
    train, val = data.split_documents(docs, 0.2)
    assert [d.id for d in val] == ["8", "9"]  # held out: the back, as prompts.load(from_end=True)


def test_batch_order_is_a_pure_function_of_step():
    a, b = BatchOrder(10, 2, 2, 1, seed=3), BatchOrder(10, 2, 2, 1, seed=3)
    seq = [a.indices(s, m, 0) for s in range(5) for m in range(2)]
    assert seq == [b.indices(s, m, 0) for s in range(5) for m in range(2)]
    assert sorted(i for batch in seq for i in batch) == sorted(list(range(10)) * 2)  # two full epochs
    late = BatchOrder(10, 2, 2, 1, seed=3)
    assert late.indices(4, 1, 0) == seq[-1]  # resuming at step 4 needs no replay
    two = BatchOrder(10, 2, 1, 2, seed=3)
    assert set(two.indices(0, 0, 0)).isdisjoint(two.indices(0, 0, 1))  # ranks see different examples
    assert BatchOrder(10, 2, 2, 1, seed=4).indices(0, 0, 0) != seq[0] or seq[0] != seq[1]


def test_examples_take_and_empty():
    ex = Examples.from_lists([[1, 2], [3, 4, 5], [6]], [[1, 2], [3, 4, 5], [6]])
    assert len(ex.take(2)) == 2 and ex.take(2).num_tokens == 5
    assert len(Examples.from_lists([], [])) == 0


# --------------------------------------------------------------------------------------------
# Deduplication and package hold-out
# --------------------------------------------------------------------------------------------


def _module(name: str, n: int = 40, tweak: str = "") -> str:
    """A synthetic module: ``n`` distinct functions whose names and bodies depend on ``name``."""
    lines = [f'"""Module {name}."""', "", "import os", ""]
    for i in range(n):
        lines += [f"def {name}_func_{i}(x, y={i}):", f"    total = x * {i} + y - len('{name}{i}')",
                  f"    return os.path.join(str(total), '{name}'){tweak if i == n // 2 else ''}", ""]
    return "\n".join(lines)


@pytest.fixture
def code_tree(tmp_path):
    """Packages alpha (with a near-copy and an exact copy of one file), beta, and a top-level module gamma.py."""
    root = tmp_path / "tree"
    for rel, text in {
        "alpha/__init__.py": _module("alpha_init"),
        "alpha/core.py": _module("core"),
        "alpha/core_copy.py": _module("core", tweak="  # one changed line"),
        "alpha/CORE_SAME.py": _module("core").upper().lower().replace("\n", "\n\n"),
        "alpha/other.py": _module("other"),
        "beta/__init__.py": _module("beta_init"),
        "beta/util.py": _module("util"),
        "beta/core_again.py": _module("core", tweak="  # beta's copy"),
        "gamma.py": _module("gamma"),
        "delta.py": _module("delta"),
    }.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def _ids(docs):
    return sorted(d.id for d in docs)


def test_package_of_takes_the_first_path_component():
    assert data.package_of("email/mime/text.py") == "email"
    assert data.package_of("json.py") == "json"
    assert data.package_of("encodings/cp1252.py") == "encodings"


def test_exact_dedup_ignores_case_and_whitespace_only(code_tree):
    src = SourceConfig(type="files", path=str(code_tree), dedup="exact")
    docs = read_source(src, "pretrain")
    kept, dropped = data.deduplicate(docs, "exact", 0.7)
    dropped_ids = {a for a, _ in dropped}
    assert len(dropped) == 1 and dropped_ids <= {"alpha/core.py", "alpha/CORE_SAME.py"}
    assert "alpha/core_copy.py" in _ids(kept)  # one changed line is not an exact duplicate
    assert data.deduplicate(docs, "off", 0.7) == (docs, [])


def test_near_dedup_drops_near_copies_and_keeps_distinct_files(code_tree):
    src = SourceConfig(type="files", path=str(code_tree), dedup="near")
    docs = read_source(src, "pretrain")
    kept, dropped = data.deduplicate(docs, "near", 0.7)
    core_family = {"alpha/core.py", "alpha/core_copy.py", "alpha/CORE_SAME.py", "beta/core_again.py"}
    assert len(core_family & set(_ids(kept))) == 1  # one representative of the family survives
    assert {"alpha/__init__.py", "alpha/other.py", "beta/__init__.py", "beta/util.py", "gamma.py",
            "delta.py"} <= set(_ids(kept))
    assert {a for a, _ in dropped} | set(_ids(kept)) == {d.id for d in docs}


def test_holdout_packages_form_the_validation_set_whole(code_tree):
    src = SourceConfig(type="files", path=str(code_tree), holdout_packages=["beta", "gamma"])
    train, val, dropped = data.split_source(read_source(src, "pretrain"), src, val_fraction=0.5)
    assert _ids(val) == ["beta/__init__.py", "beta/core_again.py", "beta/util.py", "gamma.py"]
    assert all(data.package_of(d.id) not in ("beta", "gamma") for d in train)
    assert len(train) == 6 and dropped == []  # val_fraction is not applied on top of the hold-out


def test_near_duplicates_across_the_split_lose_their_training_copy(code_tree):
    src = SourceConfig(type="files", path=str(code_tree), dedup="near", holdout_packages=["beta"])
    train, val, dropped = data.split_source(read_source(src, "pretrain"), src, val_fraction=0.0)
    assert "beta/core_again.py" in _ids(val)
    assert not {"alpha/core.py", "alpha/core_copy.py", "alpha/CORE_SAME.py"} & set(_ids(train))
    assert sorted(a for a, _ in dropped) == ["alpha/CORE_SAME.py", "alpha/core.py", "alpha/core_copy.py"]


def test_build_dataset_with_dedup_and_holdout(code_tree, tok, tmp_path):
    src = SourceConfig(type="files", path=str(code_tree), dedup="near", holdout_packages=["beta"])
    cfg = DataConfig(sources=[src], block_size=64, cache_dir=str(tmp_path / "cache"))
    ds = build_dataset(cfg, tok, Path(tmp_path), log=lambda m: None)
    assert ds.meta["duplicates_dropped"] == 3 and ds.meta["val_documents"] == 3
    assert all(i.startswith("beta/") for i in ds.meta["val_ids"])
    assert ds.meta["train_documents"] == 4  # alpha/__init__, alpha/other, gamma, delta


def test_holdout_errors_are_one_line(code_tree):
    src = SourceConfig(type="files", path=str(code_tree), holdout_packages=["nosuchpkg"])
    with pytest.raises(UserError, match="match no document"):
        data.split_source(read_source(src, "pretrain"), src, 0.1)
    with pytest.raises(UserError, match="holdout_packages needs"):
        SourceConfig(type="text", path="x.txt", holdout_packages=["a"])
    with pytest.raises(UserError, match="dedup_threshold"):
        SourceConfig(type="stdlib", dedup_threshold=0.0)
