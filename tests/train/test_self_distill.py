"""Self-distillation data (``train.self_distill``, ``train.distill_prompts``) and an adapter trained on it."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from infer.decode.engine import DecodeConfig, Engine
from infer.drafters import build_drafter
from infer.model.runner import Runner
from train import distill_prompts as dp
from train.layerskip import run_training
from train.self_distill import main, prompt_text


def test_training_and_validation_prompts_are_disjoint_and_held_out_kinds_never_train():
    assert not set(dp.TRAIN_KINDS) & set(dp.HELDOUT_KINDS)
    for kind in dp.TRAIN_KINDS:
        train = {p.text for p in dp.training_prompts(kind)}
        val = {p.text for p in dp.validation_prompts(kind)}
        assert len(val) == dp.VALIDATION_PER_KIND and train and not train & val
        assert dp.prompts_of(kind) == dp.prompts_of(kind)  # a fixed order: the split is the same every run
    everything = {p.text for k in dp.TRAIN_KINDS for p in dp.prompts_of(k)}
    for kind in ("stories", "code_rust"):
        assert not {p.text for p in dp.prompts_of(kind)} & everything
    # no training prompt asks for a held-out kind under another form (a story, Rust, a manual page)
    assert not [t for t in everything if re.search(r"\bstor(y|ies)\b|\bRust\b|\bman(ual)? page", t, re.I)]


def test_chat_prompts_use_the_template_and_raw_ones_do_not(default_model_path):
    tok = AutoTokenizer.from_pretrained(default_model_path)
    chat, raw = dp.training_prompts("math", 1)[0], dp.training_prompts("code_continue", 1)[0]
    assert prompt_text(tok, chat).endswith("<|im_start|>assistant\n") and chat.text in prompt_text(tok, chat)
    assert prompt_text(tok, raw) == raw.text


def _generate(tiny_model_dir, out: Path, *extra: str) -> int:
    return main(["--model", str(tiny_model_dir), "--out", str(out), "--kinds", "chat,math", "--per-kind", "3",
                 "--max-new-tokens", "6", "--batch-size", "2", "--threads", "1", *extra])


def test_generates_each_kind_with_its_provenance(tiny_model_dir, tmp_path):
    assert _generate(tiny_model_dir, tmp_path / "data") == 0
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prov = json.loads((tmp_path / "data" / "provenance.json").read_text())
    for kind in ("chat", "math"):
        rows = [json.loads(line) for line in (tmp_path / "data" / f"{kind}.jsonl").read_text().splitlines()]
        prompts = dp.training_prompts(kind, 3)
        assert [r["id"] for r in rows] == [p.id for p in prompts]
        assert [r["sampled"] for r in rows] == [False, True, False]  # greedy and sampled alternate
        for r, p in zip(rows, prompts, strict=True):
            assert r["text"].startswith(prompt_text(tok, p)) and p.text in r["text"] and 0 < r["new_tokens"] <= 6
        assert prov["kinds"][kind] == {"prompts": 3, "new_tokens": sum(r["new_tokens"] for r in rows)}
    assert prov["settings"]["max_new_tokens"] == 6 and prov["commit"]


def test_a_sampled_pass_with_another_seed_adds_other_continuations_of_the_same_prompts(tiny_model_dir, tmp_path):
    assert _generate(tiny_model_dir, tmp_path / "a", "--decoding", "sampled", "--max-new-tokens", "12") == 0
    assert _generate(tiny_model_dir, tmp_path / "b", "--decoding", "sampled", "--max-new-tokens", "12",
                     "--seed", "1") == 0
    a, b = ([json.loads(line) for line in (tmp_path / d / "chat.jsonl").read_text().splitlines()] for d in "ab")
    assert [r["sampled"] for r in a] == [True, True, True] and [r["id"] for r in a] == [r["id"] for r in b]
    assert [r["text"] for r in a] != [r["text"] for r in b]
    assert json.loads((tmp_path / "b" / "provenance.json").read_text())["settings"]["decoding"] == "sampled"


def test_refuses_to_replace_data_without_force(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "data"
    out.mkdir()
    (out / "chat.jsonl").write_text("{}\n")
    assert _generate(tiny_model_dir, out) == 2
    assert "--force" in capsys.readouterr().err and (out / "chat.jsonl").read_text() == "{}\n"
    assert _generate(tiny_model_dir, out, "--force") == 0


def _own(tiny_model_dir, out: Path, prompts: Path, *extra: str) -> int:
    return main(["--model", str(tiny_model_dir), "--out", str(out), "--prompts", str(prompts), "--max-new-tokens", "5",
                 "--batch-size", "2", "--threads", "1", *extra])


def test_own_prompts_give_one_file_per_kind_in_the_chat_template_or_raw(tiny_model_dir, tmp_path):
    """--prompts: a user's own JSON-lines prompts (a bench data file works as is), one output file per 'kind'."""
    lines = [{"prompt": "How do I reset my router?", "kind": "support"}, {"id": "x", "prompt": "Where is my order?"},
             {"prompt": "SELECT name FROM users WHERE", "kind": "sql", "chat": False},
             {"prompt": "My screen is dark.", "kind": "support"}]
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text("".join(json.dumps(o) + "\n" for o in lines) + "\n")
    assert _own(tiny_model_dir, tmp_path / "data", prompts) == 0
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = {k: [json.loads(line) for line in (tmp_path / "data" / f"{k}.jsonl").read_text().splitlines()]
            for k in ("support", "own", "sql")}
    assert [r["id"] for r in rows["support"]] == ["support-0", "support-1"]
    assert [r["id"] for r in rows["own"]] == ["own-0"]  # no 'kind': 'own'
    dark = dp.KindPrompt("support", "", "My screen is dark.", True)
    assert rows["support"][1]["text"].startswith(prompt_text(tok, dark))
    assert rows["sql"][0]["text"].startswith("SELECT name FROM users WHERE")  # raw: no template
    prov = json.loads((tmp_path / "data" / "provenance.json").read_text())
    assert set(prov["kinds"]) == {"support", "own", "sql"} and prov["settings"]["prompts"] == str(prompts)
    assert len(prov["settings"]["prompts_sha256"]) == 64
    assert _own(tiny_model_dir, tmp_path / "one", prompts, "--per-kind", "1") == 0
    assert len((tmp_path / "one" / "support.jsonl").read_text().splitlines()) == 1


