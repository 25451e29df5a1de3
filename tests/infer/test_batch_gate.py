"""The batch's gate: per number of running rows, drafting measured against plain steps and kept only where it beats
them (measured tokens per second of the batch's cycles, injected here); a new B starts from what the measured B
imply for it."""

from infer.decode.batch_gate import BACKOFF, PROBE, RECHECK, SURE, BatchGate


def run(gate: BatchGate, rows: int, cycles: int, plain_tps: float, draft_tps: float) -> list[bool]:
    """``cycles`` cycles of ``rows`` rows at the given speeds (tokens per cycle: rows plain, 2 rows drafting)."""
    modes = []
    for _ in range(cycles):
        drafting = gate.drafts(rows)
        tokens = 2 * rows if drafting else rows
        gate.record(rows, tokens, tokens / (draft_tps if drafting else plain_tps), drafting)
        modes.append(drafting)
    return modes


def test_drafting_that_loses_at_this_batch_size_stops_after_its_probe_and_backs_off():
    gate = BatchGate()
    warm, probe = PROBE["plain"], PROBE["draft"]
    modes = run(gate, 8, 400, plain_tps=100.0, draft_tps=80.0)
    assert modes[:warm + probe] == [False] * warm + [True] * probe  # plain steps timed first, then drafting
    assert not any(modes[warm + probe:warm + probe + 2 * RECHECK])  # the probe lost: twice the wait for the next
    assert modes[warm + probe + 2 * RECHECK:warm + 2 * probe + 2 * RECHECK] == [True] * probe
    # each probe that changes nothing doubles the wait (BACKOFF caps it): probes at cycles 3, 73 and 207 of 400
    assert sum(modes) == 3 * probe and gate.choices[8].recheck == RECHECK * BACKOFF == 8 * RECHECK
    assert gate.summary()[8]["mode"] == "plain"


def test_drafting_that_pays_is_kept_and_plain_steps_are_rechecked():
    gate = BatchGate()
    warm, probe = PROBE["plain"], PROBE["draft"]
    modes = run(gate, 4, warm + probe + RECHECK + warm, plain_tps=100.0, draft_tps=150.0)
    assert modes == [False] * warm + [True] * (probe + RECHECK) + [False] * warm  # plain steps timed again
    summary = gate.summary()[4]
    assert summary["mode"] == "draft" and summary["draft_tps"] == 150.0 and summary["plain_tps"] == 100.0


def test_a_new_batch_size_starts_from_its_nearest_measured_one():
    gate = BatchGate()
    run(gate, 8, 20, plain_tps=100.0, draft_tps=80.0)  # drafting loses at B = 8
    assert run(gate, 7, 5, plain_tps=90.0, draft_tps=60.0) == [False] * 5  # the tail does not probe again at once
    gate = BatchGate()
    run(gate, 8, 20, plain_tps=100.0, draft_tps=150.0)  # drafting pays at B = 8
    assert run(gate, 6, 5, plain_tps=90.0, draft_tps=150.0) == [True] * 5


def test_a_probe_that_clearly_loses_ends_early():
    gate = BatchGate()
    warm = PROBE["plain"]
    modes = run(gate, 8, warm + 2 * RECHECK, plain_tps=100.0, draft_tps=50.0)
    assert modes[:warm + SURE] == [False] * warm + [True] * SURE and not any(modes[warm + SURE:])
    assert gate.summary()[8]["mode"] == "plain" and gate.choices[8].recheck == 2 * RECHECK
