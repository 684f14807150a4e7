"""``tandem check-data`` on episodes (``rollout.kind: multi_turn``): the prompt the sampler gets is not the row.

An episode starts from the environment's ``reset(row)`` messages, after ``data.system_prompt`` when they
hold no system message, rendered once by the chat template with the environment's tools
(``actors/episode.py``). This part loads the environment in a child process with its deadlines (as the
start-up check does, ``actors/env_pool.py check_environment``), runs ``reset`` on the rows shown, and
renders each prompt with the actors' own renderer (``TurnRenderer``): its token ids decoded back, counted
against ``engine.max_model_len`` and ``rollout.max_tokens``. It finds a reset that raises, hangs or
returns no messages, a template that ignores the tools, one that cannot append turns, and a prompt that
leaves no room for the episode. ``step()`` and the environment's rewards need the model's turns: they are
not checked here, and the verdict says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from actors.env_pool import EnvironmentCheck
from launch.check_data import SHOWN_CHARS, Findings
from launch.config import TandemConfig


@dataclass
class EpisodeCheck:
    """What the episode part found for the rows shown."""

    lines: list[list[str]] = field(default_factory=list)  # per row shown: what is printed under it
    resets: int = 0  # rows whose reset() gave messages
    rendered: bool = False  # their prompts were rendered and counted (the tokenizer is available offline)
    reward_checked: bool = False  # a reward function part (not only the environment's) scored gold answers

    def verdict(self) -> str:
        """The OK verdict, naming what was not checked."""
        checked = f"the rows load, reset() works for {self.resets} row{'s' * (self.resets != 1)}"
        checked += ", prompts fit" if self.rendered else ""
        checked += ", their own answers earn the reward functions' parts" if self.reward_checked else ""
        unchecked = "the environment's step() and rewards" + ("" if self.rendered else ", the prompts' lengths")
        return f"verdict: OK for what was checked: {checked}; not checked: {unchecked}"


def check_episodes(
    cfg: TandemConfig, model_path: str, check: EnvironmentCheck, shown: int, found: Findings, say: Callable[[str], None]
) -> EpisodeCheck:
    """Say the tools and render the episode prompt of each of the ``shown`` rows from ``check``
    (``check_environment`` of those rows: their resets); problems go to ``found``."""
    from actors.episode_prompt import tool_names, tools_problem
    from launch.preflight import load_episode_tokenizer

    episode = cfg.rollout.episode
    loaded = load_episode_tokenizer(model_path, cfg.data)
    say(
        f"environment: {episode.environment} (rollout.episode.environment); tools: "
        f"{', '.join(tool_names(check.tools)) or 'none'}; an episode's prompt is reset(row)'s messages, after "
        "data.system_prompt when they have no system message, rendered with the tools (the counts above are of "
        "the rows' prompts alone, as the start-up check counts them)"
    )
    result = EpisodeCheck([[] for _ in range(shown)], reward_checked=bool(cfg.reward.function_parts))
    result.rendered = loaded is not None
    if loaded is None:
        found.warnings.append(f"the tokenizer of {model_path} is not available offline: episode prompts not rendered")
    else:
        say(f"episode template: {loaded[1]}")
        if problem := tools_problem(loaded[0], check.tools, episode.environment, loaded[1]):
            found.problems.append(problem)
        _check_appends(loaded[0], check.tools, found)
    for i, (messages, error) in enumerate(check.resets):
        if error is not None:
            result.lines[i].append(f"reset(row) failed: {error}")
            found.problems.append(
                f"row {i}: reset(row) of {episode.environment} failed: {error}; an episode of this row ends at once "
                "(end: error, or timeout when reset hangs) and trains nothing: fix the environment's reset"
            )
            continue
        result.resets += 1
        roles = ", ".join(m["role"] for m in messages)
        result.lines[i].append(f"reset(row): {len(messages)} message(s) ({roles})")
        if loaded is not None:
            result.lines[i] += _prompt_lines(cfg, i, messages, loaded[0], check.tools, found)
    for i in range(len(check.resets), shown):  # after a reset that hung or killed the check's process
        result.lines[i].append("reset(row): not tried (the check's environment process was lost above)")
    return result


def _check_appends(tokenizer, tools: list[dict], found: Findings) -> None:
    """An episode grows by appending the environment's turns: a template that rewrites earlier turns stops
    the actors at start (``MultiTurn.start``); said here first."""
    from actors.episode import TemplateError, TurnRenderer

    try:
        TurnRenderer(tokenizer, tools).delta([tokenizer.eos_token_id], [{"role": "tool", "content": "x"}])
    except TemplateError as exc:
        found.problems.append(str(exc))
    except Exception:  # cannot render at all: tools_problem says so when there are tools; the prompts below too
        pass


def _prompt_lines(
    cfg: TandemConfig, i: int, messages: list[dict], tokenizer, tools: list[dict], found: Findings
) -> list[str]:
    """The episode's prompt as the sampler gets it (its ids decoded back) and its count against the context."""
    from actors.episode import TurnRenderer
    from actors.episode_prompt import with_system_prompt

    try:
        ids = TurnRenderer(tokenizer, tools).prompt(with_system_prompt(messages, cfg.data.system_prompt))
    except Exception as exc:  # the template rejects these messages (a role it does not know, ...)
        why = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
        found.problems.append(f"row {i}: the chat template cannot render reset(row)'s messages ({why})")
        return [f"the chat template cannot render these messages: {why}"]
    length, context, budget = len(ids), cfg.engine.max_model_len, cfg.rollout.max_tokens
    room, turn = context - length, cfg.rollout.episode.turn_max_tokens or budget
    if room < turn:
        found.problems.append(
            f"row {i}: the episode's prompt (tools included) is {length} tokens: engine.max_model_len = {context} "
            f"leaves {max(room, 0)}, less than one model turn (rollout.episode.turn_max_tokens = {turn}), so the "
            "episode ends by length before it answers; raise engine.max_model_len or shorten the prompt or tools"
        )
    elif room < budget:
        found.warnings.append(
            f"row {i}: the episode's prompt (tools included) is {length} tokens: engine.max_model_len = {context} "
            f"leaves {room} of rollout.max_tokens = {budget} for the episode's turns"
        )
    sent = tokenizer.decode(ids, skip_special_tokens=False)
    if len(sent) > SHOWN_CHARS:
        sent = f"{sent[:SHOWN_CHARS]}... ({len(sent) - SHOWN_CHARS} more characters)"
    head = (
        f"sent to the sampler: {length} tokens (the episode's prompt; engine.max_model_len {context} leaves "
        f"{max(room, 0)} for its turns, rollout.max_tokens {budget}), decoded:"
    )
    return [head, *(f"  | {line}" for line in sent.split("\n"))]
