"""Bounded FIFO queues with backpressure: the prompt queue and the results queue.

One small interface, two backends chosen by ``build_queue``:
- ``"ray"``: the queue lives in a tiny async Ray actor, so generation actors on any
  node can put and get; a full queue makes ``put`` wait (backpressure).
- ``"local"``: a thread-safe in-process queue with the same methods, for tests that run
  one component alone.
Every wait has a deadline: ``put`` raises ``QueueTimeout`` when the queue stays full,
``get_batch`` returns an empty list when it stays empty. Waits are woken by the change
they wait for, never by polling. ``close()`` ends the queue: every waiting and later
``put``/``get_batch`` raises ``QueueClosed`` at once (items still inside are abandoned), which
is how the actors learn that the run is over.

A consumer may name itself (``taker``) when it takes items; the queue then remembers the
``prompt_id`` of what each taker took recently, so that when a consumer dies the driver can
tell which prompts it was holding (``taken_by``) and have them generated again.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from typing import Any

from schema.process import ignore_sigterm


class QueueTimeout(TimeoutError):
    """A put found the queue full for longer than its deadline."""


class QueueClosed(RuntimeError):
    """The queue was closed: the run is over for its producers and consumers."""


TAKEN_MEMORY = 65536


class _Deque:
    """The queue's state and its blocking rules, shared by both backends."""

    def __init__(self, maxsize: int):
        if maxsize < 1:
            raise ValueError(f"queue maxsize must be >= 1, got {maxsize}")
        self.maxsize = maxsize
        self.items: collections.deque = collections.deque()
        self.closed = False
        self.taken: dict[str, collections.deque] = {}  # taker -> prompt ids it took, newest last

    def can_put(self, n: int) -> bool:
        return self.closed or len(self.items) + n <= self.maxsize or not self.items

    def can_get(self) -> bool:
        return self.closed or len(self.items) > 0

    def take(self, max_items: int, taker: str | None = None) -> list:
        n = min(max_items, len(self.items))
        batch = [self.items.popleft() for _ in range(n)]
        if taker is not None:
            # bounded: a consumer holds a few hundred prompts at most; older ones are long trained
            record = self.taken.setdefault(taker, collections.deque(maxlen=TAKEN_MEMORY))
            record.extend(item.prompt_id for item in batch if hasattr(item, "prompt_id"))
        return batch

    def taken_by(self, taker: str) -> list[int]:
        """The prompt ids ``taker`` took (the most recent ``TAKEN_MEMORY``); forgets them."""
        return list(self.taken.pop(taker, ()))

    def prompt_ids(self) -> list[int]:
        """The prompt ids of the items waiting in the queue."""
        return [item.prompt_id for item in self.items if hasattr(item, "prompt_id")]


class _RayQueueActor:
    """Runs inside a Ray actor (async, so waiting calls do not block each other). Results are
    ``(ok, value)``: ``ok`` False means the queue is closed."""

    def __init__(self, maxsize: int):
        ignore_sigterm()  # a SIGTERM to every process of a job is the driver's to act on
        self.state = _Deque(maxsize)
        self.changed = asyncio.Condition()

    async def put_many(self, items: list, timeout: float) -> tuple[bool, bool]:
        """(open, stored)."""
        async with self.changed:
            try:
                await asyncio.wait_for(self.changed.wait_for(lambda: self.state.can_put(len(items))), timeout)
            except asyncio.TimeoutError:
                return True, False
            if self.state.closed:
                return False, False
            self.state.items.extend(items)
            self.changed.notify_all()
            return True, True

    async def get_batch(self, max_items: int, timeout: float, taker: str | None = None) -> tuple[bool, list]:
        async with self.changed:
            try:
                await asyncio.wait_for(self.changed.wait_for(self.state.can_get), timeout)
            except asyncio.TimeoutError:
                return True, []
            if self.state.closed:
                return False, []
            batch = self.state.take(max_items, taker)
            self.changed.notify_all()
            return True, batch

    async def close(self) -> None:
        async with self.changed:
            self.state.closed = True
            self.changed.notify_all()

    def size(self) -> int:
        return len(self.state.items)

    def taken_by(self, taker: str) -> list[int]:
        return self.state.taken_by(taker)

    def prompt_ids(self) -> list[int]:
        return self.state.prompt_ids()


