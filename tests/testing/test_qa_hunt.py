"""The bug hunt on planted generators: every distinct bug found once, shrunk, replayable; no mlx.

Rules of this file:
- planted_generators.py plants the four bug classes the kit found in a real fork. One
  hunt over a generator carrying all four must report four distinct root causes (a
  signature and its variants), each with a short schedule free of redundant
  operations, each replaying to the same bug on the generator with only that bug
  planted and passing on the correct generator. The probe schedules alone find all
  four on every seed tried (the random rounds are not needed for known shapes).
- The correct generator passes; `skip` patterns hide a known bug and nothing else.
- Budgets are small (the whole file takes seconds on an idle machine); the hunt's seeds
  are fixed so a failure here replays exactly.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import settings

from melix_fsm.testing import PROFILES, replay
from melix_fsm.testing.hunt import hunt_bugs, replay_error
from melix_fsm.testing.mirror import ConformanceError
from melix_fsm.testing.signature import Signature, check_pattern, covers, same_cause, signature_of, skipped

from .planted_generators import BUGS, planted
from .toy_generator import toy_reference, toy_stops

TOY = {"make_stops": toy_stops, "tokens": (3, 12), "prompt_lengths": (1, 4), "max_tokens": (1, 8)}
EXPECTED = {
    "crash_when_all_finished": "generator_raised:IndexError@planted_generators.py:next",
    "crash_on_early_remove": "generator_raised:KeyError@planted_generators.py:remove",
    "stale_mask_on_extend": "tokens_match_reference:-@later token, joined running batch",
    "unmasked_left_padding": "tokens_match_reference:-@first token, ragged insert",
}


def cause_of(result: object, bug: str) -> list[object]:
    """The one group of `result.causes` whose signatures name the planted `bug`."""
    expected = Signature.parse(EXPECTED[bug])
    (group,) = [g for g in result.causes if any(same_cause(expected, b.signature) for b in g)]
    return group


def budget(examples: int) -> settings:
    return settings(PROFILES["quick"], max_examples=examples)


@pytest.fixture(scope="module")
def all_four() -> object:
    return hunt_bugs(planted(*BUGS), toy_reference, settings=budget(100), seed=0, **TOY)


def test_one_run_reports_every_distinct_bug_once(all_four: object) -> None:
    found = [str(b.signature) for b in all_four.bugs]
    assert len(set(found)) == len(found), found
    assert len(all_four.causes) == 4, [[str(b.signature) for b in g] for g in all_four.causes]
    for bug in BUGS:
        group = cause_of(all_four, bug)
        assert any(covers(Signature.parse(EXPECTED[bug]), b.signature) for b in group), group


@pytest.mark.parametrize("seed", range(5))
def test_probes_alone_find_all_four_on_every_seed(seed: int) -> None:
    result = hunt_bugs(planted(*BUGS), toy_reference, seed=seed, max_rounds=0, **TOY)
    assert result.rounds == 0 and len(result.causes) == 4, [str(b.signature) for b in result.bugs]
    for bug in BUGS:
        cause_of(result, bug)


@pytest.mark.parametrize("bug", BUGS)
def test_each_bug_is_shrunk_and_replays(all_four: object, bug: str) -> None:
    found = cause_of(all_four, bug)[0]
    schedule = json.loads(json.dumps(found.schedule))  # plain JSON, as a user pastes it
    assert 2 <= len(schedule) <= 5, schedule
    removes = [json.dumps(op) for op in schedule if op["op"] == "remove"]
    assert len(removes) == len(set(removes)), schedule  # no repeated identical removes
    # the same bug on the generator carrying only it, and a pass on the correct one
    err = replay_error(schedule, planted(bug), toy_reference, make_stops=toy_stops)
    assert err is not None and signature_of(err) == found.signature, err
    assert same_cause(Signature.parse(EXPECTED[bug]), found.signature)
    replay(schedule, planted(), toy_reference, make_stops=toy_stops)


def test_left_padding_and_all_finished_shrink_to_their_minimal_schedules(all_four: object) -> None:
    by_sig = {str(b.signature): b.schedule for b in all_four.bugs}
    pad = cause_of(all_four, "unmasked_left_padding")[0].schedule
    assert [op["op"] for op in pad] == ["insert", "next"]
    assert sorted(len(r["prompt"]) for r in pad[0]["requests"]) == [1, 2]  # two lengths, nothing more
    crash = by_sig[EXPECTED["crash_when_all_finished"]]
    assert len(crash) <= 3 and len(crash[0]["requests"]) == 1


def test_correct_generator_passes() -> None:
    result = hunt_bugs(planted(), toy_reference, settings=budget(40), seed=3, **TOY)
    assert result.bugs == [] and result.rounds == 1 and result.examples >= 40


def test_skip_hides_exactly_the_known_bug() -> None:
    crash = EXPECTED["crash_when_all_finished"]
    result = hunt_bugs(
        planted("crash_when_all_finished", "unmasked_left_padding"),
        toy_reference,
        settings=budget(60),
        seed=5,
        skip=[crash],
        **TOY,
    )
    assert [str(b.signature) for b in result.bugs] == [EXPECTED["unmasked_left_padding"]]
    assert result.probes > 0
    assert result.skipped == [crash]
    glob = hunt_bugs(
        planted("crash_on_early_remove"),
        toy_reference,
        settings=budget(40),
        seed=5,
        skip=["generator_raised:*"],
        **TOY,
    )
    assert glob.bugs == []


def test_signatures() -> None:
    sig = Signature("generator_raised", "KeyError", "gen.py:remove")
    assert Signature.parse(str(sig)) == sig
    assert skipped(sig, ["generator_raised:KeyError@gen.py:remove"])
    assert skipped(sig, ["generator_raised:*"]) and not skipped(sig, ["tokens_match_reference:*"])
    with pytest.raises(ValueError, match="not a bug signature"):
        Signature.parse("made_up:X@y")
    with pytest.raises(ValueError, match="unknown property"):
        check_pattern("nonsense:*")
    assert check_pattern("tokens_match_reference:-@first token") == "tokens_match_reference:-@first token"
    # a known trigger covers the same path seen with an extra context, not another path
    join = Signature.parse("tokens_match_reference:-@later token, joined running batch")
    both = Signature.parse("tokens_match_reference:-@later token, ragged insert, joined running batch")
    assert covers(join, both) and not covers(both, join) and skipped(both, [str(join)])
    first = Signature.parse("tokens_match_reference:-@first token, joined running batch")
    assert not covers(join, first) and same_cause(join, first)
    plain = Signature.parse("tokens_match_reference:-@first token")
    assert not same_cause(plain, Signature.parse("tokens_match_reference:-@later token"))


def test_signature_locates_the_generators_frame() -> None:
    with pytest.raises(ConformanceError) as info:
        replay(
            [
                {"op": "insert", "requests": [{"prompt": [3], "max_tokens": 2}]},
                {"op": "next"},
                {"op": "remove", "requests": [0]},
            ],
            planted("crash_on_early_remove"),
            toy_reference,
            make_stops=toy_stops,
        )
    assert str(signature_of(info.value)) == EXPECTED["crash_on_early_remove"]


def test_removing_an_ended_request_never_reaches_the_generator() -> None:
    class Strict(planted()):
        def remove(self, uids: list[int]) -> None:
            assert all(u in {r.uid for r in self.rows} or u in {q[0] for q in self.queue} for u in uids)
            super().remove(uids)

    schedule = [
        {"op": "insert", "requests": [{"prompt": [3], "max_tokens": 1}]},
        {"op": "drain"},
        {"op": "remove", "requests": [0]},
        {"op": "remove", "requests": [0]},
    ]
    driver = replay(schedule, Strict, toy_reference, make_stops=toy_stops)
    assert [op.get("uids") for op in driver.schedule if op["op"] == "remove"] == [[], []]
