"""What fails before any process starts, in one line: a completion budget that leaves no room for a prompt,
a context longer than the model's, prompts too long for it (or skipped and counted), an output directory
that cannot be written, a prompt file that is not UTF-8, a reward file that exits or hangs at import."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from actors.rewards import RewardSpecError, check_reward_function
from launch.config import ConfigError, load_config
from launch.preflight import PreflightError, preflight, prompt_lengths
from queues.config import DataConfig
from queues.prompts import DatasetError, read_jsonl_rows

BASE = ["model.path=m", "data.prompts=p.jsonl", "reward.function=builtin:successor"]


def config(tmp_path: Path, *overrides: str):
    return load_config(None, [*BASE, f"run.output_dir={tmp_path / 'runs'}", *overrides])


def rows_of(*lengths: int) -> list[dict]:
    return [{"prompt": "a" * n, "answer": str(i)} for i, n in enumerate(lengths)]


def one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


def test_max_tokens_must_leave_room_for_a_prompt():
    with pytest.raises(ConfigError) as err:
        load_config(None, [*BASE, "rollout.max_tokens=512", "engine.max_model_len=512"])
    message = one_line(err)
    assert "rollout.max_tokens = 512" in message and "engine.max_model_len = 512" in message
    assert "lower rollout.max_tokens or raise engine.max_model_len" in message
    load_config(None, [*BASE, "rollout.max_tokens=511", "engine.max_model_len=512"])  # one prompt token fits


def test_max_model_len_above_the_models_positions_is_an_error(tiny_model_dir, tmp_path):
    # The tiny model's config: max_position_embeddings = 512.
    with pytest.raises(PreflightError) as err:
        preflight(config(tmp_path, "engine.max_model_len=1024"), tiny_model_dir, rows_of(3))
    message = one_line(err)
    assert "engine.max_model_len = 1024" in message and "max_position_embeddings = 512" in message
    assert "set engine.max_model_len to at most 512" in message
    rows = rows_of(3)
    assert preflight(config(tmp_path, "engine.max_model_len=512"), tiny_model_dir, rows) == rows


def test_a_model_whose_config_cannot_be_read_skips_the_model_checks(tmp_path):
    # A hub id that is not in the local cache: nothing to read offline, so nothing is checked (quietly, at once).
    rows = rows_of(10_000)
    assert preflight(config(tmp_path, "engine.max_model_len=100000"), "nobody-xyz/no-such-model", rows) == rows


def test_a_prompt_longer_than_the_context_leaves_is_an_error_naming_the_row(tiny_model_dir, tmp_path):
    # One token per character; limit = engine.max_model_len 64 - rollout.max_tokens 16 = 48 tokens.
    cfg = config(tmp_path, "engine.max_model_len=64", "rollout.max_tokens=16")
    assert preflight(cfg, tiny_model_dir, rows_of(5, 48)) == rows_of(5, 48)  # exactly 48 fits
    with pytest.raises(PreflightError) as err:
        preflight(cfg, tiny_model_dir, rows_of(5, 48, 49, 100))
    message = one_line(err)
    assert "row 2 (0-based)" in message and "is 49 tokens" in message and "= 48 tokens" in message
    assert "(and 1 more rows)" in message
    assert "shorten it, raise engine.max_model_len, or set data.skip_long_prompts=true" in message


def test_special_tokens_the_tokenizer_adds_count_towards_the_prompt(tiny_model_dir, tmp_path):
    # The same tiny model with a tokenizer that puts <bos> before every prompt: 48 characters = 49 tokens.
    from tokenizers.processors import TemplateProcessing

    from actors.tiny_model import build_tokenizer, tiny_vocab

    model = shutil.copytree(tiny_model_dir, tmp_path / "bos-model")
    tokenizer = build_tokenizer()
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", tiny_vocab()["<bos>"])]
    )
    tokenizer.save_pretrained(model)
    assert prompt_lengths(str(model), [{"prompt": "ab"}, {"prompt": "a" * 48}], DataConfig(prompts="x")) == [3, 49]
    cfg = config(tmp_path, "engine.max_model_len=64", "rollout.max_tokens=16")
    with pytest.raises(PreflightError, match="row 0 .* is 49 tokens"):
        preflight(cfg, str(model), rows_of(48))


def test_skip_long_prompts_drops_and_counts_them(tiny_model_dir, tmp_path, capsys):
    # data.chat_template=none: raw text asked for, so the only line printed is the skip count
    cfg = config(
        tmp_path,
        "engine.max_model_len=64",
        "rollout.max_tokens=16",
        "data.skip_long_prompts=true",
        "data.chat_template=none",
    )
    rows = rows_of(49, 5, 200, 48, 1)
    kept = preflight(cfg, tiny_model_dir, rows)
    assert kept == [rows[1], rows[3], rows[4]]  # the rows that fit, in their order
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "skipped 2 of 5 prompts of data.prompts longer than 48 tokens" in err
    # Nothing skipped: nothing printed.
    assert preflight(cfg, tiny_model_dir, rows_of(5)) == rows_of(5)
    assert capsys.readouterr().err == ""


def test_skipping_every_prompt_is_still_an_error(tiny_model_dir, tmp_path):
    cfg = config(tmp_path, "engine.max_model_len=64", "rollout.max_tokens=16", "data.skip_long_prompts=true")
    with pytest.raises(PreflightError) as err:
        preflight(cfg, tiny_model_dir, rows_of(49, 60))
    message = one_line(err)
    assert "every one of the 2 prompts" in message and "leaves nothing to train on" in message


def test_many_prompts_are_counted_in_batches(tiny_model_dir, tmp_path):
    # More rows than one tokenizer call takes: each chunk's lengths land on their own rows.
    from launch import preflight as module

    prompts = ["a" * (i % 50 + 1) for i in range(module.TOKENIZE_CHUNK + 7)]
    assert prompt_lengths(tiny_model_dir, [{"prompt": p} for p in prompts], DataConfig(prompts="x")) == [
        len(p) for p in prompts
    ]


def test_an_output_dir_that_cannot_be_written_is_an_error(tiny_model_dir, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(PreflightError) as err:
        preflight(config(tmp_path, f"run.output_dir={blocker / 'runs'}"), tiny_model_dir, rows_of(3))
    message = one_line(err)
    assert f"run.output_dir {blocker / 'runs'} cannot be created or written (Not a directory)" in message
    # A writable one is created, and the probe file is gone again.
    preflight(config(tmp_path, f"run.output_dir={tmp_path / 'new' / 'runs'}"), tiny_model_dir, rows_of(3))
    assert list((tmp_path / "new" / "runs").iterdir()) == []


def test_a_prompt_file_that_is_not_utf8_names_the_file_and_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"prompt": "ok"}\n\n{"prompt": "café"}\n'.encode("latin-1"))
    with pytest.raises(DatasetError) as err:
        read_jsonl_rows(path)
    message = one_line(err)
    assert f"{path} line 3 is not UTF-8" in message and "0xe9" in message
    # UTF-8 with a byte-order mark is still UTF-8.
    path.write_bytes('{"prompt": "café"}\n'.encode("utf-8-sig"))
    assert read_jsonl_rows(path) == [{"prompt": "café"}]


def write_reward(tmp_path: Path, body: str) -> str:
    path = tmp_path / "reward.py"
    path.write_text(body + "\n\ndef f(prompt, completion, row):\n    return 1.0\n")
    return f"{path}:f"


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("import sys\nsys.exit('needs a GPU')", "exited with code 1 while being imported (needs a GPU)"),
        ("import sys\nsys.exit(0)", "exited with code 0 while being imported;"),  # never reached the function
        ("import os\nos._exit(3)", "exited with code 3 while being imported;"),
    ],
)
def test_a_reward_file_that_exits_while_imported_is_an_error(tmp_path, body, expected):
    spec = write_reward(tmp_path, body)
    with pytest.raises(RewardSpecError) as err:
        check_reward_function(spec, timeout_s=30)
    message = one_line(err)
    assert f"reward.function {spec!r} {expected}" in message and "if __name__ == '__main__':" in message


def test_a_reward_file_that_hangs_while_imported_times_out(tmp_path):
    spec = write_reward(tmp_path, "import time\ntime.sleep(600)")
    with pytest.raises(RewardSpecError) as err:
        check_reward_function(spec, timeout_s=2)
    message = one_line(err)
    assert f"reward.function {spec!r} did not finish importing within 2 s (reward.import_timeout_s)" in message


def test_a_loadable_reward_file_passes_and_load_errors_keep_their_line(tmp_path):
    spec = write_reward(tmp_path, "print('imported')")
    check_reward_function(spec, timeout_s=30)
    check_reward_function("builtin:successor", timeout_s=30)
    path = Path(spec.rpartition(":")[0])
    with pytest.raises(RewardSpecError, match=f"^{path} has no function 'g'; functions defined there: f$"):
        check_reward_function(f"{path}:g", timeout_s=30)
    with pytest.raises(RewardSpecError, match="unknown built-in task 'nope'"):
        check_reward_function("builtin:nope", timeout_s=30)


def test_reward_import_timeout_is_a_positive_config_key():
    assert load_config(None, BASE).reward.import_timeout_s == 60
    with pytest.raises(ConfigError, match="reward.import_timeout_s"):
        load_config(None, [*BASE, "reward.import_timeout_s=0"])
