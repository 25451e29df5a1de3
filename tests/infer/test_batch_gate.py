"""The batch's gate: per number of running rows, drafting measured against plain steps and kept only where it beats
them (measured tokens per second of the batch's cycles, injected here); a new B starts from what the measured B
imply for it."""

import random

import pytest

from infer.decode.batch_gate import BACKOFF, PROBE, RECHECK, SCOUT, SURE, BatchGate, CycleDetail, Line


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


def simulate(gate: BatchGate, rows: int, cycles: int, verify: tuple[float, float], draft: float, acceptance: float,
             own_k: int = 6, seed: int = 0) -> list[int | None]:
    """``cycles`` cycles of ``rows`` rows on a machine whose verification of T tokens takes a + b T seconds and one
    draft forward over the rows ``draft`` seconds, each drafted token accepted with probability ``acceptance``: the
    gate sees each cycle's detail as a ``BatchEngine`` shows it. Returns each cycle's draft length (None: plain)."""
    rng, a, b, ks = random.Random(seed), *verify, []
    for _ in range(cycles):
        if not gate.drafts(rows):
            seconds = a + b * rows
            gate.record(rows, rows, seconds, False, CycleDetail(0.0, seconds, rows, 0, 0, 0))
            ks.append(None)
            continue
        k = min(gate.cap(rows) or own_k, own_k)
        accepted = [next((j for j in range(k) if rng.random() >= acceptance), k) for _ in range(rows)]
        rest = a + b * rows * (k + 1)
        detail = CycleDetail(k * draft, rest, rows * (k + 1), k, sum(accepted), sum(x + (x < k) for x in accepted))
        gate.record(rows, sum(x + 1 for x in accepted), k * draft + rest, True, detail)
        ks.append(k)
    return ks


def test_where_no_draft_length_pays_the_scout_ends_the_probe():
    """Verification that grows steeply with rows (a CPU core at B = 8: 16 rows cost 1.9 plain cycles): the two
    scout cycles at k = 1 are the only drafting; the model finds no k that pays and the wait doubles."""
    gate, warm = BatchGate(), PROBE["plain"]
    ks = simulate(gate, 8, warm + SCOUT + 2 * RECHECK, verify=(0.01, 0.007), draft=0.02, acceptance=0.85)
    assert ks[:warm] == [None] * warm and ks[warm:warm + SCOUT] == [1] * SCOUT
    assert ks[warm + SCOUT:] == [None] * (2 * RECHECK)
    assert gate.fit.best(8)[0] == 0 and gate.choices[8].recheck == 2 * RECHECK


def test_where_drafting_pays_the_model_picks_a_longer_draft_and_keeps_it():
    """A flat verification (memory-bound: 4 rows or 24 cost about alike): after the scout, drafts of several tokens,
    kept after the probe since they beat plain steps; k follows the model's best."""
    gate, warm = BatchGate(), PROBE["plain"]
    ks = simulate(gate, 4, 60, verify=(0.05, 0.002), draft=0.004, acceptance=0.85)
    assert ks[warm:warm + SCOUT] == [1] * SCOUT
    assert all(k is not None and k >= 3 for k in ks[warm + SCOUT:warm + SCOUT + RECHECK])
    assert gate.choices[4].mode == "draft" and gate.fit.best(4)[1] > 1.5


def test_a_new_batch_size_starts_from_the_models_prediction():
    """Once the model can predict, a B seen for the first time starts where it predicts, at its k, without timing
    plain steps first; at a larger B where verification costs more the same model chooses plain steps."""
    gate = BatchGate()
    simulate(gate, 4, 30, verify=(0.05, 0.002), draft=0.004, acceptance=0.85)
    three = gate.choice(3)
    assert three.mode == "draft" and three.cap >= 3 and not three.probing
    steep = BatchGate()
    simulate(steep, 4, 30, verify=(0.01, 0.007), draft=0.02, acceptance=0.6)
    assert steep.choice(8).mode == "plain"


def test_the_verification_line_needs_two_sizes():
    line = Line()
    line.add(8, 0.06)
    assert line.at(8) is None  # one size: no slope to extrapolate with
    line.add(16, 0.10)
    assert line.at(24) == pytest.approx(0.14) and line.at(8) == pytest.approx(0.06)


def _memory(path, writable=True):
    from infer.decode.batch_gate import check_batch_memory
    from infer.drafters.gate import GateMemory

    return GateMemory(path, writable).sibling("batch", check_batch_memory)


def test_a_remembered_batch_size_starts_in_its_mode_without_a_probe(tmp_path):
    """What the gate learned is kept (``save``) and the next command's gate starts each remembered B in the mode and
    at the cap it ended in, for its recheck interval, its cost model restored: no scout at B = 8, drafts at once at
    B = 4, and a B never seen predicted from the remembered fit."""
    first = BatchGate(memory=_memory(tmp_path / "early_exit-abc.json"))
    assert first.start_state == "cold"
    simulate(first, 8, 40, verify=(0.05, 0.002), draft=0.1, acceptance=0.85)  # drafting loses at B = 8
    simulate(first, 4, 40, verify=(0.05, 0.002), draft=0.004, acceptance=0.85)  # and pays at B = 4
    assert first.choices[8].mode == "plain" and first.choices[4].mode == "draft"
    first.save()
    assert (tmp_path / "early_exit-abc-batch.json").exists()
    second = BatchGate(memory=_memory(tmp_path / "early_exit-abc.json"))
    assert second.start_state.startswith("warm from") and str(tmp_path) in second.start_state
    assert second.fit.best(4) == pytest.approx(first.fit.best(4)) and second.fit.best(8)[0] == 0
    recheck = first.choices[8].recheck
    assert simulate(second, 8, recheck, verify=(0.05, 0.002), draft=0.1, acceptance=0.85) == [None] * recheck
    assert second.choices[4].mode == "draft" and second.choices[4].cap == first.choices[4].cap
    assert not second.choice(3).probing


