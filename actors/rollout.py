"""The rollout: from one prompt request to the samples the learner trains on.

A rollout is a function ``(request, engine) -> list[Sample]``. It asks the engine for completions
(``Engine.complete``) and returns one ``Sample`` per completion: the token ids, the loss mask (which
tokens are trained: the policy's own), the sampler's log-probs and the policy version of every
token. The generation actor (``actors/generation.py``) runs rollouts; the reward, the group and
the results queue come after.

``rollout.kind`` chooses one from ``ROLLOUTS``: ``single_turn`` (the prompt, then G completions
sampled whole, every token trained) or ``multi_turn`` (``actors/episode.py``: G episodes, the engine
called once a turn, what the environment returned masked out).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from actors.spec import decode_completions
from queues.messages import PromptRequest


@dataclass
class Completion:
    """One completion as the engine sampled it."""

    token_ids: list[int]  # generated tokens
    logprobs: list[float]  # sampler log-prob of each, after temperature (what the policy sampled from)
    versions: list[int]  # policy version of the weights that sampled each
    finish_reason: str  # "stop" | "length"


@dataclass
class Sample:
    """One completion as the learner will train on it."""

    prompt_token_ids: list[int]
    token_ids: list[int]  # everything after the prompt
    mask: list[int]  # 1: trained (the policy's tokens), 0: not (e.g. a tool's output in an episode)
    logprobs: list[float]  # sampler log-prob of each token
    versions: list[int]  # policy version that produced each token
    finish_reason: str  # "stop" | "length"
    text: str  # decoded completion, special tokens skipped
    episode: dict | None = None  # a multi-turn episode's turns and counts (actors/episode.py)
    model_mask: list[int] | None = None  # an episode's model tokens (1) and environment tokens (0)


class Engine(Protocol):
    """The engine as a rollout sees it (``actors/between_requests.py``, ``actors/inflight.py``)."""

    tokenizer: object

    async def complete(self, request: PromptRequest) -> tuple[list[int], list[Completion]]:
        """The prompt's token ids and its completions (``request.samples`` or the group size of them)."""

    async def sample(self, prompt_ids: list[int], request: PromptRequest, max_tokens: int, salt: int) -> Completion:
        """One completion of ``prompt_ids`` (an episode's turn), at most ``max_tokens``, sampled as ``request``
        says (its temperature); ``salt`` varies its seed within the request."""


async def single_turn(request: PromptRequest, engine: Engine) -> list[Sample]:
    """The prompt and G completions sampled whole; every sampled token is trained."""
    prompt_ids, completions = await engine.complete(request)
    texts = decode_completions(engine.tokenizer, [c.token_ids for c in completions])
    return [
        Sample(prompt_ids, c.token_ids, [1] * len(c.token_ids), c.logprobs, c.versions, c.finish_reason, text)
        for c, text in zip(completions, texts, strict=True)
    ]


class SingleTurn:
    """The ``single_turn`` rollout: nothing to start or close."""

    def __init__(self, spec=None, spans=None):
        pass

    def start(self, tokenizer=None) -> None:
        pass

    def close(self) -> None:
        pass

    async def __call__(self, request: PromptRequest, engine: Engine) -> list[Sample]:
        return await single_turn(request, engine)


def _multi_turn(spec, spans=None):
    from actors.episode import MultiTurn  # its environment workers are started by the actor that uses it

    return MultiTurn(spec, spans)


Rollout = Callable[[PromptRequest, Engine], Awaitable[list[Sample]]]
ROLLOUTS: dict[str, Callable] = {"single_turn": SingleTurn, "multi_turn": _multi_turn}  # rollout.kind -> factory
