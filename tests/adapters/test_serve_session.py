"""The served request's machine, driven by what the generation thread sends (no model).

One `Submission` per case on a fresh event loop; items are put on its queue exactly as
the generation thread puts them (context, prefill progress tuples, responses, the None
end marker, an exception), and the tracker must walk spec/request.toml's transitions.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("fastapi")

from melix_mlx.serve.limits import ServeLimits  # noqa: E402
from melix_mlx.serve.protocol import Defaults, parse  # noqa: E402
from melix_mlx.serve.request_queue import SpeculativeContext  # noqa: E402
from melix_mlx.serve.session import Aborted, Submission  # noqa: E402
from mlx_lm.server import Response  # noqa: E402

from melix_fsm.request import RequestEvent, RequestState  # noqa: E402


def submission(loop: asyncio.AbstractEventLoop, timeout_s: float = 30.0) -> Submission:
    parsed = parse({"prompt": "hi"}, False, limits=ServeLimits(), vocab=100, names=["m"], defaults=Defaults())
    return Submission(parsed, loop, timeout_s)


def context() -> SpeculativeContext:
    return SpeculativeContext(has_tool_calling=False, has_thinking=False, tool_parser=None, text_sm=None,
                              initial_state="normal", prompt=[1, 2, 3])


def token(finish: str | None = None) -> Response:
    return Response("x", 5, -0.1, finish, ())


async def drive(sub: Submission, items: list[Any]) -> list[str]:
    for item in items:
        sub.queue.items.put_nowait(item)
    await sub.context()
    kinds = []
    async for item in sub.responses():
        kinds.append("progress" if isinstance(item, tuple) else "token")
    return kinds


def path(sub: Submission) -> list[tuple[str, str]]:
    return [(step.event, step.target) for step in sub.tracker.history]


def test_a_request_walks_queued_prefilling_generating_finished() -> None:
    async def main() -> None:
        sub = submission(asyncio.get_running_loop())
        assert sub.state is RequestState.queued
        items = [context(), (32, 96), (64, 96), (96, 96), token(), token(), token("length"), None]
        kinds = await drive(sub, items)
        assert kinds == ["progress"] * 3 + ["token"] * 3
        assert path(sub) == [("start_prefill", "prefilling"), ("prefill_chunk", "prefilling"),
                             ("prefill_chunk", "prefilling"), ("first_token", "generating"),
                             ("token", "generating"), ("token", "generating"), ("complete", "finished")]

    asyncio.run(main())


def test_a_fault_fails_the_request_and_reaches_the_reader() -> None:
    async def main() -> None:
        sub = submission(asyncio.get_running_loop())
        with pytest.raises(RuntimeError, match="boom"):
            await drive(sub, [context(), (3, 3), token(), RuntimeError("boom")])
        assert sub.state is RequestState.failed and path(sub)[-1] == ("fault", "failed")

    asyncio.run(main())


@pytest.mark.parametrize(
    ("event", "before", "final"),
    [
        (RequestEvent.cancel, [], RequestState.cancelled),
        (RequestEvent.cancel, [(3, 9)], RequestState.cancelled),
        (RequestEvent.cancel, [(9, 9), "token"], RequestState.cancelled),
        (RequestEvent.drain, [], RequestState.failed),
        (RequestEvent.drain_timeout, [(9, 9), "token"], RequestState.failed),
    ],
)
def test_an_abort_ends_the_request_once_and_stops_its_context(
    event: RequestEvent, before: list, final: Any
) -> None:
    async def main() -> None:
        sub = submission(asyncio.get_running_loop())
        ctx = context()
        sub.queue.put(ctx)  # as the generation thread does (through the loop)
        await asyncio.sleep(0)
        for item in before:
            sub.queue.items.put_nowait(token() if item == "token" else item)
        await sub.context()
        responses = sub.responses()
        for _ in before:
            await anext(responses)
        assert sub.abort(event, "test")
        assert sub.state is final and ctx.cancelled and sub.parsed.request.cancelled.is_set()
        with pytest.raises(Aborted):
            await anext(responses)
        assert not sub.abort(RequestEvent.cancel, "again")  # a final state is reached once
        sub.queue.items.put_nowait(token())  # a late item of the generation thread is ignored
        assert sub.state is final

    asyncio.run(main())


def test_a_drain_cannot_fail_a_started_request_and_a_queued_one_cannot_time_out() -> None:
    async def main() -> None:
        sub = submission(asyncio.get_running_loop())
        assert not sub.abort(RequestEvent.drain_timeout, "not started")
        await drive(sub, [context(), (3, 3), token("stop"), None])
        assert sub.state is RequestState.finished
        assert not sub.abort(RequestEvent.drain, "finished")

    asyncio.run(main())


def test_a_context_that_arrives_after_a_cancel_is_stopped_at_once() -> None:
    async def main() -> None:
        sub = submission(asyncio.get_running_loop())
        assert sub.abort(RequestEvent.cancel, "the client disconnected")
        ctx = context()
        sub.queue.put(ctx)  # the generation thread had already taken the request
        assert ctx.cancelled

    asyncio.run(main())


def test_the_deadline_cancels_a_waiting_request() -> None:
    async def main() -> None:
        sub = submission(asyncio.get_running_loop(), timeout_s=0.05)
        with pytest.raises(Aborted, match="timed out"):
            await sub.context()
        assert sub.state is RequestState.cancelled

    asyncio.run(main())
