"""Small builders of typed messages for tests."""

from __future__ import annotations

import random

import numpy as np

from queues.messages import Trajectory, TrajectoryGroup
from tests.reference_batch import TrainSequence
from tests.standins import deepspeed_engine


def make_sequence(rng: random.Random, prompt_len: int, completion_len: int, vocab: int = 56) -> TrainSequence:
    return TrainSequence(
        prompt_token_ids=[rng.randrange(4, vocab) for _ in range(prompt_len)],
        completion_token_ids=[rng.randrange(4, vocab) for _ in range(completion_len)],
        completion_mask=[1] * completion_len,
        advantages=[rng.uniform(-1, 1)] * completion_len,
        sampler_logprobs=[-1.0] * completion_len,
        policy_versions=[0] * completion_len,
    )


def make_trajectory(prompt: list[int], completion: list[int], reward: float, version: int = 0, **extra) -> Trajectory:
    n = len(completion)
    return Trajectory(
        prompt_token_ids=np.array(prompt, dtype=np.int32),
        completion_token_ids=np.array(completion, dtype=np.int32),
        completion_mask=np.ones(n, dtype=np.uint8),
        sampler_logprobs=np.full(n, -0.5, dtype=np.float32),
        policy_versions=np.full(n, version, dtype=np.int32),
        reward=reward,
        finish_reason=extra.pop("finish_reason", "stop"),
        completion_text="x" * n,
        **extra,
    )


def make_group(
    prompt_id: int, rewards: list[float], version: int = 0, completion_len: int = 3, seed: int = 0
) -> TrajectoryGroup:
    """A scored group; each completion has its own random tokens (identical ones would cancel)."""
    rng = random.Random(seed * 1000 + prompt_id)
    trajs = [
        make_trajectory([5, 6], [rng.randrange(4, 56) for _ in range(completion_len)], r, version) for r in rewards
    ]
    return TrajectoryGroup(prompt_id=prompt_id, row={"prompt": "12"}, trajectories=trajs, actor_name="test")


# --- in-process stand-ins for Ray actors and DeepSpeed engines -------------------------------
class FakeRef:
    """What ``.remote()`` returns: awaitable, and resolved when passed to another call (as Ray does
    with a top-level ObjectRef argument)."""

    def __init__(self, task):
        self.task = task

    def __await__(self):
        return self.task.__await__()


class _Method:
    def __init__(self, target, name: str, num_returns: int = 1, calls: list | None = None):
        self.target, self.name, self.num_returns, self.calls = target, name, num_returns, calls

    def options(self, num_returns: int = 1):
        return _Method(self.target, self.name, num_returns, self.calls)

    def remote(self, *args, **kwargs):
        import asyncio

        async def call():
            resolved = [await a if isinstance(a, FakeRef) else a for a in args]
            out = getattr(self.target, self.name)(*resolved, **kwargs)
            if self.calls is not None:
                self.calls.append((self.name, resolved, out))
            return out

        task = asyncio.ensure_future(call())
        if self.num_returns == 1:
            return FakeRef(task)

        async def part(i):
            return (await task)[i]

        return tuple(FakeRef(asyncio.ensure_future(part(i))) for i in range(self.num_returns))


class AsyncRemote:
    """An async function called as a Ray actor method is: ``method.remote(*args)`` starts it and returns
    an awaitable."""

    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        import asyncio

        return asyncio.ensure_future(self.fn(*args))


class LocalActor:
    """An object whose methods are called like a Ray actor's: ``actor.method.remote(*args)``.
    ``calls`` records (method, arguments, result) for tests that look at what crossed."""

    def __init__(self, target, calls: list | None = None):
        self._target, self._calls = target, calls

    def __getattr__(self, name: str):
        return _Method(self._target, name, calls=self._calls)


# A ZeRO-0 DeepSpeed engine over a model with torch's AdamW, as ``RankStep`` drives it: built from DeepSpeed's
# own ``DeepSpeedEngine`` (``tests/standins.py``), so a call the real engine does not take fails here too.
PlainEngine = deepspeed_engine


class RecordingAdmission:
    """Admission as the batch collector sees it (``runtime/admission.py``), recording what it is told:
    the groups too stale to train, the groups left out without a signal. With ``pace``, each frees a place."""

    def __init__(self, pace=None, stale_ok: bool = True, no_signal_ok: bool = True):
        self.pace, self.stale_ok, self.no_signal_ok = pace, stale_ok, no_signal_ok
        self.stale: list[int] = []  # prompt ids
        self.left_out: list[int] = []

    def is_new(self, group: TrajectoryGroup) -> bool:
        return True

    def in_batch(self, group: TrajectoryGroup) -> None:
        pass

    async def too_stale(self, group: TrajectoryGroup) -> bool:
        assert self.stale_ok, f"group {group.prompt_id} was found too stale"
        self.stale.append(group.prompt_id)
        if self.pace is not None:
            await self.pace.drop()
        return False

    async def no_signal(self, group: TrajectoryGroup) -> None:
        assert self.no_signal_ok, f"group {group.prompt_id} was left out as without signal"
        self.left_out.append(group.prompt_id)
        if self.pace is not None:
            await self.pace.drop()


class FakeStarter:
    """An actor starter as the actor pool uses it (``launch/assemble.py``): each started loop is the next of
    ``loops``; each started actor is ``new-<index>``, recorded in ``started``."""

    def __init__(self, loops):
        self.loops, self.started = iter(loops), []

    def name(self, index: int) -> str:
        return f"actor-{index}"

    async def start(self, index: int):
        self.started.append(index)
        return f"new-{index}"

    def run_loop(self, actor, index: int):
        return next(self.loops)