@pytest.mark.parametrize("content, says", [
    (None, "does not exist"), ("", "holds no prompt"), ("{oops\n", ":1: not valid JSON"),
    ('{"prompt": "a"}\n{"text": "b"}\n', "line 2: each line needs"), ('{"prompt": "a", "kind": "../x"}\n', "'kind'"),
    ('{"prompt": "a", "chat": "no"}\n', "'chat' must be"),
])
def test_bad_prompt_files_are_refused_in_one_line(tiny_model_dir, tmp_path, capsys, content, says):
    prompts = tmp_path / "mine.jsonl"
    if content is not None:
        prompts.write_text(content)
    assert _own(tiny_model_dir, tmp_path / "data", prompts) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and not (tmp_path / "data").exists()


def test_own_prompts_and_built_in_kinds_exclude_each_other(tiny_model_dir, tmp_path, capsys):
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text('{"prompt": "a"}\n')
    assert _own(tiny_model_dir, tmp_path / "data", prompts, "--kinds", "chat") == 2
    assert "exclude each other" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [["--kinds", "poems"], ["--per-kind", "0"], ["--temperature", "0"]])
def test_bad_options_are_refused_in_one_line(tiny_model_dir, tmp_path, capsys, bad):
    assert _generate(tiny_model_dir, tmp_path / "data", *bad) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and not (tmp_path / "data").exists()


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_an_adapter_trains_on_the_data_and_drafts_losslessly(tiny_recipe, tiny_model_dir, tmp_path):
    """The recipe's shape on the tiny model: jsonl sources per kind, an adapter with an MLP, distilled from the kept
    teacher's top K."""
    import ship_adapter

    data, again = tmp_path / "data", tmp_path / "again"  # two passes: alternate, then sampled with another seed
    assert _generate(tiny_model_dir, data) == 0
    assert _generate(tiny_model_dir, again, "--decoding", "sampled", "--seed", "1") == 0
    sources = ", ".join(f"{{type: jsonl, path: '{d / k}.jsonl'}}" for d in (data, again) for k in ("chat", "math"))
    cfg = tiny_recipe(f"data.sources=[{sources}]", "data.block_size=16", "data.val_fraction=0.3",
                      "logging.eval_every=3",
                      "adapter.enabled=true", "adapter.exit_layer=1", "adapter.mlp_size=16", "adapter.teacher_top_k=8",
                      "optim.max_steps=3")
    path = run_training(cfg)["final_dir"]
    ship = ["--run", cfg.checkpoint.output_dir, "--name", "tiny", "--out", str(tmp_path / "ship")]
    assert ship_adapter.main(ship) == 0
    shipped = json.loads((tmp_path / "ship" / "tiny-e1.provenance.json").read_text())
    assert shipped["self_distilled_kinds"]["chat"]["prompts"] == 6  # both passes' 3 prompts
    assert [p.get("decoding") for p in shipped["self_distill_passes"]] == ["alternate", "sampled"]
    assert shipped["draft_vocab"] is None  # the whole head
    runner = Runner.from_pretrained(tiny_model_dir)
    engine = Engine(runner, build_drafter("early_exit", runner, {"adapter": str(path), "k": 3}))
    plain = Engine(runner, build_drafter("autoregressive", runner))
    prompt = list(range(40, 60))
    assert engine.generate(prompt, DecodeConfig(max_new_tokens=16)).tokens == \
        plain.generate(prompt, DecodeConfig(max_new_tokens=16)).tokens


