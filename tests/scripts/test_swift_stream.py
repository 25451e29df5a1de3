"""scripts/swift_stream.py: every repeat's drafters start cold unless a spec says otherwise."""

from swift_stream import cold


def test_stream_drafters_start_cold_unless_the_spec_says_otherwise():
    assert cold("swift:r=0.2").options == {"skip_ratio": 0.2, "remember": "off"}
    assert cold("early_exit:E=2:adaptive=true").config.remember == "off"
    assert cold("swift:remember=on").config.remember == "on"
    assert "remember" not in cold("autoregressive").options
