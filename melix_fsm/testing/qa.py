"""A `melix-fsm qa` session without mlx: the exactness hunt, the distribution property, one report.

Rules of this module:
- `run_session` takes `make_generator(temperature)` (a fresh generator per call;
  temperature 0.0 for exactness), the greedy reference, and, for the distribution
  property, `probs_of` (melix_fsm.testing.distribution) and a sampling temperature.
  `make_generator` may be None for sampling: the report then says why the property did
  not run (`distribution_note`), it never passes silently.
- Exactness: `hunt_bugs` (every distinct bug, shrunk): the probe schedules, greedy and
  (when the target samples) sampled, then the random rounds. Lifecycle events are
  checked when the generator reports them (`last_report`), which the report states.
- Distribution: `draws` continuations of `length` tokens after one prompt, drawn through
  the generator's crashes (`draw_with_restarts`) and measured position by position; the
  statistics are always in the report, with how many draws each position got. A
  failure becomes a `Bug` whose schedule is one `sample` operation (prompt, draws,
  length, temperature, alpha), replayable like the others. A crash while drawing whose
  signature the hunt already found is the same bug (its entry notes the sampling run);
  a new one is a bug of its own. A signature in the skip list is reported as skipped.
  After a crash, the distribution is inconclusive either way (a failed test is not a bug):
  which draws a crash cuts short may depend on what they drew (an impossible token
  stays a bug: no selection makes it possible).
- Grouping by root cause, where the evidence allows (melix_fsm.testing.signature.
  same_cause): wrong-token signatures that share a trigger context (", ragged insert",
  ", joined running batch") are one cause, reported as one entry with its variants
  (first token / later token); crashes are grouped by signature, and a crash seen by
  the exactness and the sampling run is one entry.
- Divergences: with a `judge` in `hunt_options` (melix_fsm.testing.divergence), every
  wrong token is classified by the reference's margin; near-ties are counted, not
  bugs, and the report gives their rate per 1,000 tokens compared and a histogram of
  gaps (`divergence`); without one, tokens are compared exactly and the report says so.
- `replay_schedule` re-runs any bug's schedule (operations of the driver, a sampled
  schedule, or a `sample` operation) at the schedule's own temperature, and returns the
  ConformanceError it raises, or None when it passes.
- The report is plain data (`as_dict`, JSON-able) and text (`text()`); `exit_code` is 0
  when no bug was found, 1 otherwise (usage errors, 2, are the command's business).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .distribution import (
    DistributionResult,
    Probabilities,
    check_distribution,
    draw_with_restarts,
    measure_distribution,
)
from .divergence import DivergenceLedger
from .hunt import Bug, HuntResult, group_causes, hunt_bugs, replay_error
from .mirror import PROPERTIES, ConformanceError
from .reference import Reference, memoized
from .signature import signature_of, skipped
from .surfaces import as_surface

GeneratorMaker = Callable[[float], Any]


@dataclass
class QaReport:
    settings: dict[str, Any]
    events_checked: bool
    hunt: HuntResult
    distribution: DistributionResult | None = None
    distribution_bug: Bug | None = None
    distribution_note: str = ""
    sampling_crashes: list[Bug] | None = None  # crashes seen only by the distribution run
    divergence: DivergenceLedger | None = None  # the contract's ledger; None: compared exactly

    @property
    def all_bugs(self) -> list[Bug]:
        """Every distinct signature found (variants of one cause included)."""
        extra = list(self.sampling_crashes or []) + ([self.distribution_bug] if self.distribution_bug else [])
        return self.hunt.bugs + extra

    @property
    def causes(self) -> list[list[Bug]]:
        """The bugs grouped by root cause: each group's first bug is its entry, the rest variants."""
        return group_causes(self.all_bugs)

    @property
    def bugs(self) -> list[Bug]:
        return [group[0] for group in self.causes]

    @property
    def exit_code(self) -> int:
        return 1 if self.all_bugs else 0

    def as_dict(self) -> dict[str, Any]:
        bugs = []
        for group in self.causes:
            entry = group[0].as_dict()
            entry["variants"] = [b.as_dict() for b in group[1:]]
            bugs.append(entry)
        return {
            "settings": self.settings,
            "lifecycle_events_checked": self.events_checked,
            "exactness": {
                "probe_schedules": self.hunt.probes,
                "rounds": self.hunt.rounds,
                "examples": self.hunt.examples,
                "skipped": self.hunt.skipped,
            },
            "distribution": self.distribution.as_dict() if self.distribution else None,
            "distribution_note": self.distribution_note,
            "divergence": self.divergence.as_dict() if self.divergence is not None else {"contract": "exact"},
            "bugs": bugs,
            "verdict": "fail" if self.all_bugs else "pass",
        }

    def text(self) -> str:
        s = self.settings
        lines = [
            f"melix-fsm qa: {s.get('target')} on {s.get('model')} (surface {s.get('surface')}; "
            + (
                "lifecycle events checked"
                if self.events_checked
                else "tokens only: the generator reports no events"
            )
            + ")",
            f"exactness: {self.hunt.probes} probe schedule(s), then {self.hunt.rounds} round(s) of "
            f"{s.get('examples_per_round', '?')} examples ({self.hunt.examples} schedules run, shrinking "
            f"included), profile {s.get('profile')}, seed {s.get('seed')}; "
            f"{len(group_causes(self.hunt.bugs))} distinct bug(s)"
            + (f"; skipped {', '.join(self.hunt.skipped)}" if self.hunt.skipped else ""),
        ]
        if self.divergence is not None:
            lines += self.divergence.text_lines("divergences (exactness run)")
        else:
            lines.append("divergences: compared exactly (no contract: every differing token is a bug)")
        lines.append(_distribution_line(self))
        if self.distribution is not None:
            for p in self.distribution.positions:
                lines.append(
                    f"  position {p.position} ({p.reached} draws): G = {p.g:.1f}, df {p.df} "
                    f"({p.groups} prefix groups, {p.draws} draws), p = {p.p_value:.3g}; "
                    f"mean-probability z = {p.z:.2f}, p = {p.z_p_value:.3g}"
                )
        for i, group in enumerate(self.causes, 1):
            lines += ["", *_bug_lines(f"bug {i}", group[0])]
            for variant in group[1:]:
                lines += _bug_lines("  variant (same root cause)", variant, indent="    ")
        n = len(self.causes)
        lines += ["", f"verdict: {'FAIL' if self.all_bugs else 'pass'} ({n} distinct bug(s))"]
        return "\n".join(lines)


