"""``layerskip bench --batch-size``: each method decodes the prompts B at a time (ours through the batched engine,
transformers' generate left-padded at the same B), with total tokens/s, per-row latency, speed-ups at the same B and
against B = 1, and every row judged against that prompt decoded alone."""

import json

import pytest

from infer.measure.report import RECORDS_FILE, rebuild
from layerskip_cli.main import main

PROMPTS = ["def add(a, b):", "The quick brown fox", "x", "import os\nimport sys\n\ndef main():\n    print(sys.argv)"]


@pytest.fixture
def four_prompts(tmp_path):
    """Prompts of very different lengths (rows finish and join at different times; peers left-pad)."""
    path = tmp_path / "four.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


def bench(model, prompts, out, *extra):
    return main(["bench", "--model", str(model), "--drafters", "autoregressive,early_exit:E=2:k=3", "--data",
                 str(prompts), "--n", "4", "--max-new-tokens", "10", "--repeats", "1", "--quality-data", "none",
                 "--out", str(out), "--quiet", *extra])


def test_batched_rows_per_method_and_batch_size_with_the_peer_at_the_same_size(tiny_model_dir, four_prompts,
                                                                                 tmp_path):
    out = tmp_path / "out"
    assert bench(tiny_model_dir, four_prompts, out, "--batch-size", "1,3") == 0
    payload = json.loads((out / "results.json").read_text())
    rows = {(r["method"], r["batch_size"]): r for r in payload["summary"]}
    assert set(rows) == {(m, b) for m in ("autoregressive", "early_exit:E=2:k=3", "hf_generate") for b in (1, 3)}
    for (method, size), row in rows.items():
        assert row["tokens_per_second"] > 0 and row["row_latency"] > 0, method
        assert row["exact_mismatches"] == 0, (method, size)  # every row equals its prompt decoded alone
        assert row["speedup_vs_b1"] == pytest.approx(row["tokens_per_second"] / rows[(method, 1)]["tokens_per_second"])
        ar, hf = rows[("autoregressive", size)], rows[("hf_generate", size)]
        assert row["speedup_vs_autoregressive"] == pytest.approx(row["tokens_per_second"] / ar["tokens_per_second"])
        assert row["speedup_vs_hf_generate"] == pytest.approx(row["tokens_per_second"] / hf["tokens_per_second"])
    assert rows[("early_exit:E=2:k=3", 3)]["acceptance_rate"] is not None
    assert rows[("hf_generate", 3)]["decode_tokens_per_second"] is None  # no prefill time of its own to take out
    assert all(rows[(m, b)]["decode_tokens_per_second"] > 0 for m in ("autoregressive", "early_exit:E=2:k=3")
               for b in (1, 3))
    records = payload["records"]
    assert len(records) == 4 * 2 * 3  # prompts x batch sizes x methods, one repeat
    for r in records:
        assert r["new_tokens"] == 10 and r["exact"] is True and r["batch_size"] in (1, 3)
        run = [x for x in records if (x["method"], x["batch_size"]) == (r["method"], r["batch_size"])]
        assert r["run_wall"] == run[0]["run_wall"] >= r["wall_time"]  # a row's latency within its run
    md = (out / "results.md").read_text()
    assert "#### four, batched" in md and "| early_exit:E=2:k=3 | 3 |" in md and "--batch-size" in md
    assert (out / "batch_tokens_per_second.png").stat().st_size > 1000
    assert not (out / "speedup.png").exists()  # the one-prompt bars have no rows here
    assert rebuild(out) and "batched" in (out / "results.md").read_text()  # from records.jsonl alone
    assert (out / RECORDS_FILE).read_text().count('"batch_size": 3') == 4 * 3


def test_a_batched_row_that_differs_from_its_prompt_alone_is_a_mismatch(tiny_model_dir, four_prompts, tmp_path,
                                                                         monkeypatch, capsys):
    """The per-row check can fail: a batched engine that corrupts one row's token is caught and the bench exits 1."""
    from infer.measure import timing

    real = timing.timed_batch

    def corrupt(engine, prompts, config):
        results, verified, wall = real(engine, prompts, config)
        if len(prompts) > 1 and engine.batch_size > 1:
            results[1].tokens[3] = (results[1].tokens[3] + 1) % 64
        return results, verified, wall

    monkeypatch.setattr("infer.measure.bench.timed_batch", corrupt)
    code = bench(tiny_model_dir, four_prompts, tmp_path / "out", "--batch-size", "1,2", "--peers", "none")
    err = capsys.readouterr().err
    assert code == 1 and "autoregressive at B=2 (1 prompts)" in err and "at B=1" not in err
    rows = {(r["method"], r["batch_size"]): r for r in json.loads((tmp_path / "out" / "results.json").read_text())
            ["summary"]}
    assert rows[("autoregressive", 1)]["exact_mismatches"] == 0 and rows[("autoregressive", 2)]["mismatches"] == 1


@pytest.mark.parametrize(("value", "extra", "message"), [
    ("0", [], "--batch-size '0'"),
    ("4,x", [], "--batch-size '4,x'"),
    ("2,2", [], "distinct integers"),
    ("", [], "--batch-size ''"),
    ("4", ["--peers", "prompt_lookup"], "peer prompt_lookup decodes one sequence"),
])
def test_a_bad_batch_size_is_refused_in_one_line(value, extra, message, tmp_path, capsys):
    code = main(["bench", "--out", str(tmp_path / "o"), "--data", "humaneval", "--model", str(tmp_path / "none"),
                 "--batch-size", value, *extra])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


def test_a_batched_row_is_classified_from_its_own_verification(tiny_model_dir, four_prompts, tmp_path, monkeypatch):
    """Each row's verification argmax comes back from the batched cycles: a row whose acceptance emits another token
    than its verification chose is called an acceptance bug, whatever the margin."""
    import infer.decode.verify

    accept = infer.decode.verify.greedy_accept

    def buggy(tree, tokens, argmax):
        path, bonus = accept(tree, tokens, argmax)
        return path, (bonus + 1) % 256 if len(tokens) > 1 else bonus
    monkeypatch.setattr(infer.decode.verify, "greedy_accept", buggy)
    assert bench(tiny_model_dir, four_prompts, tmp_path / "out", "--batch-size", "3", "--peers", "none") == 1
    records = json.loads((tmp_path / "out" / "results.json").read_text())["records"]
    wrong = [r for r in records if r["exact"] is False]
    assert wrong and all(r["method"].startswith("early_exit") and r["batch_size"] == 3 for r in wrong)
    assert all("acceptance bug" in r["divergence"]["reason"] for r in wrong)
