"""Code that runs inside vLLM's worker, next to the model (``worker_extension_cls``).

vLLM mixes this class into its worker; ``collective_rpc("load_named_weights", ...)``
calls it. Weights arrive as ``(name, tensor)`` pairs with Hugging Face names, or packed by
``actors/engine_weights.py`` when they cross into the async engine's process.
"""

from __future__ import annotations


class WeightReceiver:
    def load_named_weights(self, named_tensors: list) -> int:
        """Load new weights in place (vLLM maps HF names, e.g. q/k/v into qkv_proj)."""
        self.reload_weights(weights_iterator=iter(named_tensors), is_checkpoint_format=True)
        return len(named_tensors)

    def load_weights_blob(self, blob: bytes) -> int:
        """The same from safetensors bytes: across the engine's process boundary, RPC
        arguments are msgpack-encoded and tensors would not survive."""
        from safetensors.torch import load

        named = load(blob)
        self.reload_weights(weights_iterator=iter(named.items()), is_checkpoint_format=True)
        return len(named)

    def load_weights_shared(self, blob: bytes) -> int:
        """The same from handles (``weights_to_handles``): the tensors are rebuilt over the sender's
        memory (CUDA IPC or shared memory), loaded, and released when this returns."""
        import pickle

        named = pickle.loads(blob)  # rebuilt by torch.multiprocessing's reductions; from our own actor
        self.reload_weights(weights_iterator=iter(named), is_checkpoint_format=True)
        return len(named)

    def engine_report(self) -> dict:
        """What this worker runs with, for the actor's ready line: the attention backends of its layers
        (vLLM picks them in the worker, by device and model) and the bytes its KV cache holds (the
        allocations vLLM sized at start: ``gpu_memory_utilization`` on a GPU, ``kv_cache_memory_bytes``
        on the CPU)."""
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        layers = get_layers_from_vllm_config(self.vllm_config, AttentionLayerBase).values()
        backends = sorted({layer.get_attn_backend().get_name() for layer in layers})
        kv = getattr(self.model_runner, "kv_cache_config", None)  # set when the cache is allocated
        kv_bytes = sum(t.size for t in kv.kv_cache_tensors if not t.host_resident) if kv is not None else None
        return {"attention": "+".join(backends) or None, "kv_cache_bytes": kv_bytes}
