"""Which attention kernel the learner's models run, and so how a packed micro-batch reaches them.

A packed row holds several sequences back to back (``learner/packing.py``); attention must not
cross from one to the next. Two ways to say so:

* ``varlen``: no mask tensor. ``flash_attention_2`` finds the sequences from the position ids
  (restarting at 0 at each one) and runs ``flash_attn_varlen_func`` over them: no ``[L, L]``
  tensor exists at all. It needs ONE row per micro-batch (transformers looks for packing only
  when the batch size is 1; with more rows sequences would leak into each other), a CUDA GPU,
  the ``flash_attn`` package, and bf16/fp16 activations.
* ``dense``: a block-diagonal ``[R, 1, Lr, Lr]`` mask, boolean for ``sdpa``, additive in the
  compute dtype for ``eager``.

``sdpa`` with position-id packing (``attention_mask=None``) is NOT a varlen path in transformers
5.19: ``masking_utils._preprocess_mask_arguments`` turns the position ids into
``find_packed_sequence_indices`` and ``sdpa_mask`` then materialises the same dense
``[R, 1, L, L]`` boolean mask we build ourselves (and a mask keeps sdpa off its flash kernel).
Only where a row holds a single sequence does it build none (plain ``is_causal``); packing
does the same for a micro-batch of one sequence (``pack_range``). So on ``sdpa`` the dense mask
stays, on GPUs too.

``select_attention`` is the whole decision, a pure function of what the machine has.
"""

from __future__ import annotations

from dataclasses import dataclass, field

IMPLEMENTATIONS = ("flash_attention_2", "sdpa", "eager")  # transformers' attn_implementation names
CHOICES = ("auto", *IMPLEMENTATIONS)  # learner.attention
FLASH_DTYPES = ("bfloat16", "float16")  # flash_attn kernels take half-precision activations only
FLASH_INSTALL = "pip install -e '.[flash]' --no-build-isolation"  # the flash extra (docs/configuration.md)


@dataclass(frozen=True)
class Attention:
    """The kernel the models are loaded with and the mask form packing gives them."""

    implementation: str  # ``attn_implementation=`` for ``from_pretrained``
    varlen: bool  # True: no mask tensor, one row per micro-batch; False: a dense block mask
    fallback: str = field(default="", compare=False)  # why ``auto`` did not pick flash_attention_2 ("": it did)

    @property
    def mask(self) -> str:
        """``none`` (varlen), ``bool`` (sdpa) or ``additive`` (eager, in the compute dtype)."""
        return "none" if self.varlen else ("bool" if self.implementation == "sdpa" else "additive")

    def describe(self) -> str:
        """What a rank's start-up line says: the kernel, its mask, and on a GPU why ``auto`` fell back
        to the dense mask, e.g. ``sdpa attention (bool mask; auto: flash_attn does not import: pip
        install -e '.[flash]' --no-build-isolation)``."""
        why = self.fallback + (f": {FLASH_INSTALL}" if "flash_attn" in self.fallback else "")
        return f"{self.implementation} attention ({self.mask} mask{f'; auto: {why}' if why else ''})"


def select_attention(requested: str, cuda: bool, flash_attn: bool, dtype: str) -> Attention:
    """The attention for ``learner.attention = requested`` on a machine with (``cuda``) a GPU and
    (``flash_attn``) an importable ``flash_attn``, training in ``dtype`` (``model.dtype``).

    ``auto``: FlashAttention-2 (varlen) where it can run, else sdpa with the dense block mask.
    A forced ``flash_attention_2`` that cannot run raises one line naming what is missing.
    """
    if requested not in CHOICES:
        raise ValueError(f"learner.attention={requested!r}: choose one of {', '.join(CHOICES)}")
    missing = [
        what
        for what, ok in (
            ("no CUDA GPU", cuda),
            ("flash_attn does not import", flash_attn),
            (f"model.dtype is {dtype}, not bfloat16/float16", dtype in FLASH_DTYPES),
        )
        if not ok
    ]
    if requested == "auto":
        if not missing:
            return Attention("flash_attention_2", varlen=True)
        return Attention("sdpa", varlen=False, fallback="; ".join(missing) if cuda else "")  # a CPU has no choice
    if requested == "flash_attention_2":
        if missing:
            raise ValueError(
                f"learner.attention=flash_attention_2 cannot run here ({'; '.join(missing)}): "
                "use learner.attention=auto or sdpa"
            )
        return Attention("flash_attention_2", varlen=True)
    return Attention(requested, varlen=False)


def flash_attn_importable() -> bool:
    """``flash_attn`` imports (a build against another torch fails at import, not at lookup)."""
    try:
        import flash_attn  # noqa: F401
    except Exception:  # ImportError, or OSError/RuntimeError from a mismatched CUDA extension
        return False
    return True
