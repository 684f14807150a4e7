"""A reward model as a reward source: a Hugging Face sequence-classification model on its own Ray actors.

``reward.model`` names the model; the part ``{function: model, weight: w}`` of ``reward.functions``
uses it. Its value for a completion is the logit of the model's single label on the prompt and the
completion: rendered with the tokenizer's chat template as a user turn and an assistant turn when it
has one (reward models are trained on conversations), else the two texts concatenated.

``RewardModelActor`` runs in its own process, placed like every other process
(``resources.reward_model``: ``launch/plan.py``); the generation actors reach it by its name through
a ``RewardModelClient``, which sends one call per reward call (the sync actor's whole generate call
at once) and waits at most ``reward.timeout_s``. The actor scores in batches of
``reward.model.batch_size`` sequences.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from typing import Any

from actors.config import RewardModelConfig
from schema.process import ignore_sigterm


class RewardModelActor:
    """Owns the reward model. Placement (CPUs/GPUs) is given by ``cluster/``, not here."""

    def __init__(self, cfg: RewardModelConfig, name: str = "reward-model-0", log_path: str | None = None):
        ignore_sigterm()  # a SIGTERM to every process of a job is the driver's to act on
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from cluster.logs import redirect_output

        redirect_output(log_path)
        self.cfg, self.name = cfg, name
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.path)
        self.model = AutoModelForSequenceClassification.from_pretrained(cfg.path, dtype=dtype).to(self.device).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(
                f"reward.model.path {cfg.path} has {self.model.config.num_labels} labels; a reward model has one "
                "(its logit is the reward)"
            )
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model.config.pad_token_id = self.tokenizer.pad_token_id  # the last non-pad token is scored
        self.tokenizer.truncation_side = "left"  # keep the completion when a sequence is too long
        self.template = bool(getattr(self.tokenizer, "chat_template", None))
        print(f"[{name}] reward model ready (pid {os.getpid()}, {cfg.path}, {cfg.dtype}, {self.device})", flush=True)

    def ready(self) -> dict[str, Any]:
        import ray

        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"
        return {"name": self.name, "pid": os.getpid(), "node": node}

    def text(self, prompt: str, completion: str) -> str:
        if not self.template:
            return prompt + completion
        chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        return self.tokenizer.apply_chat_template(chat, tokenize=False)

    def score(self, prompts: list[str], completions: list[str]) -> list[float]:
        """The single label's logit for each (prompt, completion), in batches of ``batch_size``."""
        import torch

        texts = [self.text(p, c) for p, c in zip(prompts, completions, strict=True)]
        out: list[float] = []
        for start in range(0, len(texts), self.cfg.batch_size):
            batch = self.tokenizer(
                texts[start : start + self.cfg.batch_size],
                padding=True,
                truncation=True,
                max_length=self.cfg.max_length,
                return_tensors="pt",
            ).to(self.device)
            with torch.no_grad():
                logits = self.model(**batch).logits  # [B, 1]
            out.extend(logits[:, 0].float().tolist())
        return out


class RewardModelClient:
    """A generation actor's handle on the reward model actors (by name); calls alternate between them.
    ``score`` never raises: a failed or late call returns the error."""

    def __init__(self, names: list[str], timeout_s: float, handles: list | None = None):
        import ray

        self.names, self.timeout_s = names, timeout_s
        self.handles = handles if handles is not None else [ray.get_actor(n) for n in names]
        self._next = itertools.cycle(range(len(self.handles)))

    def submit(self, prompts: list[str], completions: list[str]):
        """Start a call; ``result`` waits for it."""
        return self.handles[next(self._next)].score.remote(prompts, completions)

    def result(self, ref, n: int) -> list[float] | str:
        import ray

        try:
            return self._checked(ray.get(ref, timeout=self.timeout_s), n)
        except ray.exceptions.GetTimeoutError:
            ray.cancel(ref)
            return self._late()
        except Exception as exc:  # the model actor failed or died: its samples score 0, the run goes on
            return self._failed(exc)

    async def score_async(self, prompts: list[str], completions: list[str]) -> list[float] | str:
        ref = self.submit(prompts, completions)
        try:
            values = await asyncio.wait_for(asyncio.ensure_future(ref), self.timeout_s)
            return self._checked(values, len(prompts))
        except asyncio.TimeoutError:
            import ray

            ray.cancel(ref)
            return self._late()
        except Exception as exc:
            return self._failed(exc)

    def _late(self) -> str:
        return f"TimeoutError: reward model call took longer than reward.timeout_s = {self.timeout_s:g} s"

    @staticmethod
    def _failed(exc: BaseException) -> str:
        text = str(exc).strip().splitlines()
        return f"RewardModelError: {type(exc).__name__}: {text[-1] if text else ''}"

    @staticmethod
    def _checked(values: list[float], n: int) -> list[float] | str:
        if len(values) != n:
            return f"RewardModelError: {len(values)} scores for {n} completions"
        return values
