"""OpenAI's n: a request's several choices as engine requests, for the HTTP and gRPC front ends."""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Awaitable, Callable

from gpu_service.api.admission import GenerateInput
from gpu_service.engine.scheduler import Failure
from moe_core.errors import Status

MAX_N = 16  # choices a request may ask for


class Choices:
    """A request's n choices (OpenAI's n), each its own engine request, their events on one queue as (index, event).
    The first goes in at once; the others once its first event came, that is once its prompt's blocks are in the
    prefix cache: they share them (the prompt is prefilled once). Each choice samples with its own generator: seed +
    index where a seed is given. submit: the front end's way in (GenerateInput -> the engine's request and its
    queue)."""

    def __init__(self, submit: Callable[[GenerateInput], Awaitable[tuple]], req: GenerateInput, n: int):
        self.submit, self.req, self.n = submit, req, n
        self.events: asyncio.Queue = asyncio.Queue()
        self.requests: list = []
        self.tasks: list[asyncio.Task] = []
        self.running = n

    def start(self, r, q) -> None:
        """The first choice's request, submitted by the caller (whose errors are the request's)."""
        first = asyncio.get_running_loop().create_future()
        self._add(0, r, q, first)
        if self.n > 1:
            self.tasks.append(asyncio.create_task(self._rest(first)))

    def _add(self, i: int, r, q, first=None) -> None:
        self.requests.append(r)
        self.tasks.append(asyncio.create_task(self._pump(i, q, first)))

    async def _pump(self, i: int, q: asyncio.Queue, first) -> None:
        while True:
            ev = await q.get()
            if first is not None and not first.done():
                first.set_result(None)
            self.events.put_nowait((i, ev))
            if isinstance(ev, Failure) or ev.finish_reason:
                return

    async def _rest(self, first) -> None:
        await first
        seed = self.req.sampling.seed
        for i in range(1, self.n):
            sp = dataclasses.replace(self.req.sampling, seed=None if seed is None else (seed + i) % 2**64)
            try:
                r, q = await self.submit(dataclasses.replace(self.req, sampling=sp))
            except Exception as e:  # noqa: BLE001 (the first was taken: only the service's state can refuse these)
                self.events.put_nowait((i, Failure(Status.UNAVAILABLE, str(e))))
                return
            self._add(i, r, q)

    def cancel(self) -> None:
        for r in self.requests:
            r.cancelled = True
        for t in self.tasks:
            t.cancel()
