"""The multi-turn rollout: episodes of model turns and environment turns, token in, token out.

An episode (``rollout.kind: multi_turn``) starts from the environment's first messages
(``reset(row)``), rendered once with the chat template and the environment's tools. Then, turn by turn:
the engine samples the model's turn from the ids so far (``Engine.sample``), the environment answers
it (``step``, in a worker process, ``actors/env_pool.py``), and the answer's messages are appended as
token ids of their own: the delta the chat template puts after the model's turn, tokenized alone.
History is never re-rendered, so the trajectory is exactly the ids the sampler produced, in order.

The sample's tokens after the prompt and what each carries::

    [model turn 1][env delta 1][model turn 2][env delta 2] ... [model turn k]
    mask      1 ... 1    0 ... 0     1 ... 1    0 ... 0          1 ... 1
    logprobs  sampler's  0.0         sampler's  0.0              sampler's
    versions  sampler's  = previous  sampler's  = previous       sampler's

The episode ends when the environment says ``done``, after ``rollout.episode.max_turns`` model turns,
when the budget ``rollout.max_tokens`` (model and environment tokens) or the engine's context is
spent (finish reason ``length``), or when the environment fails (reason ``timeout``/``error``/``lost``:
the episode stays in its group, with the reward it had, and trains no token). The reward part
``environment`` is the sum of the environment's turn rewards; the reward functions see the whole
transcript.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from actors.env_pool import EnvironmentPool, EpisodeEnded
from actors.rollout import Completion, Engine, Sample
from actors.spec import ActorSpec
from queues.messages import EPISODE_FAILURES, PromptRequest

PROBE_USER, PROBE_ASSISTANT = "U", "A"  # the stand-in conversation the deltas are measured against
# What a probe's assistant turn holds, tried in order: plain, then with reasoning (a template that renders
# the last assistant turn with an empty <think> block, as Qwen3's does, only appends to one that has some).
PROBE_CONTENTS = (PROBE_ASSISTANT, f"<think>\nR\n</think>\n\n{PROBE_ASSISTANT}")


LOGGED_FAILURES = 3  # episodes ended by each failure reason whose line the actor log shows in full


class TemplateError(ValueError):
    """The chat template cannot append a turn without re-rendering the ones before it."""


class TurnRenderer:
    """Token ids of an episode's prompt and of each environment turn, for one tokenizer and tool list."""

    def __init__(self, tokenizer, tools: list[dict]):
        self.tokenizer, self.tools = tokenizer, tools or None
        self.eos_text = tokenizer.decode([tokenizer.eos_token_id]) if tokenizer.eos_token_id is not None else None

    def render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools, add_generation_prompt=generation_prompt, tokenize=False
        )

    def prompt(self, messages: list[dict]) -> list[int]:
        return self.encode(self.render(messages, True))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def delta(self, turn_ids: list[int], observation: list[dict]) -> list[int]:
        """The ids that follow a model turn (``turn_ids``, as sampled) when ``observation`` answers it: what
        closes the model's turn in the template (less the end-of-turn token when the model sampled it),
        the observation's messages, and the opening of the next model turn. A turn that stopped on another
        token (a second stop id, or the length limit) is followed by the template's whole closing."""
        for content in PROBE_CONTENTS:
            probe = [{"role": "user", "content": PROBE_USER}, {"role": "assistant", "content": content}]
            before = self.render(probe, False)
            after = self.render(probe + observation, True)
            if after.startswith(before):
                break
        else:
            raise TemplateError(
                "the chat template renders earlier turns differently once a turn is appended, so an episode cannot "
                "grow token by token; use a template that appends turns (data.chat_template=path.jinja)"
            )
        closing = before[before.rindex(PROBE_ASSISTANT) + len(PROBE_ASSISTANT) :]
        sampled_end = self.tokenizer.decode(turn_ids[-1:]) if turn_ids else ""
        if sampled_end and closing.startswith(sampled_end) and turn_ids[-1] == self.tokenizer.eos_token_id:
            closing = closing[len(sampled_end) :]  # the model closed its turn itself
        return self.encode(closing + after[len(before) :])