def _bug_lines(title: str, bug: Bug, indent: str = "  ") -> list[str]:
    seen = f"  (also seen in: {', '.join(bug.also_seen)})" if bug.also_seen else ""
    return [
        f"{title}: {bug.signature}" + ("  (flaky: did not fail again on replay)" if bug.flaky else "") + seen,
        f"{indent}{bug.prop}: {PROPERTIES[bug.prop]}",
        f"{indent}{bug.detail}",
        f"{indent}schedule ({bug.found_ops} operation(s) found, {len(bug.schedule)} after shrinking; "
        "save this line to a file and pass it to --replay):",
        indent + json.dumps(bug.schedule),
    ]


def _distribution_line(report: QaReport) -> str:
    s = report.settings
    if report.distribution is None:
        return f"distribution: not run ({report.distribution_note})"
    result = report.distribution
    verdict = "FAIL" if report.distribution_bug else "pass"
    if report.distribution_note.startswith("inconclusive"):
        verdict = "inconclusive"
    restarts = f"; the generator crashed {result.crashes} time(s) while drawing" if result.crashes else ""
    note = f"; {report.distribution_note}" if report.distribution_note else ""
    return (
        f"distribution: {verdict} at temperature {s.get('temperature')}, {result.draws} of {s.get('draws')} "
        f"draws of {s.get('length')} tokens after prompt {s.get('prompt')}, false-alarm rate alpha "
        f"{s.get('alpha')}{restarts}{note}"
    )


def run_session(
    make_generator: GeneratorMaker,
    reference: Reference,
    *,
    settings: Mapping[str, Any],
    hunt_options: Mapping[str, Any],
    probs_of: Probabilities | None = None,
    sampling_note: str = "",
    surface: str = "auto",
    progress: Callable[[str, Any], None] | None = None,
) -> QaReport:
    """Run exactness and distribution for one target (see the module rules).

    `settings` must hold seed, skip, temperature, draws, length, prompt and alpha; it is
    copied into the report. `hunt_options` go to `hunt_bugs` (`make_stops` also to the
    distribution run).
    """
    reference = memoized(reference)
    make_stops = hunt_options.get("make_stops")
    events = as_surface(make_generator(0.0), surface, make_stops).report() is not None
    temperature = float(settings.get("temperature", 0.0))
    samples = temperature > 0 and not sampling_note
    hunt = hunt_bugs(
        lambda: make_generator(0.0),
        reference,
        seed=settings["seed"],
        skip=list(settings.get("skip", ())),
        surface=surface,
        sampled_factory=(lambda: make_generator(temperature)) if samples else None,
        sampled_temperature=temperature if samples else None,
        progress=progress,
        **hunt_options,
    )
    judge = hunt_options.get("judge")
    report = QaReport(dict(settings), events, hunt, divergence=judge.ledger if judge is not None else None)
    if temperature <= 0:
        report.distribution_note = "temperature 0: pass --temperature T > 0"
    elif sampling_note:
        report.distribution_note = sampling_note
    elif probs_of is None:
        report.distribution_note = "no target probabilities to compare with"
    else:
        if progress is not None:
            progress("phase", f"distribution ({settings['draws']} draws)")
        _distribution(report, settings, make_generator, probs_of, surface, make_stops)
    return report


