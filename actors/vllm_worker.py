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