def test_the_shipped_adapter_carries_its_provenance_and_never_saw_a_held_out_kind():
    """infer/data/adapters: the default adapter's header and the provenance file beside it agree, name the recipe's
    self-distilled kinds, and no held-out kind is among its sources."""
    from safetensors import safe_open

    folder = Path(__file__).resolve().parents[2] / "infer" / "data" / "adapters"
    with safe_open(str(folder / "smollm2-135m-instruct-e4.safetensors"), framework="pt") as f:
        header = json.loads(f.metadata()["provenance"])
    beside = json.loads((folder / "smollm2-135m-instruct-e4.provenance.json").read_text())
    kinds = [s["self_distill"]["kind"] for s in header["sources"] if "self_distill" in s]
    assert set(kinds) == set(dp.TRAIN_KINDS) and set(beside["self_distilled_kinds"]) == set(kinds)
    assert not set(kinds) & set(dp.HELDOUT_KINDS) and beside["held_out_kinds"] == list(dp.HELDOUT_KINDS)
    assert (beside["steps"], beside["loss_tokens"], beside["code_commit"]) == \
        (header["steps"], header["tokens"], header["commit"])
    assert (folder.parents[2] / beside["recipe"]).is_file()
    # its head was trained on the draft vocabulary `auto` reads now: the counts shipped beside it, not a recount
    counts = folder.parents[2] / beside["draft_vocab_counts"]["file"]
    assert hashlib.sha256(counts.read_bytes()).hexdigest() == beside["draft_vocab_counts"]["sha256"]


def test_the_counts_are_recorded_for_a_head_trained_on_the_top_of_them():
    """'auto' and a size N both read the shipped counts (their top 8192 or N): both record them; a vocabulary file
    or the whole head records none."""
    import ship_adapter

    name = "smollm2-135m-instruct"
    for option, recorded in (("auto", True), ("16384", True), ("runs/vocab.json", False), ("off", False)):
        record = ship_adapter.counts_record({"option": option}, name)
        assert (record is not None) == recorded, option
    assert ship_adapter.counts_record(None, name) is None
    assert ship_adapter.counts_record({"option": "auto"}, "no-such-model") is None


