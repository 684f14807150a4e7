"""``tandem check-data``: see the data as the run will, before any process starts.

A run that trains on the wrong column, a prompt the tokenizer mangles, or an answer the reward cannot
read still starts, and its first sign is a reward curve that stays at 0 after minutes of start-up.
This command loads the rows exactly as a run does (``launch/data.py``), renders a few prompts exactly
as the sampler gets them (``queues/templates.py``: the token ids, decoded back), counts every prompt's
tokens against ``engine.max_model_len - rollout.max_tokens`` (``launch/preflight.py``), and scores each
shown row's own answer and a wrong one with the reward's parts (``actors/reward_parts.py``), summed
with their weights by the actors' ``RewardScorer``. It never imports Ray or vLLM.

The rewards run in this process's main thread, as in a reward worker (math-verify times itself with
``signal.alarm``); a watchdog thread ends the command if one call outlives ``reward.timeout_s``.

Exit codes: 0 the data looks right; 1 a problem was found (listed under the verdict); 2 the config,
the data or the reward could not be loaded at all (one line, as ``tandem train`` says it).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from launch.config import TandemConfig, load_config

SHOWN_CHARS = 1500  # longest prompt text printed per row; the token count is always of the whole prompt
MATH = "builtin:math"


@dataclass
class Findings:
    """What the check found: problems fail the command (exit 1), warnings are printed and pass."""

    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    verdict: str | None = None  # an OK verdict that says what was not checked (episodes)


def check_data(config: str | list | None, overrides: list[str], n: int = 3, say: Callable[[str], None] = print) -> int:
    """Run the check and print it; the exit code (0 ok, 1 problems, 2 nothing could be loaded)."""
    from actors.env_pool import EnvironmentSpecError
    from actors.rewards import RewardSpecError
    from launch.build import StartupError
    from launch.config import ConfigError
    from launch.preflight import PreflightError
    from queues.prompts import DatasetError

    try:
        findings = _check(load_config(config, overrides), max(n, 0), say)
    except (ConfigError, DatasetError, RewardSpecError, StartupError, PreflightError, EnvironmentSpecError) as exc:
        print(f"tandem: error: {exc}", file=sys.stderr, flush=True)
        return 2
    say("")
    if findings.warnings:
        say("warnings:")
        say("\n".join(f"  - {w}" for w in findings.warnings))
    if findings.problems:
        say(f"verdict: {len(findings.problems)} problem(s); a run would fail or not learn:")
        say("\n".join(f"  - {p}" for p in findings.problems))
        return 1
    say(findings.verdict or "verdict: OK: the rows load, fit the context, and their own answers earn the reward")
    return 0


def _check(cfg: TandemConfig, n: int, say: Callable[[str], None]) -> Findings:
    from actors.env_pool import check_environment
    from actors.rewards import check_rewards
    from launch.build import prepare_model
    from launch.data import load_run_rows
    from launch.preflight import answer_problem, check_context_length, load_renderer

    found = Findings(warnings=list(cfg.warnings))  # what `tandem train` would warn about before starting
    check_rewards(cfg.reward)  # a reward file that exits or hangs at import fails here, in a child process
    rows, held = load_run_rows(cfg, found.warnings.append)
    model_path = prepare_model(cfg.model)
    shown, episodes, environment = rows[:n], None, None
    if cfg.rollout.kind == "multi_turn":  # before anything is said: an environment that cannot load is exit 2
        environment = check_environment(cfg.rollout.episode, shown)  # reset(row) of the rows shown, in a child
    say(
        f"data: {cfg.data.prompts}: {len(rows)} rows to train on, {len(held)} held out for evaluation (rows below "
        "are numbered among these, after unusable rows are dropped and the held-out rows set aside)"
    )
    say(f"model: {model_path}")
    try:
        check_context_length(cfg.engine.max_model_len, model_path)
    except ValueError as exc:
        found.problems.append(str(exc))
    for what, part in (("data.prompts", rows), ("the held-out set", held)):
        if problem := answer_problem(cfg.reward, cfg.data, part, what):
            found.problems.append(problem)
    renderer = load_renderer(model_path, cfg.data)
    if renderer is None:
        say("template: unknown (the tokenizer is not in the local cache; prompts are shown as rows, uncounted)")
        found.warnings.append(f"the tokenizer of {model_path} is not available offline: prompts were not counted")
    else:
        say(f"template: {renderer.describe()}")
        if note := renderer.fallback_note():
            found.warnings.append(note)
        _check_lengths(cfg, renderer, rows, "data.prompts", found, say)
        _check_answer_room(cfg, renderer, rows, found)
        if held:
            _check_lengths(cfg, renderer, held, "the held-out set", found, say)
    if cfg.rollout.kind == "multi_turn":  # the sampler gets reset(row)'s messages and the tools, not the row
        from launch.check_episodes import check_episodes

        episodes = check_episodes(cfg, model_path, environment, len(shown), found, say)
        found.verdict = episodes.verdict()
    gold = GoldCompletions(cfg, rows)
    say(f"reward: {' + '.join(_part_text(p) for p in cfg.reward.parts)}")
    if cfg.reward.function_parts:
        say(f"  {gold.how}")
    scores = _score_rows(cfg, gold, shown, found)
    lossy = []
    for i, row in enumerate(shown):
        say("")
        if lost := _show_row(i, row, None if episodes else renderer, cfg, say):
            lossy.append(f"row {i}: {lost}")
        for line in (episodes.lines[i] if episodes else []) + scores[i]:
            say(f"  {line}")
    if lossy:
        found.warnings.append(
            f"the tokenizer loses text of {len(lossy)} of {len(shown)} prompts shown ({lossy[0]}): the model never "
            "sees those characters (the demo's tiny model knows 64 characters; `tandem tiny-model --chat DIR` "
            "builds one that round-trips any text)"
        )
    return found


def _check_lengths(cfg: TandemConfig, renderer, rows: list[dict], what: str, found: Findings, say) -> None:
    """Every prompt's token count against the completion budget, as preflight counts it."""
    from launch.preflight import prompt_lengths
    from queues.prompts import DatasetError

    limit = cfg.engine.max_model_len - cfg.rollout.max_tokens
    try:
        lengths = prompt_lengths("", rows, cfg.data, renderer)
    except DatasetError as exc:  # e.g. chat rows and no template to render them
        found.problems.append(str(exc))
        return
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    over = sum(1 for x in lengths if x > limit)
    say(
        f"prompt tokens of {what}: longest {lengths[longest]} (row {longest}), mean {sum(lengths) / len(lengths):.0f}; "
        f"limit {limit} = engine.max_model_len {cfg.engine.max_model_len} - rollout.max_tokens "
        f"{cfg.rollout.max_tokens}; {over} of {len(rows)} over it"
    )
    if not over:
        return
    first = next(k for k, x in enumerate(lengths) if x > limit)
    line = f"{over} of {len(rows)} prompts of {what} are longer than {limit} tokens (first: row {first})"
    if cfg.data.skip_long_prompts and over < len(rows):
        found.warnings.append(f"{line}; data.skip_long_prompts=true drops them")
    else:
        found.problems.append(
            f"{line}; shorten them, raise engine.max_model_len, lower rollout.max_tokens"
            + ("" if cfg.data.skip_long_prompts else " or set data.skip_long_prompts=true")
        )


