"""When a generation actor dies its log holds the error and stays readable, the console quotes the
error in one line, and an actor that dies of the same error twice stops the run at once instead
of being replaced until ``resources.actors.max_restarts`` runs out. No Ray cluster, no vLLM: the
failures are Ray's exception objects built by hand, and vLLM's dump is a captured sample."""

from __future__ import annotations

import asyncio
import io
import logging
import traceback

import pytest
from ray.exceptions import ActorDiedError, RayTaskError

import runtime.supervise as supervise
from cluster.logs import VLLM_DUMP_LOGGER, VllmDumpFilter, exception_lines, last_error_line, quiet_vllm_dumps
from queues.bounded import LocalQueue
from queues.prompts import PromptStream
from runtime.admission import Admission, Pace
from runtime.ledger import PromptLedger
from runtime.supervise import ActorFailed, ActorKeepsFailing, ActorPool, describe_death
from tests.fakes import FakeStarter

# vLLM 0.32's engine-failure dump (vllm/logging_utils/dump_input.py): three records, the config's
# repr and every scheduled request's token ids; ~10 KB each in the run that showed it
CONFIG = "model='/root/.cache/tandem/models/tiny-qwen2', speculative_config=None, tokenizer=..., " * 60
SCHEDULED = "NewRequestData(req_id=7-0a1b,prompt_token_ids=[" + ", ".join(["17"] * 2000) + "])"


def emit_dump(logger: logging.Logger) -> None:
    logger.error("Dumping input data for V1 LLM engine (v%s) with config: %s, ", "0.32.0", CONFIG)
    logger.error("Dumping scheduler output for model execution: %s", f"SchedulerOutput(scheduled=[{SCHEDULED}])")
    logger.error("Dumping scheduler stats: %s", "SchedulerStats(num_running_reqs=32, num_waiting_reqs=0)")


def test_vllms_dumps_are_cut_to_the_first_one_and_the_traceback_is_kept():
    logger = logging.getLogger("test.vllm_dump")
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    logger.addHandler(handler)
    logger.addFilter(VllmDumpFilter(chars=200))
    try:
        for _ in range(180):
            emit_dump(logger)
        try:
            raise ValueError("bad scheduler output")
        except ValueError:
            logger.exception("Error preparing object to dump")  # not a dump: untouched, traceback kept
    finally:
        logger.removeHandler(handler)
    lines = out.getvalue().splitlines()
    assert len(out.getvalue()) < 2000  # 180 dumps of ~10-40 KB each -> the first one, cut
    assert lines[0].startswith("Dumping input data for V1 LLM engine (v0.32.0) with config: model=")
    assert lines[0].endswith("characters cut]") and len(lines[0]) < 260
    assert lines[1].startswith("Dumping scheduler output") and lines[2].startswith("Dumping scheduler stats")
    assert lines[3] == "(vLLM's later input dumps are left out: cluster/logs.py)"  # said once
    assert lines[4] == "Error preparing object to dump" and lines[-1] == "ValueError: bad scheduler output"


def test_the_filter_is_installed_on_vllms_dump_logger_once():
    logger = logging.getLogger(VLLM_DUMP_LOGGER)
    before = list(logger.filters)
    try:
        quiet_vllm_dumps()
        quiet_vllm_dumps()
        assert sum(isinstance(f, VllmDumpFilter) for f in logger.filters) == 1
    finally:
        logger.filters = before


# --- what a dead actor's error says ---------------------------------------------------------------
def ray_task_error() -> RayTaskError:
    """What awaiting an actor's ``run`` gives when it raised: a chained error, as vLLM's are."""

    def step():
        raise ValueError("Attention head_dim 48 is not supported\nsupported: 32, 64")

    try:
        try:
            step()
        except ValueError as exc:
            raise RuntimeError("EngineCore encountered an issue. See stack trace (above) for the root cause.") from exc
    except RuntimeError as exc:
        error = RayTaskError("GenerationActor.run", traceback.format_exc(), exc, "ray::GenerationActor.run", 42, "ip")
        return error.as_instanceof_cause()


def failed(exc: BaseException) -> asyncio.Future:
    """An actor's ended loop, as the driver holds it."""
    loop = asyncio.new_event_loop()
    future = loop.create_future()
    future.set_exception(exc)
    loop.close()
    return future


