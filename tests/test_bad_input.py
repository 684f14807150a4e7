"""Bad input stops the run before anything starts, with one line naming the problem and the fix."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from actors.rewards import RewardSpecError, load_reward_function, score
from launch.cli import main
from queues.prompts import DatasetError, PromptStream, read_jsonl_rows


def _config(tmp_path, **sections) -> str:
    import yaml

    prompts = tmp_path / "p.jsonl"
    if not prompts.exists():
        prompts.write_text(json.dumps({"prompt": "1>", "answer": "1"}) + "\n")
    reward = tmp_path / "r.py"
    reward.write_text("def reward(prompt, completion, row):\n    return 1.0\n")
    cfg = {
        "model": {"path": str(tmp_path / "model")},
        "data": {"prompts": str(prompts)},
        "reward": {"function": f"{reward}:reward"},
        "run": {"output_dir": str(tmp_path / "runs")},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tandem: error: ") and "\n" not in err, err
    return err


def test_unknown_config_key(tmp_path, capsys):
    err = _one_line_error(capsys, ["train", "--config", _config(tmp_path), "rollout.group_sise=4"])
    assert "unknown config key 'rollout.group_sise'" in err and "group_size" in err


def test_missing_model_path(tmp_path, capsys):
    err = _one_line_error(capsys, ["train", "--config", _config(tmp_path)])
    assert f"model.path {tmp_path / 'model'} does not exist" in err and "build_tiny" in err
    assert not (tmp_path / "runs").exists()  # nothing started, no empty run directory


def test_rows_without_a_prompt_are_an_error_when_most_are(tmp_path, capsys):
    rows = [{"prompt": "1>", "answer": "1"}, {"question": "2>", "answer": "2"}, {"question": "3>", "answer": "3"}]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    err = _one_line_error(capsys, ["train", "--config", _config(tmp_path)])
    assert "only 1 of 3 rows are usable" in err and "2 rows without a 'prompt' field (rows 1, 2)" in err
    assert "its columns are: prompt, answer, question" in err and "data.prompt_field" in err


def test_jsonl_broken_json_names_the_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b"\n')
    with pytest.raises(DatasetError, match=r"line 3 is not valid JSON"):
        read_jsonl_rows(path)


def test_reward_spec_errors(tmp_path):
    with pytest.raises(RewardSpecError, match="must be 'path/to/file.py:function_name'"):
        load_reward_function("no_colon_here")
    with pytest.raises(RewardSpecError, match="does not exist"):
        load_reward_function(f"{tmp_path}/missing.py:f")
    (tmp_path / "r.py").write_text("def good(p, c, r):\n    return 1.0\n")
    with pytest.raises(RewardSpecError, match="has no function 'bad'; functions defined there: good"):
        load_reward_function(f"{tmp_path}/r.py:bad")
    with pytest.raises(RewardSpecError, match="unknown"):
        load_reward_function("builtin:no-such-task")


def test_reward_function_that_raises_scores_zero_with_the_error():
    def flaky(prompt, completion, row):
        return 1.0 / len(completion)

    assert score(flaky, "p", "ab", {}) == (0.5, None)
    assert score(flaky, "p", "", {}) == (0.0, "ZeroDivisionError: float division by zero")
    assert score(lambda p, c, r: float("nan"), "p", "c", {})[0] == 0.0
    assert score(lambda p, c, r: "high", "p", "c", {})[1].startswith("ValueError")


def test_prompt_stream_epochs_are_seeded_shuffles():
    rows = [{"prompt": str(i)} for i in range(5)]
    take = lambda seed: [r["prompt"] for _, r in zip(range(10), PromptStream(rows, seed))]  # noqa: E731
    first = take(1)
    assert first == take(1)  # deterministic
    assert sorted(first[:5]) == sorted(first[5:]) == [str(i) for i in range(5)]  # every row once per epoch
    assert [r["prompt"] for _, r in zip(range(5), PromptStream(rows, 0, shuffle=False))] == list("01234")


def test_tandem_command_is_installed():
    out = subprocess.run([sys.executable, "-m", "launch.cli", "config-reference"], capture_output=True, text=True)
    assert out.returncode == 0 and "| `learner.lr` |" in out.stdout


def test_process_rewards_are_lists_placed_on_step_end_tokens():
    from actors.rewards import score_steps, step_end_tokens

    assert score_steps(lambda p, c, r: [0.5, -0.25], "p", "ab", {}) == (0.25, [0.5, -0.25], None)
    assert score_steps(lambda p, c, r: [1.0, float("inf")], "p", "ab", {})[2].startswith("ValueError")
    assert score(lambda p, c, r: [1.0], "p", "c", {})[1].startswith("ValueError: reward function returned a list")
    # Tokens "ab", "\n", "c", "d\n", "e": steps end after each newline and at the end of the text.
    pieces = ["ab", "\n", "c", "d\n", "e"]
    decode = lambda ids: "".join(pieces[i] for i in ids)  # noqa: E731
    assert step_end_tokens([0, 1, 2, 3, 4], decode, "\n") == [1, 3, 4]
    assert step_end_tokens([0, 1, 2, 3], decode, "\n") == [1, 3]  # text ends with the delimiter
    assert step_end_tokens([0, 2], decode, "") == [0, 0, 1]  # every character: a, b (token 0), c (token 1)


def test_the_last_step_owns_the_eos_token():
    # ids [a, b, \n, c, EOS]: the text (special tokens skipped) is "ab\nc"; the steps end at tokens 2 and 4,
    # so with step rewards [1, 1] the tokens get A = [2, 2, 2, 1, 1] (on main the EOS ended no step: ends
    # [2, 3], A = [2, 2, 2, 1, 0], while a single score already ended on the EOS).
    import torch

    from actors.rewards import step_end_tokens
    from learner.algorithms import accumulate_step_rewards

    pieces = ["a", "b", "\n", "c", ""]  # the EOS decodes to nothing
    decode = lambda ids: "".join(pieces[i] for i in ids)  # noqa: E731
    ends = step_end_tokens([0, 1, 2, 3, 4], decode, "\n")
    assert ends == [2, 4]
    rewards, is_end = torch.zeros(1, 5), torch.zeros(1, 5)
    rewards[0, ends], is_end[0, ends] = 1.0, 1.0
    assert accumulate_step_rewards(rewards, is_end, torch.ones(1, 5)).tolist() == [[2.0, 2.0, 2.0, 1.0, 1.0]]
    assert step_end_tokens([0, 1, 2, 4], decode, "\n") == [3]  # "ab\n" then EOS: one step, ending on the EOS


def test_step_ends_wait_for_a_multi_byte_character_to_complete():
    # "€\nb" + EOS in byte tokens (e2 82 ac, \n, b, EOS). A prefix ending inside "€" decodes to one U+FFFD
    # per byte with a byte-fallback tokenizer: counted as characters, step 1 ended on the euro's first byte
    # (ends [1, 5]); the newline ends it: [3, 5]. With '' every character is a step: [2, 3, 5] (was [0, 3, 5]).
    from actors.rewards import step_end_tokens

    pieces = [b"\xe2", b"\x82", b"\xac", b"\n", b"b", b""]

    def decode(ids):
        raw = b"".join(pieces[i] for i in ids)
        text = raw.decode("utf-8", errors="ignore")
        missing = len(raw) - len(text.encode())  # bytes of an unfinished character: one U+FFFD each
        return text + "\ufffd" * missing

    assert step_end_tokens([0, 1, 2, 3, 4, 5], decode, "\n") == [3, 5]
    assert step_end_tokens([0, 1, 2, 3, 4, 5], decode, "") == [2, 3, 5]
