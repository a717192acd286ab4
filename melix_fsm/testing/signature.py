"""Bug signatures: what makes two failures the same bug, so one run can report each once.

Rules of this module:
- A signature is (property, exception type, location), written
  `property:ExceptionType@location` (`-` for the exception when the generator raised
  nothing). It is plain text so users can pass it back (`--skip`).
- Location: for `generator_raised`, the innermost frame of the generator's traceback
  outside this kit, as `file.py:function` (no line number, so a signature survives
  unrelated edits); for `tokens_match_reference`, whether the first wrong token was the
  request's first token (the prefill path) or a later one (the decode path); for every
  other property, the operation it failed in (`insert`, `step`, `remove`).
- A skip pattern matches a signature when it equals it or, as a shell-style glob
  (`fnmatch`), matches its text: `generator_raised:*` skips every crash.
- Wrong-token locations may carry trigger contexts after the path (", ragged insert",
  ", joined running batch": melix_fsm.testing.tokens). A known wrong-tokens signature
  `covers` every one with the same path and at least its contexts: a bug known to need
  a join is the same bug when the failing request was also ragged.
- Pure core: no mlx, no Hypothesis.
"""

from __future__ import annotations

import fnmatch
import os
import traceback
from collections.abc import Iterable
from dataclasses import dataclass

from .mirror import PROPERTIES, ConformanceError

_KIT_DIR = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True)
class Signature:
    prop: str
    exception: str
    location: str

    def __str__(self) -> str:
        return f"{self.prop}:{self.exception}@{self.location}"

    @classmethod
    def parse(cls, text: str) -> Signature:
        """The inverse of `str()`; raises ValueError on text that is not a signature."""
        head, sep, location = text.partition("@")
        prop, sep2, exception = head.partition(":")
        if not (sep and sep2) or prop not in PROPERTIES or not exception or not location:
            raise ValueError(f"{text!r} is not a bug signature (property:ExceptionType@location)")
        return cls(prop, exception, location)


def signature_of(err: ConformanceError) -> Signature:
    """The signature of a kit failure (see the module rules)."""
    cause = err.__cause__
    if err.prop == "generator_raised" and cause is not None:
        return Signature(err.prop, type(cause).__name__, raise_location(cause))
    return Signature(err.prop, "-", err.where or "-")


def raise_location(exc: BaseException) -> str:
    """`file.py:function` of the innermost traceback frame outside this kit."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not _in_kit(f.filename)]
    if not frames:
        return "-"
    frame = frames[-1]
    return f"{os.path.basename(frame.filename)}:{frame.name}"


def _in_kit(filename: str) -> bool:
    return os.path.dirname(os.path.abspath(filename)) == _KIT_DIR


def _contexts(location: str) -> tuple[str, frozenset[str]]:
    path, *contexts = location.split(", ")
    return path, frozenset(contexts)


def covers(known: Signature, signature: Signature) -> bool:
    """Whether `known` names the same bug as `signature` (equal, or by contexts: module rules)."""
    if known == signature:
        return True
    if (known.prop, known.exception) != (signature.prop, signature.exception):
        return False
    if known.prop != "tokens_match_reference":
        return False
    path, contexts = _contexts(known.location)
    other_path, other_contexts = _contexts(signature.location)
    return path == other_path and contexts <= other_contexts


def same_cause(a: Signature, b: Signature) -> bool:
    """Whether two signatures name one root cause, as far as the evidence goes.

    Crashes: only the same signature. Wrong tokens: one covers the other (the same path,
    a trigger context more or less), or both name the same non-empty trigger contexts
    (one trigger, seen on the prefill's token and on a decoded one).
    """
    if covers(a, b) or covers(b, a):
        return True
    if a.prop != "tokens_match_reference" or b.prop != a.prop:
        return False
    contexts_a, contexts_b = _contexts(a.location)[1], _contexts(b.location)[1]
    return bool(contexts_a) and contexts_a == contexts_b


def skipped(signature: Signature, patterns: Iterable[str]) -> bool:
    """Whether any skip pattern names this signature (exactly, as a glob, or covering it)."""
    text = str(signature)
    for p in patterns:
        if p == text or fnmatch.fnmatchcase(text, p):
            return True
        if not any(c in p for c in "*?["):
            try:
                if covers(Signature.parse(p), signature):
                    return True
            except ValueError:
                continue
    return False


def check_pattern(pattern: str) -> str:
    """Validate a `--skip` pattern: a glob, or else a well-formed signature."""
    if any(c in pattern for c in "*?["):
        prop = pattern.split(":", 1)[0]
        if not any(c in prop for c in "*?[") and prop not in PROPERTIES:
            raise ValueError(f"{pattern!r}: unknown property {prop!r}; choose one of {sorted(PROPERTIES)}")
        return pattern
    return str(Signature.parse(pattern))