def test_a_damaged_or_read_only_batch_memory(tmp_path, capsys):
    """A damaged file is named in one line and not trusted (a cold gate; this run's state replaces it); a read-only
    memory (a benchmark's warm start) is read and never written; without a memory nothing is kept."""
    path = tmp_path / "quant_self-abc-batch.json"
    path.write_text('{"format": "layerskip-gate/1", "batch": {"choices": {"8": {"mode": "fast"}}, "fit": {}}}\n')
    gate = BatchGate(memory=_memory(tmp_path / "quant_self-abc.json"))
    assert "gate memory" in capsys.readouterr().err and gate.start_state == "cold" and not gate.choices
    simulate(gate, 8, 12, verify=(0.01, 0.007), draft=0.02, acceptance=0.85)
    gate.save()
    saved = path.read_text()
    assert '"fast"' not in saved
    reader = BatchGate(memory=_memory(tmp_path / "quant_self-abc.json", writable=False))
    assert reader.start_state.startswith("warm from") and 8 in reader.choices
    simulate(reader, 8, 40, verify=(0.01, 0.007), draft=0.002, acceptance=0.85)
    reader.save()
    assert path.read_text() == saved
    BatchGate().save()  # no memory: nothing to keep, nothing written


def test_without_a_queue_the_slowest_row_sets_the_pace():
    """The slowest of B rows falls behind the mean advance M by about z_B s sqrt(n) over n cycles (a sum of i.i.d.
    advances); with a queue, or one row, or certain acceptance, the mean; a long horizon tends to it."""
    from infer.decode.batch_gate import slowest_row_tokens
    from infer.model.plan import iid_tokens_per_cycle

    mean = iid_tokens_per_cycle(0.63, 1)
    assert slowest_row_tokens(0.63, 1, 8, None) == slowest_row_tokens(0.63, 1, 1, 61) == pytest.approx(mean)
    assert slowest_row_tokens(0.63, 1, 8, 61) == pytest.approx(1.524, abs=1e-3)  # 6.5% below M = 1.63
    assert slowest_row_tokens(0.63, 1, 8, 61) < slowest_row_tokens(0.63, 1, 4, 61) < mean
    assert slowest_row_tokens(0.63, 1, 8, 10**6) == pytest.approx(mean, rel=1e-3)
    assert slowest_row_tokens(1.0, 3, 8, 61) == 4.0 and slowest_row_tokens(0.0, 3, 8, 61) == 1.0


def test_a_marginal_draft_is_declined_where_the_slowest_row_ends_the_batch():
    """Drafting at k = 1 that beats plain steps by ~7% on the mean advance: with a queue the gate drafts on; with no
    prompt waiting and 61 tokens left the slowest of 8 rows leaves it no gain, and the gate returns to plain steps."""
    warm = PROBE["plain"]
    machine = dict(verify=(0.04, 0.00375), draft=0.008, acceptance=0.75, own_k=1)
    queued = BatchGate()
    ks = simulate(queued, 8, warm + 6, **machine)
    assert queued.fit.best(8)[0] == 1 and queued.fit.best(8)[1] > 1.05 and ks[warm:] == [1] * 6
    alone = BatchGate(horizon=61)
    ks = simulate(alone, 8, warm + 6, **machine)
    assert alone.fit.best(8, 61)[0] == 0 and ks[:warm + SCOUT] == [None] * warm + [1] * SCOUT
    assert ks[-3:] == [None] * 3 and alone.choices[8].mode == "plain"


def test_the_first_cycle_after_a_prefill_stays_out_of_the_verification_line():
    from infer.decode.batch_gate import CostFit

    fit = CostFit()
    fit.add(8, CycleDetail(0.0, 0.09, 8, 0, 0, 0, cold=True))  # the caches cold after the prompts' forward
    fit.add(8, CycleDetail(0.0, 0.07, 8, 0, 0, 0))
    fit.add(8, CycleDetail(0.016, 0.098, 16, 1, 5, 8))
    assert fit.verify.at(8) == pytest.approx(0.07) and fit.verify.at(16) == pytest.approx(0.098)


def test_a_probe_where_no_row_drafts_ends_at_once():
    """Drafting cycles in which every row's drafter declined (its own cost model: dynamic exit's) end the probe:
    plain steps again, the wait doubled."""
    gate, warm = BatchGate(), PROBE["plain"]
    modes = []
    for _ in range(warm + 1 + RECHECK):
        drafting = gate.drafts(8)
        gate.record(8, 8, 0.07, drafting, CycleDetail(0.0, 0.07, 8, 0, 0, 0))  # nothing drafted either way
        modes.append(drafting)
    assert modes == [False] * warm + [True] + [False] * RECHECK
    assert gate.choices[8].mode == "plain" and gate.choices[8].recheck == 2 * RECHECK
