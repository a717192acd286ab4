"""The Hypothesis side of the kit: a rule-based machine over a ConformanceDriver, and profiles.

Rules of this module:
- `make_conformance_machine` returns a `RuleBasedStateMachine` class whose rules are the
  driver's operations: insert 1-3 requests (random prompt lengths, max_tokens, stop
  sequences taken from the reference's own output or random, and any extra per-request
  insert options the caller draws), `next()` once or a few times, and remove a request
  that is still queued or live (the kit never removes an ended one). Teardown drains
  the generator: every request must then have finished with exactly the reference
  tokens.
- `skip(error) -> bool`: a failure it accepts (a known bug, by signature) does not fail
  the example, so the search goes on past known bugs: a known wrong-tokens failure
  stops the checks of that one request and the example continues (the generator is
  still coherent); any other known failure ends the example quietly.
- All checking lives in the driver and the mirror; this module only draws operations.
  Each failure's message carries the JSON schedule of the shrunk example, and Hypothesis
  prints the same steps as Python calls.
- Profiles: "quick" (the CI default: 30 examples x 15 steps) and "deep" (2000 examples x
  40 steps, the soak). `MELIX_CONFORMANCE_PROFILE` picks the default.
- `run_conformance` seeds every run; the seed is in each failure message and
  `run_conformance(..., seed=N)` replays the search. Under pytest with
  `--hypothesis-seed`, that seed wins.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import hypothesis
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    get_state_machine_test,
    precondition,
    rule,
)

from .divergence import DivergenceJudge
from .driver import ConformanceDriver, RequestSpec, StopBuilder
from .mirror import ConformanceError
from .reference import Reference, memoized, mlx_greedy_reference

_COMMON: dict[str, Any] = {
    "deadline": None,  # real forwards on shared machines: timing is not a property
    "print_blob": True,
    "report_multiple_bugs": False,  # one shrunk counter-example, raised as a ConformanceError
    # no "explain" phase: it traces every line of the generator's forwards and turns a
    # seconds-long shrink into minutes
    "phases": (Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink),
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.filter_too_much],
}
PROFILES: dict[str, settings] = {
    "quick": settings(max_examples=30, stateful_step_count=15, **_COMMON),
    "deep": settings(max_examples=2000, stateful_step_count=40, **_COMMON),
}
PROFILE_ENV = "MELIX_CONFORMANCE_PROFILE"


def profile_settings(profile: str | settings | None = None) -> settings:
    """A profile by name ("quick" / "deep"), a settings object as is, or the env default."""
    if isinstance(profile, settings):
        return profile
    name = profile or os.environ.get(PROFILE_ENV, "quick")
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown conformance profile {name!r}; choose one of {sorted(PROFILES)}") from None


def make_conformance_machine(
    generator_factory: Callable[[], Any],
    reference: Reference,
    *,
    tokens: tuple[int, int] = (3, 255),
    prompt_lengths: tuple[int, int] = (1, 12),
    max_tokens: tuple[int, int] = (1, 10),
    insert_options: Mapping[str, st.SearchStrategy[Any]] | None = None,
    make_stops: StopBuilder | None = None,
    check_events: bool | None = None,
    allow_faults: bool = False,
    name: str = "",
    seed: Any = None,
    surface: str = "auto",
    skip: Callable[[ConformanceError], bool] | None = None,
    counter: list[int] | None = None,
    on_example: Callable[[], None] | None = None,
    judge: DivergenceJudge | None = None,
) -> type[RuleBasedStateMachine]:
    """A RuleBasedStateMachine class checking `generator_factory()` against `reference`.

    tokens / prompt_lengths / max_tokens: inclusive ranges the requests are drawn from.
    insert_options: extra per-request keyword arguments of `insert` (each drawn per
    request and passed as a list), e.g. {"num_draft_tokens": st.integers(1, 3)}; values
    must be plain data so they fit the JSON schedule. `counter`: a one-item list whose
    item counts the examples started (the caller's budget). `judge`: the divergence
    contract (melix_fsm.testing.divergence); None compares tokens exactly.

    Over 80 lines: the class it returns is defined here, closing over these options (what
    Hypothesis's rule-based machines need: rules are class attributes).
    """
    reference = memoized(reference)
    extra = dict(insert_options or {})
    request = st.builds(
        lambda prompt, n, stop_at, noise, options: (prompt, n, stop_at, noise, options),
        st.lists(st.integers(*tokens), min_size=prompt_lengths[0], max_size=prompt_lengths[1]).map(tuple),
        st.integers(*max_tokens),
        # a stop sequence cut from the reference output (so it fires), and sometimes a random one
        st.none() | st.tuples(st.integers(0, max_tokens[1] - 1), st.integers(1, 3)),
        st.none() | st.lists(st.integers(*tokens), min_size=1, max_size=2).map(tuple),
        st.fixed_dictionaries(extra),
    )

    class ConformanceMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            if counter is not None:
                counter[0] += 1
            if on_example is not None:
                on_example()
            self.dead = False  # a skipped (known) bug ended this example
            self.driver = ConformanceDriver(
                generator_factory(),
                reference,
                make_stops=make_stops,
                check_events=check_events,
                allow_faults=allow_faults,
                name=name,
                seed=seed,
                surface=surface,
                known=skip,
                judge=judge,
            )

        def guarded(self, operation: Callable[[], Any]) -> None:
            if self.dead:
                return
            try:
                operation()
            except ConformanceError as err:
                if skip is not None and skip(err):
                    self.dead = True
                    return
                raise

        @rule(batch=st.lists(request, min_size=1, max_size=3))
        def insert(self, batch: list[tuple]) -> None:
            specs = []
            for prompt, n, stop_at, noise, options in batch:
                stops = []
                if stop_at is not None:
                    full = reference(prompt, n)
                    start, length = stop_at
                    if start < len(full):
                        stops.append(tuple(full[start : start + length]))
                if noise is not None:
                    stops.append(noise)
                specs.append(RequestSpec(prompt, n, tuple(stops), options))
            self.guarded(lambda: self.driver.insert(specs))

        @rule()
        def step(self) -> None:
            self.guarded(self.driver.step)

        @rule(n=st.integers(2, 4))
        def steps(self, n: int) -> None:
            for _ in range(n):
                self.guarded(self.driver.step)

        @precondition(lambda self: not self.dead and bool(self.open_requests()))
        @rule(data=st.data())
        def remove(self, data: st.DataObject) -> None:
            index = data.draw(st.sampled_from(self.open_requests()), label="request")
            self.guarded(lambda: self.driver.remove([index]))

        def open_requests(self) -> list[int]:
            return [t.index for t in self.driver.requests if t.status in ("queued", "live")]

        def teardown(self) -> None:
            # after a failure the generator's state is unknown: draining it would only raise a
            # second, misleading error that replaces the first
            if not self.driver.failed:
                self.guarded(self.driver.drain)

    ConformanceMachine.__name__ = ConformanceMachine.__qualname__ = f"Conformance_{_ident(name)}"
    return ConformanceMachine


def run_conformance(
    generator_factory: Callable[..., Any],
    reference: Reference | None = None,
    *,
    models: Mapping[str, Any] | Sequence[Any] | None = None,
    settings: settings | str | None = None,
    seed: int | None = None,
    **machine_options: Any,
) -> None:
    """Run the conformance machine; raise the shrunk `ConformanceError` on a miss.

    Without `models`, `generator_factory()` takes no argument and `reference` is required.
    With `models` (a mapping name -> model, or a sequence), the kit runs once per model
    with `generator_factory(model)` and, unless `reference` is given, mlx-lm's greedy
    decoding of that model as the reference. `settings`: a profile name or a Hypothesis
    settings object. Other keywords go to `make_conformance_machine`.
    """
    chosen = profile_settings(settings)
    longest = machine_options.get("max_tokens", (1, 10))[1]  # one reference run per prompt
    if models is None:
        if reference is None:
            raise ValueError("run_conformance needs a reference decoder, or models to build mlx-lm's")
        targets = [("", generator_factory, reference)]
    else:
        if isinstance(models, Mapping):
            named = list(models.items())
        else:
            named = [(f"model{i}", m) for i, m in enumerate(models)]
        targets = [
            (
                str(label),
                _bind(generator_factory, model),
                reference or mlx_greedy_reference(model, min_tokens=longest),
            )
            for label, model in named
        ]
    for label, factory, ref in targets:
        run_seed = _seed(seed)
        shown = run_seed if run_seed is not None else f"{_forced_seed()} (pytest --hypothesis-seed)"
        machine = make_conformance_machine(factory, ref, name=label, seed=shown, **machine_options)
        test = get_state_machine_test(machine, settings=chosen)
        if run_seed is not None:
            test = hypothesis.seed(run_seed)(test)
        test()


def _bind(factory: Callable[[Any], Any], model: Any) -> Callable[[], Any]:
    return lambda: factory(model)


def _seed(seed: int | None) -> int | None:
    """The seed for one run: the caller's, else None under pytest's --hypothesis-seed, else fresh."""
    if seed is not None:
        return seed
    if _forced_seed() is not None:
        return None  # pytest --hypothesis-seed already fixes (and prints) it
    return random.SystemRandom().randrange(2**32)


def _forced_seed() -> Any:
    return getattr(hypothesis.core, "global_force_seed", None)


def _ident(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name) or "generator"


__all__ = [
    "PROFILES",
    "ConformanceError",
    "make_conformance_machine",
    "profile_settings",
    "run_conformance",
]
