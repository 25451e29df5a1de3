"""train_bench on tiny CPU shapes: the result's keys, the e2e train -> save -> runner decode (with no model cache:
a byte-level tokenizer built in code), the doc table."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

import layerskip_core.models
from script_modules import REPO
from tools.bench.train_bench import (
    NOT_RUN,
    TINY,
    make_random_checkpoint,
    step_flops,
    train_check,
    update_training_doc,
    variants,
)
from tools.doc_sections import GPU_TRAINING
from tools.seeded_models import BYTE_VOCAB

FIELDS = ("plain_tok_s", "dropout_rel", "dropout05_rel", "dropout_batch_rel", "exits_rel", "dropout_exits_rel",
          "rotational_rel", "plain_peak_gb", "exits_peak_gb", "mfu")


def _no_model_lookup(*args, **kwargs):
    raise AssertionError("the end-to-end check looked for a model (a download on a fresh machine)")


@pytest.fixture(scope="module")
def tiny_result(tmp_path_factory):
    """No --tokenizer-dir, an empty toolkit cache, HF offline, and fetching a model (default or hub) an error."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LAYERSKIP_CACHE", str(tmp_path_factory.mktemp("empty-cache")))
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setattr(layerskip_core.models, "fetch_default_model", _no_model_lookup)
        mp.setattr(layerskip_core.models, "_from_hub", _no_model_lookup)
        return train_check("cpu", tiny=True)


def test_tiny_train_check_reports_every_field_and_e2e(tiny_result):
    assert set(tiny_result) >= {"train", "e2e_ok", "train_e2e", "train_meta"}
    (name, row), = tiny_result["train"].items()
    assert set(FIELDS) <= set(row)
    assert row["plain_tok_s"] > 0 and all(row[f] > 0 for f in FIELDS if f.endswith("_rel"))
    assert row["plain_peak_gb"] is None and row["mfu"] is None  # CPU: no peak memory counter, no peak FLOP/s
    assert 0 < row["dropout05_skipped"] < 1
    e2e = tiny_result["train_e2e"]
    assert tiny_result["e2e_ok"] is True, e2e
    assert len(e2e["decoded"]) == 6 and all(math.isfinite(x) for x in e2e["losses"])
    assert "model.safetensors" in e2e["final_dir_files"]


def test_checkpoint_tokenizer_is_the_given_one_or_the_byte_tokenizer(tiny_model_dir, tmp_path):
    given = make_random_checkpoint(tmp_path / "given", dict(TINY, vocab_size=600), str(tiny_model_dir))
    assert AutoTokenizer.from_pretrained(given).get_vocab() == AutoTokenizer.from_pretrained(tiny_model_dir).get_vocab()
    built = make_random_checkpoint(tmp_path / "built", dict(TINY, vocab_size=8))
    tok = AutoTokenizer.from_pretrained(built)
    assert len(tok) == BYTE_VOCAB and tok.decode(tok("héllo")["input_ids"]) == "héllo"
    assert AutoTokenizer.from_pretrained(built).eos_token == "</s>"
    config = (built / "config.json").read_text()
    assert f'"vocab_size": {BYTE_VOCAB}' in config  # grown to the tokenizer


def test_doc_table_between_markers(tiny_result, tmp_path):
    BEGIN, END = GPU_TRAINING.begin, GPU_TRAINING.end
    doc = tmp_path / "TRAINING.md"
    doc.write_text(f"# T\n\nbefore\n{BEGIN}\n{NOT_RUN}\n{END}\nafter\n", encoding="utf-8")
    update_training_doc(tiny_result, str(doc))
    text = doc.read_text(encoding="utf-8")
    name = next(iter(tiny_result["train"]))
    assert text.startswith("# T\n\nbefore\n") and text.endswith(f"{END}\nafter\n")
    assert f"| {name} |" in text and NOT_RUN not in text and "End to end" in text
    update_training_doc({}, str(doc))  # an empty result puts the placeholder back
    assert NOT_RUN in doc.read_text(encoding="utf-8")
    bad = tmp_path / "none.md"
    bad.write_text("no markers\n", encoding="utf-8")
    with pytest.raises(ValueError, match="markers"):
        update_training_doc(tiny_result, str(bad))


def test_variants_and_flops():
    v = variants(16)
    assert v["exits"][1].exits == [4, 8, 12] and v["rotational"][1].curriculum == "rotational"
    assert v["dropout"][0].p_max == 0.2 and v["dropout05"][0].p_max == 0.5
    assert v["dropout_batch"][0].granularity == "batch"
    cfg = dict(hidden_size=8, num_hidden_layers=1, vocab_size=10, intermediate_size=16, num_attention_heads=2,
               num_key_value_heads=1)
    # weights: q, o 8x8; k, v 8x4; gate/up/down 8x16 -> 64*2 + 32*2 + 384 = 576; head 80
    assert step_flops(cfg, tokens=2, block=2) == 3 * (2 * 2 * (576 + 80) + 2 * 2 * 1 * 2 * 8)


def test_import_needs_no_optional_packages():
    code = ("import sys, tools.bench.train_bench; bad = [m for m in ('infer.model.runner', 'infer.decode.engine', "
            "'train.layerskip', 'deepspeed', 'wandb', "
            "'datasets', 'matplotlib', 'optuna') if m in sys.modules]; print(bad); sys.exit(bool(bad))")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
