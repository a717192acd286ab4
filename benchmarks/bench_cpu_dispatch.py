"""How much host time mlx's CPU backend leaves un-overlapped: one decode loop, three dispatchers.

    python benchmarks/bench_cpu_dispatch.py --model stdlib-hybrid --regime openblas --repeats 10

Why this exists: on a CPU, `mx.async_eval` does not return once the graph is queued. mlx's
evaluation loop (mlx/transforms.cpp) waits whenever more than MAX_ACTIVE_TASKS = 10
scheduler tasks are outstanding, and the CPU encoder (mlx/backend/cpu/encoder.h) counts
one task per DISPATCHES_PER_TASK = 10 kernels: the caller's thread keeps dispatching until
at most ~100 kernels are left, i.e. until the step is nearly computed. A decode loop that
builds step n + 1 after launching step n (mlx-lm's generate_step, this project's
run-ahead) therefore builds it serially on a CPU; on a GPU the same call returns once the
command buffers are committed. Both constants are compile-time, so nothing in Python
changes them.

The measurement: mlx-lm's own pipelined greedy loop (launch step n + 1, then read token n)
over the same loaded model, with `async_eval` called
- `caller_thread`: on the caller's thread, as mlx-lm does;
- `worker_thread`: from a worker thread, on a stream mlx lets any thread use
  (`mx.new_thread_unsafe_stream`), so the caller builds step n + 1 while the worker is
  still dispatching step n;
- `dispatch_points`: on the caller's thread, and also after every `--dispatch-every`
  layers while a step is built, so each block of layers is built while the block before
  it computes (one thread; the layers' classes are swapped for the run, then restored).
The three alternate (ABBA); the tokens must be identical. Neither alternative is a
decode path this project ships (BENCHMARKS.md, "Ninth round"): with the worker thread
every other evaluation on that stream must wait until the worker is idle (one encoder,
no lock), which mlx-lm's own code does not know to do.

Prints one JSON object: tokens/s of each, each alternative's median ratio to the caller
thread and its min-max.
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable

from melix_mlx.commands.bench import reexec_in_regime


class _Dispatcher:
    """A worker thread that calls `mx.async_eval` for the caller, in submission order."""

    def __init__(self, mx) -> None:
        self._mx = mx
        self._jobs: queue.Queue = queue.Queue()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            arrays, done, failure = self._jobs.get()
            try:
                self._mx.async_eval(*arrays)
            except BaseException as exc:  # handed to the waiting caller
                failure.append(exc)
            done.set()

    def submit(self, *arrays) -> Callable[[], None]:
        """Queue the arrays; the returned call blocks until the worker has dispatched them."""
        done, failure = threading.Event(), []
        self._jobs.put((arrays, done, failure))

        def wait() -> None:
            done.wait()
            if failure:
                raise failure[0]

        return wait


_DISPATCHING: dict[type, type] = {}


def _dispatching(layer_class: type, mx) -> type:
    """`layer_class` whose call also starts evaluating its output (`mx.async_eval`)."""
    if layer_class not in _DISPATCHING:

        def __call__(self, *args, **kwargs):
            out = layer_class.__call__(self, *args, **kwargs)
            mx.async_eval(out)
            return out

        name = f"Dispatching{layer_class.__name__}"
        _DISPATCHING[layer_class] = type(name, (layer_class,), {"__call__": __call__})
    return _DISPATCHING[layer_class]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="stdlib-hybrid")
    parser.add_argument("--regime", choices=["openblas", "reference"], default="openblas")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dispatch-every", type=int, default=4, help="layers between dispatch points")
    args = parser.parse_args()
    reexec_in_regime(args.regime)

    import mlx.core as mx
    from melix_mlx.loading.checkpoints import resolve_model
    from melix_mlx.runtime.hidden import main_parts
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    if mx.default_device().type != mx.DeviceType.cpu:
        sys.exit("this measures mlx's CPU backend; the default device is not a CPU")
    caller_stream = mx.default_stream(mx.cpu)
    shared_stream = mx.new_thread_unsafe_stream(mx.cpu)
    model, tokenizer = load(str(resolve_model(args.model)))
    prompt = mx.array(tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n" * 4))
    dispatcher = _Dispatcher(mx)

    def dispatch_here(*arrays) -> Callable[[], None]:
        """mlx-lm's way: `async_eval` on the caller's thread (it returns when dispatched)."""
        mx.async_eval(*arrays)
        return lambda: None

    def step(y, cache):
        return mx.argmax(model(y[None], cache=cache)[:, -1, :], axis=-1)

    layers = main_parts(model).inner.layers
    plain_classes = [type(layer) for layer in layers]

    def set_dispatch_points(every: int) -> None:
        """Every `every`-th layer (not the last) dispatches its output as it is built."""
        for i, layer in enumerate(layers):
            point = every and (i + 1) % every == 0 and i + 1 < len(layers)
            layer.__class__ = _dispatching(plain_classes[i], mx) if point else plain_classes[i]

    def decode(mode: str) -> tuple[float, list[int]]:
        threaded = mode == "worker_thread"
        mx.set_default_stream(shared_stream if threaded else caller_stream)
        set_dispatch_points(args.dispatch_every if mode == "dispatch_points" else 0)
        try:
            cache = make_prompt_cache(model)
            y = step(prompt, cache)
            mx.eval(y)
            launch = dispatcher.submit if threaded else dispatch_here
            tokens = []
            start = time.perf_counter()
            following = step(y, cache)
            ready = launch(following)
            for _ in range(args.max_tokens):
                current, current_ready = following, ready
                following = step(current, cache)  # built while `current` computes
                ready = launch(following)
                current_ready()
                tokens.append(current.item())
            ready()
            return args.max_tokens / (time.perf_counter() - start), tokens
        finally:
            mx.set_default_stream(caller_stream)
            set_dispatch_points(0)

    modes = ["caller_thread", "worker_thread", "dispatch_points"]
    rates: dict[str, list[float]] = {mode: [] for mode in modes}
    reference: list[int] | None = None
    for r in range(args.repeats):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            tps, tokens = decode(mode)
            reference = tokens if reference is None else reference
            if tokens != reference:
                sys.exit(f"{mode} decoded different tokens")
            rates[mode].append(tps)
    out: dict[str, object] = {
        "model": args.model,
        "regime": args.regime,
        "repeats": args.repeats,
        "layers": len(layers),
        "dispatch_every": args.dispatch_every,
        "identical_tokens": True,
    }
    for mode in modes:
        out[f"{mode}_tps"] = round(statistics.median(rates[mode]), 1)
    for mode in modes[1:]:
        ratios = [a / b for a, b in zip(rates[mode], rates["caller_thread"])]
        out[f"{mode}_over_caller"] = round(statistics.median(ratios), 3)
        out[f"{mode}_min_max"] = [round(min(ratios), 3), round(max(ratios), 3)]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
