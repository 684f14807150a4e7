"""The colocated schedule's phase changes: what the processes sharing the devices do between phases.

Into a training phase: every generation actor sleeps (it starts no generation; with GPUs its engine
frees its KV cache and its weights, ``actors/sleep.py``), then the learner ranks reload their
optimizer states. Into a generation phase: the learner ranks offload their states (GPUs only:
DeepSpeed's ``offload_states``, the cache given back), then every actor wakes with the version just
published (weights' memory, the version loaded into it, then the KV cache). A CPU learner offloads
nothing (the memory is the same); the actors still take their turns.

A dead actor is skipped: the pool replaces it, and a replacement that starts during training is put
to sleep (``joined``). One that cannot be reached is not: it may still hold the devices the learner is
about to take back, so the phase change fails and says so (a SIGTERM to every process of a job no longer
makes actors unreachable: only the driver acts on it, ``schema/process.py``). Every call has the deadline
``timeout_s``.
"""

from __future__ import annotations

import asyncio


class NoTurns:
    """The turns of processes that share nothing (the loop alone, in tests): nothing to do between phases."""

    async def generation(self, version: int) -> None:
        pass

    async def training(self) -> None:
        pass

    async def end(self) -> None:
        pass


class DeviceTurns:
    """``actors()``: the generation actors' handles now (a replaced one included); ``learner``: the
    ``LearnerGroup``; ``offload``: whether the learner moves its states to host memory while the
    engines generate."""

    def __init__(self, actors, learner, offload: bool, timeout_s: float):
        self.actors, self.learner, self.offload, self.timeout_s = actors, learner, offload, timeout_s
        self.generating = False  # built, the learner holds its states: the first phase offloads them

    async def generation(self, version: int) -> None:
        """Learner states out, engines in with policy ``version`` (at least)."""
        if self.generating:
            return
        if self.offload:
            await asyncio.wait_for(self.learner.offload_states(), self.timeout_s)
        await self._every_actor("wake", version)
        self.generating = True

    async def training(self) -> None:
        """Engines out, learner states in (also when an engine fails to sleep: the error path checkpoints)."""
        if not self.generating:
            return
        self.generating = False
        try:
            await self._every_actor("sleep")
        finally:
            if self.offload:
                await asyncio.wait_for(self.learner.reload_states(), self.timeout_s)

    async def end(self) -> None:
        """The run is over: an actor asleep with prompts it took stops waiting for a wake."""
        await self._every_actor("end_turns")

    async def joined(self, actor) -> None:
        """A replacement ``actor`` started (awake): asleep too, if the others are."""
        if not self.generating:
            await self._call([actor], "sleep")

    async def _every_actor(self, method: str, *args) -> None:
        await self._call(self.actors(), method, *args)

    async def _call(self, actors: list, method: str, *args) -> None:
        calls = [getattr(actor, method).remote(*args) for actor in actors]
        try:
            results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), self.timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(
                f"the generation actors did not {method} within {self.timeout_s:g} s (run.startup_timeout_s); "
                "their logs say where they stand"
            ) from None
        import ray

        for index, result in enumerate(results):
            if isinstance(result, ray.exceptions.ActorDiedError):
                continue  # dead (its memory freed): the pool replaces it (``joined``)
            if isinstance(result, BaseException):
                raise RuntimeError(f"actor {index} could not {method}: {type(result).__name__}: {result}") from result
