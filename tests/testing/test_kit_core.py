"""The kit's own contract: imports without mlx, the mirror's verdicts, the report shape, replay.

Rules of this file:
- No mlx anywhere: hand-built StepReports exercise each mirror property, and the pure
  toy generator (toy_generator.py) runs the whole Hypothesis machine in milliseconds.
- Each failing case asserts the property named, the uid and, for lifecycle misses, the
  state and the event in the message.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import settings

from melix_fsm import lifecycle as lc
from melix_fsm.counters import Counters
from melix_fsm.report import InvalidReport, RowReport, StepReport, validate_report
from melix_fsm.testing import (
    PROFILES,
    PROPERTIES,
    ConformanceDriver,
    ConformanceError,
    ReportMirror,
    RequestSpec,
    allowed_emissions,
    cut_at_stop,
    make_conformance_machine,
    profile_settings,
    replay,
    run_conformance,
)

from .toy_generator import ToyGenerator, ToyMixesRows, toy_reference, toy_stops


def test_import_needs_no_mlx() -> None:
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('mlx', 'mlx_lm'):\n"
        "            raise ImportError('mlx is blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import melix_fsm.testing, melix_fsm.testing.pytest_plugin\n"
        "assert not [m for m in sys.modules if m.startswith('mlx')]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_profiles() -> None:
    assert PROFILES["deep"].max_examples >= 2000
    assert profile_settings("quick") is PROFILES["quick"]
    with pytest.raises(ValueError, match="unknown conformance profile"):
        profile_settings("nope")
    with pytest.raises(ValueError, match="unknown conformance property"):
        ConformanceError("made_up", "x")


def test_cut_at_stop_includes_the_completing_token() -> None:
    assert cut_at_stop((5, 6, 7, 8), [(6, 7)]) == (5, 6, 7)
    assert cut_at_stop((5, 6, 7, 8), [(9,), (8,)]) == (5, 6, 7, 8)
    assert cut_at_stop((5, 6), []) == (5, 6)


def test_allowed_emissions() -> None:
    events = [lc.draft(3), lc.VERIFY, lc.verified(2)]
    assert allowed_emissions(events, joined=False) == 3
    assert allowed_emissions([lc.ADMIT], joined=True) == 1
    assert allowed_emissions([lc.PLAIN_STEP], joined=False) == 1


def _join(uid: int = 0) -> StepReport:
    return StepReport(rows=[RowReport(uid=uid, events=[lc.ADMIT], emitted=[9])], joined=[uid], order=[uid])


def _cycle(uid: int, drafts: int, accepted: int, emitted: list[int], **kw: object) -> RowReport:
    events = [lc.draft(drafts), lc.VERIFY, lc.verified(accepted)]
    return RowReport(uid=uid, events=events, emitted=emitted, **kw)


def test_mirror_accepts_a_legal_history() -> None:
    m = ReportMirror()
    m.observe(_join(0), finished=[])
    m.observe(
        StepReport(
            rows=[_cycle(0, 2, 1, [1, 2]), RowReport(uid=1, events=[lc.REFUSE], emitted=[5])],
            joined=[1],
            order=[0, 1],
        ),
        finished=[],
    )
    last = RowReport(uid=1, events=[lc.PLAIN_STEP, lc.FINISH], emitted=[6])
    m.observe(StepReport(rows=[_cycle(0, 1, 1, [3, 4]), last], left=[1], order=[0]), finished=[1])
    assert m.uids == [0]
    assert m.batch.row(0).counters.emitted == 4  # decode steps only: the join token is not counted


def _fails(prop: str, *reports: StepReport, finished: list | None = None) -> str:
    m = ReportMirror()
    with pytest.raises(ConformanceError) as info:
        for r in reports:
            m.observe(r, finished=finished)
    assert info.value.prop == prop, str(info.value)
    assert prop in str(info.value)
    return str(info.value)


def test_illegal_event_names_uid_state_and_event() -> None:
    bad = StepReport(rows=[RowReport(uid=0, events=[lc.VERIFY], emitted=[])], order=[0])
    text = _fails("legal_transitions", _join(0), bad)
    assert "uid 0" in text and "'verify'" in text and "'admitted'" in text


def test_accepting_more_than_pending_is_illegal() -> None:
    _fails("legal_transitions", _join(0), StepReport(rows=[_cycle(0, 1, 2, [1, 2, 3])], order=[0]))


def test_emitting_a_rejected_draft_is_caught() -> None:
    text = _fails(
        "emitted_matches_events", _join(0), StepReport(rows=[_cycle(0, 2, 0, [1, 2, 3])], order=[0])
    )
    assert "allow exactly 1" in text


def test_counters_must_match_events() -> None:
    wrong = Counters(proposed=2, pending=0, accepted=2, cycles=1, emitted=3)
    text = _fails(
        "counters_agree", _join(0), StepReport(rows=[_cycle(0, 2, 1, [1, 2], counters=wrong)], order=[0])
    )
    assert "accepted: reported 2, events imply 1" in text


def test_reordered_joiners_are_caught() -> None:
    two = StepReport(rows=[RowReport(uid=1, events=[lc.ADMIT], emitted=[1])], joined=[1], order=[1, 0])
    _fails("row_order", _join(0), two)


def test_left_without_finish_is_caught() -> None:
    gone = StepReport(rows=[_cycle(0, 1, 0, [1])], left=[0], order=[])
    _fails("finish_consistency", _join(0), gone)


def test_validate_report() -> None:
    validate_report(_join(0))
    with pytest.raises(InvalidReport, match="not the last rows"):
        validate_report(StepReport(rows=[RowReport(uid=0), RowReport(uid=1)], joined=[0], order=[0, 1]))
    with pytest.raises(InvalidReport, match="twice"):
        validate_report(StepReport(rows=[RowReport(uid=0), RowReport(uid=0)], order=[0]))
    with pytest.raises(InvalidReport, match="order"):
        validate_report(StepReport(rows=[RowReport(uid=0)], left=[0], order=[0]))


TOY = {"make_stops": toy_stops, "tokens": (3, 12), "prompt_lengths": (1, 4), "max_tokens": (1, 8)}


def test_toy_generator_passes() -> None:
    run_conformance(ToyGenerator, toy_reference, settings=settings(PROFILES["quick"], max_examples=60), **TOY)


def test_machine_class_runs_as_a_test_case() -> None:
    machine = make_conformance_machine(ToyGenerator, toy_reference, **TOY)
    machine.TestCase.settings = settings(PROFILES["quick"], max_examples=10)
    machine.TestCase("runTest").runTest()


def test_mixed_rows_are_caught_shrunk_and_replayed() -> None:
    with pytest.raises(ConformanceError) as info:
        run_conformance(
            ToyMixesRows, toy_reference, settings=settings(PROFILES["quick"], database=None), seed=7, **TOY
        )
    err = info.value
    assert err.prop == "tokens_match_reference"
    assert "seed 7" in str(err)
    schedule = json.loads(json.dumps(err.schedule))
    with pytest.raises(ConformanceError) as again:
        replay(schedule, ToyMixesRows, toy_reference, make_stops=toy_stops)
    assert again.value.prop == err.prop
    # the correct generator passes the same schedule
    driver = replay(schedule, ToyGenerator, toy_reference, make_stops=toy_stops)
    assert all(t.status in ("finished", "removed") for t in driver.requests)


def test_driver_records_a_replayable_schedule() -> None:
    d = ConformanceDriver(ToyGenerator(), toy_reference, make_stops=toy_stops)
    (a, b) = d.insert([RequestSpec((3, 4), 3), RequestSpec((5,), 4, stops=((toy_reference((5,), 4)[1],),))])
    d.step()
    d.remove([a])
    d.drain()
    assert [op["op"] for op in d.schedule] == ["insert", "next", "remove", "drain"]
    assert d.requests[b].got == list(cut_at_stop(toy_reference((5,), 4), d.requests[b].spec.stops))
    assert set(PROPERTIES) >= {"tokens_match_reference", "legal_transitions", "row_order"}


def test_conformance_fixture_runs_the_session_profile(conformance) -> None:
    conformance(ToyGenerator, toy_reference, **TOY)
