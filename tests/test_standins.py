"""The stand-ins of vLLM's and DeepSpeed's objects (``tests/standins.py``) refuse what the libraries refuse:
a method or keyword the installed class does not have, a pause mode the in-process engine rejects, tensors
sent where the async engine's msgpack hop turns them into lists. A stand-in that accepted these would let
a wrong call through to the first GPU run."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests import standins


def test_the_async_engine_refuses_a_keyword_vllm_does_not_take_and_tensors_across_its_process():
    llm = standins.async_llm()
    with pytest.raises(TypeError, match="unexpected keyword argument 'clear_caches'"):
        asyncio.run(llm.pause_generation(mode="keep", clear_caches=True))
    with pytest.raises(TypeError):
        asyncio.run(llm.pause_generation("keep"))  # keyword-only in vLLM 0.32
    with pytest.raises(AttributeError):
        asyncio.run(llm.collective_rpc("load_weights_blobs", args=(b"",)))  # neither the worker's nor ours
    # msgpack carries a tensor as [dtype, shape, bytes]: vLLM's loader would get no tensor
    with pytest.raises(TypeError, match="reload_weights got a list for 'w', not a tensor"):
        asyncio.run(llm.collective_rpc("load_named_weights", args=([("w", torch.ones(2))],)))


def test_the_in_process_engine_refuses_the_wait_mode_and_loads_tensors_as_they_are():
    worker = standins.worker()
    llm = standins.llm(worker)
    with pytest.raises(ValueError, match="'wait' pause mode is not supported in inproc-engine mode"):
        llm.sleep(1, mode="wait")
    assert llm.collective_rpc("load_named_weights", args=([("w", torch.full((2,), 3.0))],)) == [1]
    assert [(name, t.tolist()) for name, t in worker.loads[0]] == [("w", [3.0, 3.0])]


def test_deepspeeds_engine_refuses_keywords_its_methods_do_not_take():
    engine = standins.deepspeed_engine(torch.nn.Linear(2, 2), lr=0.1)
    loss = engine(torch.ones(1, 2)).sum()
    with pytest.raises(TypeError, match="unexpected keyword argument 'scale'"):
        engine.backward(loss, scale=False)  # hidden behind DeepSpeed's nvtx decorator, checked all the same
    engine.backward(loss, scale_wrt_gas=False)
    assert engine.module.weight.grad is not None and engine.get_lr() == [0.1]
    zero = standins.zero_engine(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="unexpected keyword argument 'pin'"):
        zero.offload_states(pin=True)


def test_the_worker_extension_is_called_as_both_model_runners_reload_and_clashes_with_no_worker_method():
    import inspect

    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as RunnerV2
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as RunnerV1
    from vllm.v1.worker.gpu_worker import Worker

    from actors.vllm_worker import WeightReceiver

    # the stand-in worker's runner is V1's; a GPU may run V2 (config/vllm.py, use_v2_model_runner): same call
    assert inspect.signature(RunnerV1.reload_weights) == inspect.signature(RunnerV2.reload_weights)
    ours = [name for name in vars(WeightReceiver) if not name.startswith("_")]
    assert ours and not [name for name in ours if hasattr(Worker, name) or hasattr(CPUWorker, name)]
