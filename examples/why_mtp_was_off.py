"""Reading the receipt to log why MTP was off (or on) for a run.

Every run has one versioned receipt (`melix_fsm.receipt.Receipt`, spec/receipt.schema.json):
`mode` (accepted, legacy_only, refused), a typed `refusal_reason`, a `message`, and, once
the device policy has measured this machine, `hardware_gate` with the figures behind it
(`hardware`: the measured regime, the predicted speedup, the reason). The run's
statistics (`melix_fsm.stats.GenerationStats`) say what actually happened: drafts
proposed and accepted, and the live controller's state. Both serialise with `to_json()`.

Run: python examples/why_mtp_was_off.py [MODEL]   (default: the embedded stdlib-tiny)
"""

from __future__ import annotations

import logging
import sys

from melix_mlx.generate import mtp_stream_generate
from melix_mlx.loading import load_with_heads

log = logging.getLogger("myapp.decode")


def why(receipt, stats) -> str:
    """One line: did this run speculate, and if not, why."""
    if stats.proposed:
        return f"MTP on: {stats.accepted}/{stats.proposed} drafts accepted"
    if receipt.refusal_reason is not None:  # refused, chosen off, or gated off by the device policy
        line = f"MTP off ({receipt.refusal_reason}): {receipt.message}"
        hw = receipt.hardware
        if hw is not None and hw.predicted_speedup is not None:
            line += f" [predicted {hw.predicted_speedup:.2f}x, {hw.measured_regime}, {hw.reason}]"
        return line
    policy = stats.policy
    return f"MTP admitted but not used: the live policy stayed {policy.state if policy else 'off'}"


def run(model, tokenizer, head, **settings) -> tuple[object, object]:
    responses = list(mtp_stream_generate(model, tokenizer, "import sys\n", head, max_tokens=24, **settings))
    return responses[-1].receipt, responses[-1].stats


def main(model_name: str = "stdlib-tiny") -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stdout)
    loaded = load_with_heads(model_name)
    model, tokenizer, head, _ = loaded
    log.info("loaded %s: receipt %s, %s", model_name, loaded.receipt.schema, loaded.receipt.mode)
    for settings in ({"num_draft_tokens": "auto"}, {"device_policy": "force_off"}):
        receipt, stats = run(model, tokenizer, head, **settings)
        log.info("%s -> %s", settings, why(receipt, stats))
        if not stats.proposed:
            assert receipt.refusal_reason is not None or stats.policy is not None, "an off run says why"
    log.debug("full receipt: %s", receipt.to_json().decode())


if __name__ == "__main__":
    main(*sys.argv[1:])
