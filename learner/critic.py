"""The value model for PPO: a transformer with a scalar head, ``V(s_t)`` per position.

It starts from the policy's transformer (``init: policy``), from a reward-model
checkpoint (a sequence-classification model with one label: its score head becomes
the value head), or from random weights of the checkpoint's architecture. It may be a
smaller model than the policy as long as it shares the tokenizer.
"""

from __future__ import annotations

import torch
from torch import nn


class ValueModel(nn.Module):
    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **model_inputs
    ) -> torch.Tensor:
        """``[b, L] -> [b, L]`` values of each position's state (``position_ids`` etc. pass through,
        so packed rows work)."""
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, **model_inputs).last_hidden_state
        return self.value_head(hidden).squeeze(-1)


def build_value_model(path: str, init: str, seed: int, attn_implementation: str | None = None) -> ValueModel:
    """The value model of ``init`` from ``path``; ``attn_implementation`` as for ``from_pretrained``
    (None: transformers' default), the policy's (``learner/attention.py``)."""
    from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(path)
    attn = {"attn_implementation": attn_implementation} if attn_implementation else {}
    if init == "fresh":
        model = ValueModel(AutoModel.from_config(config, dtype=torch.float32, **attn), config.hidden_size)
    elif init == "policy":
        model = ValueModel(AutoModel.from_pretrained(path, dtype=torch.float32, **attn), config.hidden_size)
        nn.init.zeros_(model.value_head.weight)  # start at V = 0: no made-up baseline on step 0
        nn.init.zeros_(model.value_head.bias)
    elif init == "reward_model":
        rm = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32, **attn)
        backbone = getattr(rm, rm.base_model_prefix)
        model = ValueModel(backbone, config.hidden_size)
        with torch.no_grad():
            model.value_head.weight.copy_(rm.score.weight)
            if getattr(rm.score, "bias", None) is not None:
                model.value_head.bias.copy_(rm.score.bias)
            else:
                model.value_head.bias.zero_()
    else:
        raise ValueError(f"unknown critic init {init!r}; use policy, reward_model or fresh")
    return model
