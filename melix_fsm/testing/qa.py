"""A `melix-fsm qa` session without mlx: the exactness hunt, the distribution property, one report.

Rules of this module:
- `run_session` takes `make_generator(temperature)` (a fresh generator per call;
  temperature 0.0 for exactness), the greedy reference, and, for the distribution
  property, `probs_of` (melix_fsm.testing.distribution) and a sampling temperature.
  `make_generator` may be None for sampling: the report then says why the property did
  not run (`distribution_note`), it never passes silently.
- Exactness: `hunt_bugs` (every distinct bug, shrunk). Lifecycle events are checked when
  the generator reports them (`last_report`), which the report states.
- Distribution: `draws` continuations of `length` tokens after one prompt, tested by
  `check_distribution`; a failure becomes a `Bug` whose schedule is one `sample`
  operation (prompt, draws, length, temperature, alpha), replayable like the others.
  A signature in the skip list is reported as skipped, not as a bug.
- `replay_schedule` re-runs any bug's schedule (operations of the driver, or a `sample`
  operation) and returns the ConformanceError it raises, or None when it passes.
- The report is plain data (`as_dict`, JSON-able) and text (`text()`); `exit_code` is 0
  when no bug was found, 1 otherwise (usage errors, 2, are the command's business).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .distribution import DistributionResult, Probabilities, check_distribution, draw_continuations
from .driver import ConformanceDriver
from .hunt import Bug, HuntResult, hunt_bugs
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

    @property
    def bugs(self) -> list[Bug]:
        return self.hunt.bugs + ([self.distribution_bug] if self.distribution_bug else [])

    @property
    def exit_code(self) -> int:
        return 1 if self.bugs else 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "settings": self.settings,
            "lifecycle_events_checked": self.events_checked,
            "exactness": {
                "rounds": self.hunt.rounds,
                "examples": self.hunt.examples,
                "skipped": self.hunt.skipped,
            },
            "distribution": self.distribution.as_dict() if self.distribution else None,
            "distribution_note": self.distribution_note,
            "bugs": [b.as_dict() for b in self.bugs],
            "verdict": "fail" if self.bugs else "pass",
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
            f"exactness: {self.hunt.rounds} round(s), {self.hunt.examples} examples, profile "
            f"{s.get('profile')}, seed {s.get('seed')}; {len(self.hunt.bugs)} distinct bug(s)"
            + (f"; skipped {', '.join(self.hunt.skipped)}" if self.hunt.skipped else ""),
        ]
        lines.append(_distribution_line(self))
        if self.distribution is not None:
            for p in self.distribution.positions:
                lines.append(
                    f"  position {p.position}: G = {p.g:.1f}, df {p.df} ({p.groups} prefix groups, "
                    f"{p.draws} draws), p = {p.p_value:.3g}; "
                    f"mean-probability z = {p.z:.2f}, p = {p.z_p_value:.3g}"
                )
        for i, bug in enumerate(self.bugs, 1):
            lines += [
                "",
                f"bug {i}: {bug.signature}"
                + ("  (flaky: did not fail again on replay)" if bug.flaky else ""),
                f"  {bug.prop}: {PROPERTIES[bug.prop]}",
                f"  {bug.detail}",
                f"  schedule ({bug.found_ops} operation(s) found, {len(bug.schedule)} after shrinking; "
                "save this line to a file and pass it to --replay):",
                "  " + json.dumps(bug.schedule),
            ]
        lines += ["", f"verdict: {'FAIL' if self.bugs else 'pass'} ({len(self.bugs)} distinct bug(s))"]
        return "\n".join(lines)


def _distribution_line(report: QaReport) -> str:
    s = report.settings
    if report.distribution_note:
        return f"distribution: not run ({report.distribution_note})"
    verdict = "FAIL" if report.distribution_bug else "pass"
    return (
        f"distribution: {verdict} at temperature {s.get('temperature')}, {s.get('draws')} draws of "
        f"{s.get('length')} tokens after prompt {s.get('prompt')}, false-alarm rate alpha {s.get('alpha')}"
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
) -> QaReport:
    """Run exactness and distribution for one target (see the module rules).

    `settings` must hold seed, skip, temperature, draws, length, prompt and alpha; it is
    copied into the report. `hunt_options` go to `hunt_bugs`.
    """
    reference = memoized(reference)
    events = as_surface(make_generator(0.0), surface).report() is not None
    hunt = hunt_bugs(
        lambda: make_generator(0.0),
        reference,
        seed=settings["seed"],
        skip=list(settings.get("skip", ())),
        surface=surface,
        **hunt_options,
    )
    report = QaReport(dict(settings), events, hunt)
    temperature = float(settings.get("temperature", 0.0))
    if temperature <= 0:
        report.distribution_note = "temperature 0: pass --temperature T > 0"
    elif sampling_note:
        report.distribution_note = sampling_note
    elif probs_of is None:
        report.distribution_note = "no target probabilities to compare with"
    else:
        op = {
            "op": "sample",
            "prompt": list(settings["prompt"]),
            "draws": int(settings["draws"]),
            "max_tokens": int(settings["length"]),
            "temperature": temperature,
            "alpha": float(settings["alpha"]),
        }
        result, err = _sample(op, make_generator, probs_of, surface)
        report.distribution = result
        if err is not None:
            sig = signature_of(err)
            if skipped(sig, report.hunt.skipped):
                report.distribution_note = f"{sig} skipped"
            else:
                report.distribution_bug = Bug(sig, err.prop, err.detail, [op], 1, settings["seed"])
    return report


def _sample(
    op: Mapping[str, Any], make_generator: GeneratorMaker, probs_of: Probabilities, surface: str
) -> tuple[DistributionResult | None, ConformanceError | None]:
    try:
        draws = draw_continuations(
            make_generator(float(op["temperature"])),
            op["prompt"],
            int(op["draws"]),
            int(op["max_tokens"]),
            surface=surface,
        )
        return check_distribution(draws, probs_of, op["prompt"], alpha=float(op["alpha"])), None
    except ConformanceError as err:
        return None, err


def replay_schedule(
    schedule: Sequence[Mapping[str, Any]],
    make_generator: GeneratorMaker,
    reference: Reference,
    *,
    probs_of: Probabilities | None = None,
    surface: str = "auto",
) -> ConformanceError | None:
    """Re-run one bug's schedule on fresh generators: its ConformanceError, or None."""
    if schedule and schedule[0].get("op") == "sample":
        if probs_of is None:
            raise ValueError("a sample operation needs the target's probabilities")
        return _sample(schedule[0], make_generator, probs_of, surface)[1]
    driver = ConformanceDriver(make_generator(0.0), memoized(reference), surface=surface)
    try:
        driver.run(schedule)
    except ConformanceError as err:
        return err
    return None


def schedules_in(document: Any) -> list[list[dict[str, Any]]]:
    """The schedules in a --replay file: a list of operations, a bug, or a whole JSON report."""
    if isinstance(document, dict) and "bugs" in document:
        return [b["schedule"] for b in document["bugs"]]
    if isinstance(document, dict) and "schedule" in document:
        return [document["schedule"]]
    if isinstance(document, list) and all(isinstance(op, dict) and "op" in op for op in document):
        return [document]
    raise ValueError("expected a list of operations, a bug ({'schedule': ...}) or a qa --json report")


__all__ = ["QaReport", "replay_schedule", "run_session", "schedules_in"]
