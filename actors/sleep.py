"""An engine's turns in the colocated schedule (``run.schedule: colocated``): asleep while the learner
trains, awake while it generates.

The driver tells every actor ``sleep`` when a generation phase ends and ``wake(version)`` when the
next begins. Asleep, an actor starts no generation (prompts that arrive wait for the wake), and with a
GPU its engine gives its memory back, at the ``level`` chosen once per run (``sleep_level``):

- 0: the engine keeps its memory (a CPU engine: it only stops using its core);
- 1: vLLM offloads the weights to host memory and frees the KV cache.

Level 2 (weights dropped, not copied out) would save that copy when a new version overwrites them
anyway, but an engine woken with no newer version published (a run stopped mid-phase that still
waits for a held-out round) would generate with garbage weights, and a LoRA base must survive: level 1
is right in every case.

Waking goes weights, then the new version, then KV: ``wake_up(["weights"])`` gives the weights their
memory back, the newest published version (at least ``version``) is loaded into it, and only then
does ``wake_up(["kv_cache"])`` allocate the cache, once the learner has offloaded its own states.
"""

from __future__ import annotations

import asyncio
import inspect
from contextlib import asynccontextmanager

from queues.bounded import QueueClosed

CPU, GPU = 0, 1  # the levels: what a colocated engine on each device gives back


def sleep_level(gpu: bool) -> int:
    """The level of a colocated engine: nothing to give back on a CPU."""
    return GPU if gpu else CPU


def check_sleep_mode(level: int) -> None:
    """Raise a one-line error when this vLLM cannot put its engine to sleep at ``level`` (> 0)."""
    if level == CPU:
        return
    import vllm
    from vllm import LLM
    from vllm.platforms import current_platform

    available = getattr(current_platform, "is_sleep_mode_available", lambda: False)
    if not hasattr(LLM, "sleep") or not hasattr(LLM, "wake_up") or not available():
        raise RuntimeError(
            f"run.schedule=colocated with GPU actors needs vLLM's sleep mode, which vLLM {vllm.__version__} on "
            f"{type(current_platform).__name__} does not offer: install a vLLM with sleep mode for this device "
            "(CUDA, ROCm, XPU; vLLM >= 0.7.3) or set run.schedule=overlapped"
        )


class Turns:
    """Whether the engine may generate now (``awake``), and the engine's use (``busy``): a generate call
    holds it, so a sleep waits for the call to end and no call starts on a sleeping engine."""

    def __init__(self, level: int):
        self.level = level
        self.awake = asyncio.Event()
        self.awake.set()  # an actor starts awake: the first phase, or a replacement mid-phase
        self.busy = asyncio.Lock()
        self.ended = False  # the run is over: prompts taken while asleep are not generated

    def end(self) -> None:
        """The run is over: whatever waits for the wake stops waiting (``turn`` raises ``QueueClosed``)."""
        self.ended = True
        self.awake.set()

    @asynccontextmanager
    async def turn(self):
        """Held while generating; entered only while awake (prompts taken during training wait here)."""
        while True:
            await self.awake.wait()
            if self.ended:
                raise QueueClosed("the run ended while this actor slept")
            await self.busy.acquire()
            if self.awake.is_set():
                break
            self.busy.release()  # a sleep came between the wake-up and the lock
        try:
            yield
        finally:
            self.busy.release()

    @asynccontextmanager
    async def asleep(self):
        """No generation from now on; entered once the running one has ended."""
        self.awake.clear()
        async with self.busy:
            yield


def sleep_kwargs(sleep_fn) -> dict:
    """``mode="keep"`` where the async engine's ``sleep`` takes it (vLLM >= 0.32): a request still running
    (a held-out round's, or one admitted late in the phase) is kept, not aborted, and after the wake it is
    recomputed under the new weights, its later tokens tagged with the new version."""
    try:
        return {"mode": "keep"} if "mode" in inspect.signature(sleep_fn).parameters else {}
    except (TypeError, ValueError):
        return {}