def _closed(name: str) -> QueueClosed:
    return QueueClosed(f"the {name} queue is closed")


def _full(name: str, timeout: float) -> QueueTimeout:
    return QueueTimeout(f"{name} queue stayed full for {timeout:.0f}s; is its consumer alive?")


class RayQueue:
    """Handle to a queue actor; picklable, so it can be passed to other Ray actors."""

    def __init__(self, name: str, maxsize: int, actor_options: dict | None = None):
        import ray

        self.name = name
        options = {"num_cpus": 0, "max_concurrency": 1000, **(actor_options or {})}
        self._actor = ray.remote(_RayQueueActor).options(**options).remote(maxsize)

    def _put_result(self, result: tuple[bool, bool], timeout: float) -> None:
        open_, stored = result
        if not open_:
            raise _closed(self.name)
        if not stored:
            raise _full(self.name, timeout)

    def _get_result(self, result: tuple[bool, list]) -> list:
        open_, batch = result
        if not open_:
            raise _closed(self.name)
        return batch

    def put_many(self, items: list, timeout: float) -> None:
        import ray

        self._put_result(ray.get(self._actor.put_many.remote(list(items), timeout)), timeout)

    async def put_many_async(self, items: list, timeout: float) -> None:
        self._put_result(await self._actor.put_many.remote(list(items), timeout), timeout)

    def get_batch(self, max_items: int, timeout: float, taker: str | None = None) -> list:
        import ray

        return self._get_result(ray.get(self._actor.get_batch.remote(max_items, timeout, taker)))

    async def get_batch_async(self, max_items: int, timeout: float, taker: str | None = None) -> list:
        return self._get_result(await self._actor.get_batch.remote(max_items, timeout, taker))

    async def close(self) -> None:
        await self._actor.close.remote()

    async def taken_by(self, taker: str) -> list[int]:
        return await self._actor.taken_by.remote(taker)

    async def prompt_ids(self) -> list[int]:
        return await self._actor.prompt_ids.remote()

    def size(self) -> int:
        import ray

        return ray.get(self._actor.size.remote())


class LocalQueue:
    """The same queue for one process (threads), used when a component runs alone."""

    def __init__(self, name: str, maxsize: int):
        self.name = name
        self._state = _Deque(maxsize)
        self._changed = threading.Condition()

    def put_many(self, items: list, timeout: float) -> None:
        with self._changed:
            if not self._changed.wait_for(lambda: self._state.can_put(len(items)), timeout):
                raise _full(self.name, timeout)
            if self._state.closed:
                raise _closed(self.name)
            self._state.items.extend(items)
            self._changed.notify_all()

    async def put_many_async(self, items: list, timeout: float) -> None:
        await asyncio.to_thread(self.put_many, items, timeout)

    def get_batch(self, max_items: int, timeout: float, taker: str | None = None) -> list:
        with self._changed:
            self._changed.wait_for(self._state.can_get, timeout)
            if self._state.closed:
                raise _closed(self.name)
            batch = self._state.take(max_items, taker)
            self._changed.notify_all()
            return batch

    async def get_batch_async(self, max_items: int, timeout: float, taker: str | None = None) -> list:
        return await asyncio.to_thread(self.get_batch, max_items, timeout, taker)

    async def taken_by(self, taker: str) -> list[int]:
        with self._changed:
            return self._state.taken_by(taker)

    async def prompt_ids(self) -> list[int]:
        with self._changed:
            return self._state.prompt_ids()

    def close_now(self) -> None:
        with self._changed:
            self._state.closed = True
            self._changed.notify_all()

    async def close(self) -> None:
        self.close_now()

    def size(self) -> int:
        with self._changed:
            return len(self._state.items)


def build_queue(backend: str, name: str, maxsize: int, actor_options: dict | None = None) -> Any:
    """Make a bounded queue: ``backend`` is ``"ray"`` (``actor_options``: where its actor runs) or ``"local"``."""
    if backend == "ray":
        return RayQueue(name, maxsize, actor_options)
    if backend == "local":
        return LocalQueue(name, maxsize)
    raise ValueError(f"unknown queue backend {backend!r}; use 'ray' or 'local'")