def test_the_data_and_the_adapter_record_the_code_at_their_start(tiny_recipe, tiny_model_dir, tmp_path, monkeypatch):
    """The checkout may move on while a long generation or training runs: both record the commit taken when they
    started, not when their files are written (here the commit 'moves' once the work has begun)."""
    from safetensors import safe_open

    import train.adapter
    import train.self_distill

    head = {"commit": "at-start"}
    monkeypatch.setattr(train.self_distill, "code_commit", lambda: head["commit"])
    generate = train.self_distill.generate_kind

    def generate_and_move(*args, **kwargs):
        head["commit"] = "later"
        return generate(*args, **kwargs)

    monkeypatch.setattr(train.self_distill, "generate_kind", generate_and_move)
    assert _generate(tiny_model_dir, tmp_path / "data") == 0
    assert json.loads((tmp_path / "data" / "provenance.json").read_text())["commit"] == "at-start"
    head["commit"] = "run-start"
    monkeypatch.setattr(train.adapter, "code_commit", lambda: head["commit"])
    forward = train.adapter.AdapterLM.forward

    def forward_and_move(self, *args, **kwargs):
        head["commit"] = "later"
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(train.adapter.AdapterLM, "forward", forward_and_move)
    cfg = tiny_recipe("adapter.enabled=true", "adapter.exit_layer=2", "optim.max_steps=2")
    run_training(cfg)
    with safe_open(str(Path(cfg.checkpoint.output_dir) / "adapter.safetensors"), framework="pt") as f:
        assert json.loads(f.metadata()["provenance"])["commit"] == "run-start"


def _no_gpu_device() -> list[list[str]]:
    import torch

    return [] if torch.cuda.is_available() else [["--device", "cuda"]]


@pytest.mark.parametrize("bad, says", [
    (["--threads", "-1"], "--threads must be an integer in [1, "), (["--threads", "0"], "--threads must be"),
    (["--seed", str(2**64)], "--seed must be in [0, 2**63)"), (["--seed", "-1"], "--seed must be in"),
    (["--device", "tpu"], "unknown device 'tpu'"), (["--dtype", "fp8"], "invalid choice: 'fp8'"),
    *[(d, "CUDA is not available") for d in _no_gpu_device()],
])
def test_the_shared_model_flags_are_checked_as_every_command_checks_them(tiny_model_dir, tmp_path, capsys, bad, says):
    """Issue 67 item 12: --threads -1, a 2**64 seed, --device tpu and cuda without a GPU ended in tracebacks; they
    are the CLI's shared flags now (``ModelSettings``), refused in one line before the output folder is made."""
    try:
        code = _generate(tiny_model_dir, tmp_path / "data", *bad)
    except SystemExit as e:  # argparse's own refusals (a dtype that is no choice) exit at once, with code 2 too
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert not (tmp_path / "data").exists()


def test_an_out_under_a_file_and_a_thread_count_past_the_machine_are_one_line(tiny_model_dir, tmp_path, capsys):
    """--out below a file was a NotADirectoryError traceback; --threads 100000 ended in SIGSEGV (after a misleading
    'interrupted'), so it runs in its own process here."""
    import subprocess
    import sys

    (tmp_path / "file").write_text("x")
    assert _generate(tiny_model_dir, tmp_path / "file" / "data") == 2
    err = capsys.readouterr().err
    assert "--out" in err and "cannot create it" in err and len(err.strip().splitlines()) == 1, err
    argv = ["--model", str(tiny_model_dir), "--out", str(tmp_path / "data"), "--threads", "100000"]
    proc = subprocess.run([sys.executable, "-m", "train.self_distill", *argv], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 2 and "--threads must be an integer in [1, " in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "data").exists()
