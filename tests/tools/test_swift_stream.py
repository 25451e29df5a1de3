"""tools/bench/swift_stream.py: every repeat's drafters start cold unless a spec says otherwise."""

from tools.bench.swift_stream import cold


def test_stream_drafters_start_cold_unless_the_spec_says_otherwise():
    assert cold("swift:r=0.2").options == {"skip_ratio": 0.2, "remember": "off"}
    assert cold("early_exit:E=2:adaptive=true").config.remember == "off"
    assert cold("swift:remember=on").config.remember == "on"
    assert "remember" not in cold("autoregressive").options


def test_a_swift_that_scored_no_plan_says_so_instead_of_a_matchness_of_minus_one():
    from tools.bench.swift_stream import markdown

    state = {"plan": "-", "skip_ratio": 0.4, "best_matchness": None, "mode": "plain", "stop_reason": None,
             "predicted_speedup": None}
    entry = {"tokens_per_second": 9.0, "speedup": 0.9, "acceptance_rate": 0.0, "tokens_per_verify": 1.0,
             "opt_time_share": 0.0, "opt_steps": 0, "plain_step_share": 1.0}
    text = markdown({"base": {"tasks": {"t": {"swift": entry}}, "final_state": {"swift": state},
                              "exact": {"swift": [2, 2]}}})
    assert "best matchness none scored" in text and "-1.00" not in text


def test_the_stream_table_gives_acceptance_with_what_was_drafted():
    from tools.bench.swift_stream import markdown

    state = {"plan": "-", "skip_ratio": 0.4, "best_matchness": 0.5, "mode": "draft", "stop_reason": None,
             "predicted_speedup": 1.1}
    entry = {"tokens_per_second": 9.0, "speedup": 0.9, "acceptance_rate": 0.67, "tokens_per_verify": 1.0,
             "opt_time_share": 0.0, "opt_steps": 0, "plain_step_share": 1.0, "drafted": 3, "new_tokens": 128}
    text = markdown({"base": {"tasks": {"t": {"swift": entry}}, "final_state": {"swift": state},
                              "exact": {"swift": [2, 2]}}})
    assert "α (drafted/tokens)" in text and "| 0.67 (3/128) |" in text