def test_exception_lines_of_a_chained_ray_traceback_root_cause_first():
    text = str(ray_task_error())
    assert "\x1b[" in text  # Ray colours its headers
    assert exception_lines(text) == [
        "ValueError: Attention head_dim 48 is not supported",
        "RuntimeError: EngineCore encountered an issue. See stack trace (above) for the root cause.",
    ]


def test_a_raised_error_is_quoted_with_its_root_cause_and_its_traceback_goes_to_the_log(tmp_path):
    death = describe_death(failed(ray_task_error()), str(tmp_path / "actor-0.log"))
    assert death.known
    assert death.line == (
        "RuntimeError: EngineCore encountered an issue. See stack trace (above) for the root cause. "
        "(caused by ValueError: Attention head_dim 48 is not supported)"
    )
    assert 'raise ValueError("Attention head_dim 48' in death.text


# what a process that died without raising is said to have met (Ray's exit type), in place of Ray's paragraph
KILLED = (
    "its process ended without raising an error: a signal killed it (kill -9, or the kernel's OOM killer: see "
    "dmesg) or it crashed"
)


def test_a_killed_process_is_quoted_from_its_log_when_it_wrote_an_error(tmp_path):
    log = tmp_path / "actor-0.log"
    log.write_text("INFO engine ready\nTraceback (most recent call last):\n  File 'x'\ntorch.OutOfMemoryError: 2 GiB\n")
    death = describe_death(failed(ActorDiedError()), str(log))
    assert death.line == KILLED + "; the last error in its log: torch.OutOfMemoryError: 2 GiB"
    assert not death.known  # a guess: a handled error (a reward's) is logged the same way
    with log.open("a") as out:  # the driver recorded that death; the replacement then died silently
        out.write("[12:00:00] --- actor-0 stopped; the driver saw this error ---\nINFO engine ready\n")
    death = describe_death(failed(ActorDiedError()), str(log))
    assert death.line == KILLED  # not the old error
    silent = tmp_path / "actor-1.log"
    silent.write_text("INFO engine ready\n")
    death = describe_death(failed(ActorDiedError()), str(silent))  # kill -9: nothing to quote
    assert not death.known and death.line == KILLED  # what happened, not Ray's paragraph of possible causes
    assert last_error_line(tmp_path / "missing.log") is None


# --- the pool: replace, or stop when the same error repeats ---------------------------------------
class FakeRun:
    def __init__(self, logs):
        self.logs, self.said = logs, []

    def say(self, text):
        self.said.append(text)

    def log_path(self, name):
        return str(self.logs / f"{name}.log")


def build_pool(tmp_path, deaths: list[BaseException], max_restarts: int = 3) -> ActorPool:
    """Two actors; each started loop fails with the next of ``deaths`` (then never ends)."""
    (tmp_path / "logs").mkdir(exist_ok=True)
    loop = asyncio.get_running_loop()
    futures = []
    for exc in deaths:
        futures.append(loop.create_future())
        futures[-1].set_exception(exc)
    supervise._kill = lambda actor: None
    prompts = LocalQueue("prompt", 10)
    ledger = PromptLedger(PromptStream([{"prompt": "p"}] * 4, seed=0, shuffle=False))
    return ActorPool(
        ["a0", "a1"],
        ["actor-0", "actor-1"],
        FakeStarter(futures + [loop.create_future() for _ in range(4)]),
        FakeRun(tmp_path / "logs"),
        Admission(ledger, Pace(2, 1), prompts, lambda row: [1], 1.0),
        queues=(prompts, LocalQueue("results", 10)),
        max_restarts=max_restarts,
    )


async def end_failed_loops(pool: ActorPool) -> None:
    await asyncio.sleep(0)
    while failed_loops := [loop for loop in pool.loops if loop.done()]:
        await pool.ended(failed_loops[0])


def raised(exc: BaseException) -> BaseException:
    """``exc`` with a traceback, as an error raised in a loop has."""
    try:
        raise exc
    except BaseException as caught:
        return caught