def _distribution(
    report: QaReport,
    settings: Mapping[str, Any],
    make_generator: GeneratorMaker,
    probs_of: Probabilities,
    surface: str,
    make_stops: Any,
) -> None:
    op = sample_operation(settings)
    samples, crashes = draw_with_restarts(
        lambda: make_generator(op["temperature"]),
        op["prompt"],
        op["draws"],
        op["max_tokens"],
        surface=surface,
        make_stops=make_stops,
    )
    result = measure_distribution(
        samples, probs_of, op["prompt"], alpha=op["alpha"], positions=op["max_tokens"]
    )
    result.crashes = len(crashes)
    report.distribution = result
    report.sampling_crashes = []
    known = {str(b.signature): b for b in report.hunt.bugs}
    for err in crashes:
        sig = signature_of(err)
        if str(sig) in known:  # one bug, seen by both runs
            if "sampling run" not in known[str(sig)].also_seen:
                known[str(sig)].also_seen.append("sampling run")
        elif skipped(sig, report.hunt.skipped):
            report.distribution_note = f"{sig} skipped"
        else:
            bug = Bug(sig, err.prop, err.detail, [op], 1, settings["seed"], also_seen=["sampling run"])
            report.sampling_crashes.append(bug)
            known[str(sig)] = bug
    try:
        check_distribution(samples, probs_of, op["prompt"], alpha=op["alpha"])
    except ConformanceError as err:
        sig = signature_of(err)
        if skipped(sig, report.hunt.skipped):
            report.distribution_note = f"{sig} skipped"
        elif crashes and err.prop == "sampled_distribution":
            # which draws a crash cut short depends on what they drew: no verdict on a bias
            report.distribution_note = (
                f"inconclusive: {sig} on draws cut short by {len(crashes)} crash(es), which may "
                "select them; fix the crashes and run again"
            )
        else:
            report.distribution_bug = Bug(sig, err.prop, err.detail, [op], 1, settings["seed"])
    if crashes and not report.distribution_bug and not report.distribution_note:
        report.distribution_note = (
            f"inconclusive: the generator crashed {len(crashes)} time(s) while drawing; fix the crashes "
            "and run again"
        )


def sample_operation(settings: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "op": "sample",
        "prompt": list(settings["prompt"]),
        "draws": int(settings["draws"]),
        "max_tokens": int(settings["length"]),
        "temperature": float(settings["temperature"]),
        "alpha": float(settings["alpha"]),
    }


def replay_schedule(
    schedule: Sequence[Mapping[str, Any]],
    make_generator: GeneratorMaker,
    reference: Reference,
    *,
    probs_of: Probabilities | None = None,
    probs_for: Callable[[float], Probabilities] | None = None,
    surface: str = "auto",
    make_stops: Any = None,
    judge: Any = None,
) -> ConformanceError | None:
    """Re-run one bug's schedule on fresh generators at its own temperature: its error, or None.

    `probs_for(T)` gives the target's probabilities at T (a `sample` operation carries
    its T); `probs_of` is the older form, one fixed temperature. `judge`: the divergence
    contract for greedy schedules (None: exact).
    """
    if schedule and schedule[0].get("op") == "sample":
        op = schedule[0]
        probs = probs_for(float(op["temperature"])) if probs_for is not None else probs_of
        if probs is None:
            raise ValueError("a sample operation needs the target's probabilities")
        samples, crashes = draw_with_restarts(
            lambda: make_generator(float(op["temperature"])),
            op["prompt"],
            int(op["draws"]),
            int(op["max_tokens"]),
            surface=surface,
            make_stops=make_stops,
        )
        if crashes:
            return crashes[0]
        try:
            check_distribution(samples, probs, op["prompt"], alpha=float(op["alpha"]))
        except ConformanceError as err:
            return err
        return None
    sampled = schedule[0].get("temperature") if schedule and schedule[0].get("op") == "sampling" else None
    return replay_error(
        schedule,
        lambda: make_generator(0.0),
        memoized(reference),
        sampled_factory=(lambda: make_generator(float(sampled))) if sampled is not None else None,
        surface=surface,
        make_stops=make_stops,
        judge=judge,
    )


def schedules_in(document: Any) -> list[list[dict[str, Any]]]:
    """The schedules in a --replay file: a list of operations, a bug, or a whole JSON report."""
    if isinstance(document, dict) and "bugs" in document:
        out = []
        for bug in document["bugs"]:
            out.append(bug["schedule"])
            out += [v["schedule"] for v in bug.get("variants", [])]
        return out
    if isinstance(document, dict) and "schedule" in document:
        return [document["schedule"]]
    if isinstance(document, list) and all(isinstance(op, dict) and "op" in op for op in document):
        return [document]
    raise ValueError("expected a list of operations, a bug ({'schedule': ...}) or a qa --json report")


__all__ = ["QaReport", "replay_schedule", "run_session", "sample_operation", "schedules_in"]