@dataclass
class Turn:
    """One turn of an episode, as samples.jsonl and the report show it."""

    role: str  # "model" | "environment"
    text: str
    reward: float = 0.0  # the environment's reward for the model turn before it


@dataclass
class EpisodeRecord:
    turns: list[Turn] = field(default_factory=list)
    end: str = "done"  # done | max_turns | length | timeout | error | lost
    detail: str | None = None
    tool_calls: int = 0
    tool_errors: int = 0
    environment_reward: float = 0.0
    environment_s: float = 0.0
    generate_s: float = 0.0
    turn_ends: list[int] = field(default_factory=list)  # index of each model turn's last token
    turn_rewards: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        """What rides on the trajectory (``Trajectory.episode``)."""
        return {
            "turns": [t.__dict__ for t in self.turns],
            "model_turns": sum(t.role == "model" for t in self.turns),
            "end": self.end,
            "detail": self.detail,
            "tool_calls": self.tool_calls,
            "tool_errors": self.tool_errors,
            "environment_reward": self.environment_reward,
            "environment_s": round(self.environment_s, 4),
            "generate_s": round(self.generate_s, 4),
            "turn_ends": self.turn_ends,
            "turn_rewards": self.turn_rewards,
        }


class MultiTurn:
    """The ``multi_turn`` rollout of one generation actor: its environment workers and its episodes."""

    def __init__(self, spec: ActorSpec, spans=None):
        self.spec, self.cfg, self.spans = spec, spec.rollout.episode, spans  # spans: the actor's timeline
        self.budget = spec.rollout.max_tokens
        self.pool: EnvironmentPool | None = None
        self.failures: dict[str, int] = {}  # episodes ended by each failure (the actor log shows the first ones)

    def start(self, tokenizer) -> None:
        """Use ``data.chat_template`` if one was given, check that the template appends turns (else the
        actor fails to start, saying so), start the environment workers."""
        if self.spec.chat_template is not None:
            tokenizer.chat_template = self.spec.chat_template
        TurnRenderer(tokenizer, []).delta([tokenizer.eos_token_id], [{"role": "tool", "content": "x"}])
        self.pool = EnvironmentPool(self.cfg)
        self.pool.wait_ready()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    async def __call__(self, request: PromptRequest, engine: Engine) -> list[Sample]:
        n = request.samples or self.spec.rollout.group_size
        return list(await asyncio.gather(*[self.episode(request, engine, i) for i in range(n)]))

    async def episode(self, request: PromptRequest, engine: Engine, index: int) -> Sample:
        record = EpisodeRecord()
        try:
            episode, messages, tools = await self._timed(record, self.pool.reset(request.row))
        except EpisodeEnded as ended:  # no episode: one end-of-text token, never trained, keeps the group whole
            record.end, record.detail = ended.reason, ended.detail
            self._log_failure(request, record)
            renderer = TurnRenderer(engine.tokenizer, [])
            prompt = renderer.prompt([{"role": "user", "content": str(request.row.get("prompt", ""))}])
            eos, version = engine.tokenizer.eos_token_id, request.min_version  # admissible: never dropped as stale
            # model_mask 1: the token stands for the episode in its group's baselines, so the reward it got (a
            # reward function's penalty for an empty answer, say) counts there as every other episode's does
            return Sample(prompt, [eos], [0], [0.0], [version], "stop", "", episode=record.summary(), model_mask=[1])
        if self.spec.system_prompt and not (messages and messages[0]["role"] == "system"):
            messages = [{"role": "system", "content": self.spec.system_prompt}, *messages]
        renderer = TurnRenderer(engine.tokenizer, tools)
        prompt = renderer.prompt(messages)
        # the episode's tokens after the prompt: its budget, and what the engine's context has left
        budget = min(self.budget, self.spec.engine.max_model_len - len(prompt))
        ids, mask, logprobs, versions, finish = [], [], [], [], "stop"
        try:
            for turn in range(self.cfg.max_turns):
                left = budget - len(ids)
                if left <= 0:  # the prompt with its tools, and the turns so far, fill the context
                    record.end, finish = "length", "length"
                    break
                limit = min(left, self.cfg.turn_max_tokens or left)
                began = time.monotonic()
                completion: Completion = await engine.sample(prompt + ids, request, limit, turn * 1009 + index)
                record.generate_s += time.monotonic() - began
                ids += completion.token_ids
                mask += [1] * len(completion.token_ids)
                logprobs += completion.logprobs
                versions += completion.versions
                record.turn_ends.append(len(ids) - 1)
                text = engine.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
                record.turns.append(Turn("model", text))
                if completion.finish_reason == "length" and len(ids) >= budget:
                    record.end, finish = "length", "length"
                    break
                result = await self._timed(record, self.pool.step(episode, text))
                record.turns[-1].reward = result.reward
                record.turn_rewards.append(result.reward)
                record.environment_reward += result.reward
                record.tool_calls += int(result.info.get("tool_calls", 0) or 0)
                record.tool_errors += int(result.info.get("tool_errors", 0) or 0)
                if result.done:
                    break
                if turn == self.cfg.max_turns - 1:
                    record.end = "max_turns"
                    break
                observation = result.messages()
                delta = renderer.delta(completion.token_ids, observation)
                if len(ids) + len(delta) >= budget:
                    record.end, finish = "length", "length"
                    break
                record.turns.append(Turn("environment", engine.tokenizer.decode(delta, skip_special_tokens=False)))
                ids += delta
                mask += [0] * len(delta)
                logprobs += [0.0] * len(delta)
                versions += [versions[-1] if versions else 0] * len(delta)
        except EpisodeEnded as ended:
            record.end, record.detail = ended.reason, ended.detail
        except TemplateError as exc:  # an observation this template cannot append (checked at start for one)
            record.end, record.detail = "error", str(exc)
        finally:
            await self.pool.close_episode(episode)
        if record.end in EPISODE_FAILURES:
            self._log_failure(request, record)
        while len(record.turn_rewards) < len(record.turn_ends):  # a last turn the environment never answered
            record.turn_rewards.append(0.0)
        text = engine.tokenizer.decode(ids, skip_special_tokens=True)
        # an episode the environment failed trains no token (its reward says nothing of the model), and
        # stays in its group, as an overlong completion under algorithm.shaping.mask_truncated does
        trained = [0] * len(mask) if record.end in EPISODE_FAILURES else mask
        return Sample(prompt, ids, trained, logprobs, versions, finish, text, episode=record.summary(), model_mask=mask)

    def _log_failure(self, request: PromptRequest, record: EpisodeRecord) -> None:
        """The actor log's line for an episode its environment failed: the first few of each reason in full,
        then every hundredth, with the count (the driver's console says each step's counts)."""
        count = self.failures[record.end] = self.failures.get(record.end, 0) + 1
        if count <= LOGGED_FAILURES or count % 100 == 0:
            print(
                f"[{self.spec.name}] episode of {'held-out ' if request.purpose == 'eval' else ''}prompt "
                f"{request.prompt_id} ended by its environment ({count} so far "
                f"ended {record.end}): {record.end}: {record.detail}",
                flush=True,
            )

    async def _timed(self, record: EpisodeRecord, call):
        """``call`` (a reset or a step), its time counted as the environment's and on the timeline."""
        began, wall = time.monotonic(), time.time()
        try:
            return await call
        finally:
            record.environment_s += time.monotonic() - began
            if self.spans is not None:
                self.spans.add("environment", wall, time.time())