def test_an_actor_that_dies_of_the_same_error_twice_stops_the_run_at_once(tmp_path):
    async def go():
        first = raised(RuntimeError("engine step failed at 0x7f3a2b (request 12)"))
        again = raised(RuntimeError("engine step failed at 0x7f9c00 (request 31)"))  # numbers aside, the same
        pool = build_pool(tmp_path, [first, again])
        with pytest.raises(ActorKeepsFailing) as stopped:
            await end_failed_loops(pool)
        return pool, str(stopped.value)

    pool, message = asyncio.run(go())
    assert pool.total_restarts == 1  # actor-0 was replaced once; actor-1 was not, though 3 were allowed
    assert pool.run.said[0].startswith("actor-0 stopped: RuntimeError: engine step failed at 0x7f3a2b (request 12)")
    assert message.startswith("actor-1 stopped: RuntimeError: engine step failed at 0x7f9c00 (request 31); ")
    assert "actor-0 died of the same error before, so a new actor would too: fix what it names" in message
    assert message.endswith(f"full log: {tmp_path / 'logs' / 'actor-1.log'}")
    assert issubclass(ActorKeepsFailing, ActorFailed)  # the run checkpoints as after any actor failure
    for name, where in (("actor-0", "0x7f3a2b"), ("actor-1", "0x7f9c00")):  # each log ends with its own error
        log = (tmp_path / "logs" / f"{name}.log").read_text()
        assert f"--- {name} stopped; the driver saw this error ---\nTraceback" in log
        assert log.rstrip().endswith(
            f"RuntimeError: engine step failed at {where} (request {12 if where[-1] == 'b' else 31})"
        )


def test_different_errors_and_silent_kills_are_replaced_up_to_the_limit(tmp_path):
    async def go():
        # both actors die without raising (kill -9), their logs ending with the same (handled) error,
        # then each dies of its own error: all four replaced; actor-0's third death is one past its limit
        (tmp_path / "logs").mkdir()
        for name in ("actor-0", "actor-1"):
            (tmp_path / "logs" / f"{name}.log").write_text("ValueError: reward failed (scored 0)\n")
        kill = ActorDiedError()
        deaths = [kill, kill, RuntimeError("one thing"), RuntimeError("another"), RuntimeError("a third")]
        pool = build_pool(tmp_path, deaths, max_restarts=2)
        with pytest.raises(ActorFailed) as raised:
            await end_failed_loops(pool)
        return pool, raised.value

    pool, error = asyncio.run(go())
    assert type(error) is ActorFailed and str(error).startswith(
        "actor-0 stopped: RuntimeError: a third; it was replaced 2"
    )
    assert pool.total_restarts == 4
    assert pool.run.said[0].startswith(
        f"actor-0 stopped: {KILLED}; the last error in its log: ValueError: reward failed (scored 0); "
        "starting a new one"
    )


@pytest.mark.parametrize("text,said", [
    ("The actor died unexpectedly before finishing this task.\n\tclass_name: LearnerWorker\n\tpid: 8179\n"
     "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: "
     "Worker unexpectedly exits with a connection error code 2. End of file. Some common causes include: (1) the "
     "process was killed by the OOM killer due to high memory usage, (2) ray stop --force was called, or (3) ...",
     "its process (pid 8179) ended without raising an error: a signal killed it (kill -9, or the kernel's OOM "
     "killer: see dmesg) or it crashed"),
    ("The actor died because its node has died. Node Id: 9f2c\n\tpid=77",
     "its process (pid 77) was lost with its node (the machine stopped or left the cluster)"),
    ("Task was killed due to the node running low on memory. Worker exit type: NODE_OUT_OF_MEMORY",
     "Ray's memory monitor killed its process: its node ran low on memory"),
    ("The actor is dead because it was killed by `ray.kill`. Worker exit type: INTENDED_USER_EXIT",
     "its process was stopped on purpose (ray stop, or its job ended)"),
    ("The actor 487a is unavailable: The actor is temporarily unavailable: RpcError: RPC error: Socket closed",
     "its process cannot be reached: its node left the cluster, or the process hangs"),
    ("something else\nmore", "something else"),
])  # fmt: skip
def test_a_dead_process_is_said_in_words_not_in_rays_paragraph(text, said):
    from runtime.supervise import ray_death

    assert ray_death(text) == said