ANSWER_SAMPLE = 256  # rows whose answers are counted for the room check


def _check_answer_room(cfg: TandemConfig, renderer, rows: list[dict], found: Findings) -> None:
    """The rows' answers as written (a GSM8K answer is a worked solution) against ``rollout.max_tokens``:
    a completion that reasons like them and is cut before its final answer scores 0, and a run whose
    completions are all cut learns nothing while the gold answers above score 1."""
    texts = [str(r["answer"]) for r in rows[:ANSWER_SAMPLE] if r.get("answer") is not None]
    if not texts:
        return
    lengths = sorted(len(renderer.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts)
    median, limit = lengths[len(lengths) // 2], cfg.rollout.max_tokens
    if median > limit:
        found.warnings.append(
            f"the rows' answers as written are {median} tokens long (median of {len(texts)}), more than "
            f"rollout.max_tokens = {limit}: a completion that works like them is cut before its final answer "
            "and scores 0; raise rollout.max_tokens (and engine.max_model_len)"
        )


class GoldCompletions:
    """A row's own answer as a completion the reward can read, and a wrong one to compare it with.

    builtin:math reads the last ``\\boxed{}`` of a completion, so for a row it scores the answer goes
    inside one (a GSM8K ``... #### 18`` answer as the ``18`` math-verify compares). Any other reward gets
    the answer text as the whole completion: that is all the row says a correct completion contains, so
    a reward that also wants reasoning or a format (builtin:format's ``<think>`` block) scores it lower.
    """

    def __init__(self, cfg: TandemConfig, rows: list[dict[str, Any]]):
        self.reward, self.rows = cfg.reward, rows
        self.how = (
            "gold completion: the row's answer, in \\boxed{} where builtin:math scores the row (what it reads), "
            "else as the whole completion (a reward that also checks reasoning or format scores it lower); "
            "wrong: another row's answer"
        )

    def completion(self, answer: Any, row: dict[str, Any]) -> str:
        """``answer`` written as a completion of ``row`` (boxed when builtin:math scores the row)."""
        from launch.preflight import row_functions

        if MATH not in row_functions(self.reward, row):
            return str(answer)
        from actors.builtin_rewards import BOXED, gold_text

        text = gold_text(answer)  # what builtin:math compares against: "$18$", or the row's own LaTeX
        if BOXED in text:
            return text
        if text.startswith("$") and text.endswith("$"):
            text = text.strip("$")
        return f"{BOXED}{{{text}}}"

    def gold(self, row: dict[str, Any]) -> str | None:
        from launch.preflight import has_answer

        return self.completion(row["answer"], row) if has_answer(row) else None

    def wrong(self, index: int, row: dict[str, Any]) -> tuple[str, str] | None:
        """``(completion, where it came from)``: the next row's answer that reads differently, else the
        answer's last number plus one, else None."""
        import re

        from launch.preflight import has_answer

        own = self.gold(row)
        for step in range(1, min(len(self.rows), 200)):
            j = (index + step) % len(self.rows)
            if has_answer(self.rows[j]):
                other = self.completion(self.rows[j]["answer"], row)
                if other != own:
                    return other, f"row {j}'s answer"
        text = str(row["answer"])
        numbers = list(re.finditer(r"-?\d+", text))
        if not numbers:
            return None
        last = numbers[-1]
        changed = text[: last.start()] + str(int(last.group()) + 1) + text[last.end() :]
        return self.completion(changed, row), "its answer + 1"


class _InProcessPool:
    """``RewardPool``'s one method the scorer calls, in this process's main thread: the same parts
    (``load_parts``) and the same call (``score_call``) as a reward worker, without its processes."""

    def __init__(self, cfg):
        from actors.reward_parts import load_parts

        self.parts = load_parts(cfg)

    def score_many(self, calls):
        from actors.reward_parts import score_call

        return [score_call(self.parts, *call) for call in calls]


class _NoRewardModel:
    """The reward model runs on its own actors; here its part is not scored (it counts 0.0)."""

    def submit(self, prompts, completions):
        return None


@contextmanager
def _deadline(seconds: float, what: str) -> Iterator[None]:
    """End the command with one line if the block outlives ``seconds`` (a reward that hangs): the call
    runs in the main thread, which a timer thread cannot interrupt, so the process exits."""

    def give_up() -> None:
        print(
            f"tandem: error: {what} did not return within {seconds:g} s (reward.timeout_s); a run would score it 0 "
            "each time: fix the reward or raise reward.timeout_s",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    timer = threading.Timer(seconds, give_up)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _score_rows(cfg: TandemConfig, gold: GoldCompletions, shown: list[dict], found: Findings) -> list[list[str]]:
    """Lines per shown row: the reward of its gold completion and of a wrong one; problems and warnings
    go to ``found``."""
    from actors.reward_scorer import RewardScorer

    lines: list[list[str]] = [[] for _ in shown]
    elsewhere = [p for p in cfg.reward.parts if p.is_model or p.is_environment]
    where = " and ".join(
        sorted(
            {"the environment's (it scores episodes)" if p.is_environment else "the reward model's" for p in elsewhere}
        )
    )
    if not cfg.reward.function_parts:
        if any(p.is_model for p in elsewhere):  # the environment's alone: the reward line and verdict say so
            found.warnings.append(f"the reward is {where} alone, which runs in the actors: not scored here")
        return lines
    if elsewhere:
        found.warnings.append(f"{where} part is not scored here (it runs in the actors): it counts 0")
    scorer = RewardScorer(cfg.reward, pool=_InProcessPool(cfg.reward), model=_NoRewardModel())
    many = len(cfg.reward.parts) > 1
    checked = zero = unseparated = 0
    for i, row in enumerate(shown):
        completion = gold.gold(row)
        if completion is None:
            lines[i].append("no answer in this row: its gold answer cannot be scored")
            continue
        wrong = gold.wrong(i, row)
        completions = [completion] + ([wrong[0]] if wrong else [])
        n = len(completions)
        with _deadline(cfg.reward.timeout_s, f"the reward on row {i}"):
            scored = scorer.score_groups([([row["prompt"]] * n, completions, [row] * n)])[0]
        labels = [f"gold {_short(completion)}", f"wrong {_short(wrong[0])} ({wrong[1]})" if wrong else ""]
        for label, result, expect in zip(labels, scored, ("~1", "0"), strict=False):
            parts = " [" + ", ".join(f"{k} {v:g}" for k, v in result.parts.items()) + "]" if many else ""
            error = f"; error: {result.error}" if result.error else ""
            lines[i].append(f"reward of {label}: {result.reward:g}{parts} (expect {expect}){error}")
            if result.error:
                found.warnings.append(f"row {i}: the reward raised {result.error}")
        checked += 1
        zero += scored[0].reward <= 0
        unseparated += len(scored) > 1 and 0 < scored[0].reward <= scored[1].reward  # (a 0 gold is a problem)
    if checked and zero * 2 > checked:
        found.problems.append(
            f"the row's own answer scored 0 or less for {zero} of {checked} rows checked: the reward cannot read "
            "the answers (check data.answer_field, and that the answers have the form the reward expects: "
            "builtin:math parses a number or LaTeX)"
        )
    if checked and unseparated * 2 > checked:
        found.warnings.append(
            f"a wrong answer scored as high as the row's own for {unseparated} of {checked} rows: the reward "
            "may not tell right from wrong"
        )
    return lines


def _part_text(part) -> str:
    if part.is_environment:
        weight = f"{part.weight:g} x " if part.weight != 1 else ""
        return f"{weight}the environment's (scored in episodes by the actors, not checked here)"
    chosen = getattr(part, "by_source", None)
    by = f" (by data_source: {', '.join(f'{k} -> {v}' for k, v in chosen.items())})" if chosen else ""
    return f"{part.weight:g} x {part.function}{by}"


def _short(value: Any, limit: int = 300) -> str:
    """A value in quotes, newlines as ``\\n``; backslashes stay single, so LaTeX reads as written."""
    text = f'"{value}"'.replace("\n", "\\n") if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


def _show_row(i: int, row: dict[str, Any], renderer, cfg: TandemConfig, say: Callable[[str], None]) -> str | None:
    """Print the row's mapped fields and its prompt as the sampler gets it (the token ids decoded back);
    return where that prompt loses text in the tokenizer, if it does."""
    source = f" (data_source: {row['data_source']})" if "data_source" in row else ""
    say(f"row {i}{source}")
    say(f"  prompt: {_short(row['prompt'])}")
    say(f"  answer: {_short(row['answer']) if 'answer' in row else '(none)'}")
    if row.get("messages"):
        say(f"  messages: {len(row['messages'])} turns ({', '.join(m['role'] for m in row['messages'])})")
    if renderer is None:
        return None
    ids = renderer.token_ids(row)
    sent = renderer.tokenizer.decode(ids, skip_special_tokens=False)
    limit = cfg.engine.max_model_len - cfg.rollout.max_tokens
    say(f"  sent to the sampler: {len(ids)} tokens (limit {limit}), decoded:")
    shown = sent if len(sent) <= SHOWN_CHARS else f"{sent[:SHOWN_CHARS]}... ({len(sent) - SHOWN_CHARS} more characters)"
    say("\n".join(f"    | {line}" for line in shown.split("\n")))
    lost = _lost_text(renderer, row, sent)
    if lost:
        say(f"  ! the token ids do not give the prompt back: {lost}")
    return lost


def _lost_text(renderer, row: dict[str, Any], sent: str) -> str | None:
    """Where the decoded prompt first differs from the rendered text (characters the tokenizer's
    vocabulary lacks are lost); a BOS the tokenizer adds is not a difference."""
    text = renderer.text(row)
    bos = getattr(renderer.tokenizer, "bos_token", None)
    if bos and sent.startswith(bos) and not text.startswith(bos):
        sent = sent[len(bos) :]
    if sent.lstrip() == text.lstrip():
        return None
    at = next((k for k, (a, b) in enumerate(zip(text, sent)) if a != b), min(len(text), len(sent)))
    return f"{_short(text[max(0, at - 20) : at + 30])} comes back as {_short(sent[max(0, at - 20) : at + 30])}"
