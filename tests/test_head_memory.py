"""The learner's vocabulary-sized tensors and masks on the dense (sdpa) path (review B6, issue 37 item 8).

* The LM head runs on the scored positions only, whatever the row layout (``learner/head.py``): a
  multi-row sdpa micro-batch produces no ``[R, Lr, V]`` logits (nor their gradient), and its log-probs,
  entropies and gradients are those of the full logits.
* ``RankBatch`` packs a micro-batch when a pass reaches it and releases it before the next: one block
  mask ``[R, 1, Lr, Lr]`` is alive at a time, and the packed tensors are the same as packed up front.
"""

from __future__ import annotations

import asyncio
import os
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import learner.rank_batch
import tests.test_learner_group
from cluster.memory import logits_bytes as scored_bytes
from learner.head import scored_logits
from learner.packing import pack_range, packed_completion_logprobs
from tests.reference_batch import rank_batch
from tests.standins import deepspeed_engine
from tests.test_learner_group import batches, fake_group
from tests.test_packing import SHAPES, _random_seqs
from tests.tolerance import PACKED_LOGPROB_ATOL, reduction_rtol


class VocabTensors(TorchDispatchMode):
    """Records every tensor an op produces whose last dimension is the vocabulary (forward and
    backward; not of shape ``skip``): its rows (``numel / V``), and the peak bytes of such tensors
    alive at once."""

    def __init__(self, vocab: int, skip: tuple[int, ...] = ()):
        super().__init__()
        self.vocab, self.skip, self.rows, self.peak = vocab, skip, [], 0
        self.storages: dict[int, int] = {}  # data_ptr -> bytes of each live storage (a view shares one)

    def _gone(self, ptr: int) -> None:
        self.storages.pop(ptr, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.vocab and t.shape != self.skip:
                self.rows.append(t.numel() // self.vocab)
                storage = t.untyped_storage()
                if storage.data_ptr() not in self.storages:
                    self.storages[storage.data_ptr()] = storage.nbytes()
                    weakref.finalize(storage, self._gone, storage.data_ptr())
                    self.peak = max(self.peak, sum(self.storages.values()))
        return out


@pytest.fixture(scope="module")
def mha_model_dir(tmp_path_factory) -> str:
    """The tiny Qwen2 with 4 key/value heads: its vocabulary (64) is then no other tensor's last dimension
    (hidden and k/v projections 128, heads 32, MLP 256)."""
    from actors.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("mha") / "tiny", num_kv_heads=4))


def _record_packed(monkeypatch) -> list:
    """Every micro-batch RankBatch packs, as it packs it: (its scored positions N, its mask)."""
    packed = []

    def recording(*args, **kwargs):
        micro = pack_range(*args, **kwargs)
        packed.append((int(micro.completion_valid.sum()), micro.attention_mask))
        return micro

    monkeypatch.setattr(learner.rank_batch, "pack_range", recording)
    return packed


def test_a_multi_row_sdpa_step_makes_no_logits_for_unscored_positions(mha_model_dir, monkeypatch):
    # learner.token_budget=40 over 16 sequences of 4..11 tokens: micro-batches of several rows (rows as long
    # as the longest sequence, a boolean mask: sdpa's layout). Before, every one made [R, Lr, V] logits (and
    # their gradient): R * Lr >= the micro-batch's tokens, more than its N scored positions.
    packed = _record_packed(monkeypatch)
    group = fake_group(mha_model_dir, "learner.token_budget=40")
    seen = VocabTensors(vocab=64, skip=(128, 64))  # the tiny vocabulary; skip the head weight's transpose [H, V]
    with seen:
        asyncio.run(group.train_step(batches()))
    assert packed and any(mask is not None and mask.size(0) > 1 for _, mask in packed)  # multi-row micro-batches
    largest = max(n for n, _ in packed)
    assert seen.rows and max(seen.rows) <= largest, (max(seen.rows), largest)


def _forgetful_engine(module, lr: float):
    """The fake DeepSpeed engine (``tests/standins.py``), less its mock's record of every call: that record
    holds each forward's arguments, every micro-batch's mask with them, which DeepSpeed does not."""
    engine = deepspeed_engine(module, lr)
    forward = engine.side_effect

    def call(*args, **kwargs):
        engine.reset_mock()  # the calls recorded so far, this one's too; side effects and return values stay
        return forward(*args, **kwargs)

    engine.side_effect = call
    return engine


def test_rank_batch_holds_one_mask_at_a_time(tiny_model_dir, monkeypatch):
    # Scoring (old log-probs: 2 epochs) and training of one step: when a micro-batch is packed, no
    # mask of an earlier one is alive. Before, RankBatch packed them all up front (every mask alive at once).
    alive_at_pack = []
    real = learner.rank_batch.pack_range

    def counting(*args, **kwargs):
        alive_at_pack.append(sum(ref() is not None for ref in refs))
        micro = real(*args, **kwargs)
        if micro.attention_mask is not None:
            refs.append(weakref.ref(micro.attention_mask))
        return micro

    refs: list = []
    monkeypatch.setattr(learner.rank_batch, "pack_range", counting)
    monkeypatch.setattr(tests.test_learner_group, "PlainEngine", _forgetful_engine)
    group = fake_group(tiny_model_dir, "learner.token_budget=40", "algorithm.loss.epochs=2")
    asyncio.run(group.train_step(batches()))
    assert max(alive_at_pack) == 0, alive_at_pack
    assert len(refs) >= 6  # every micro-batch packed for scoring and again for each of the two epochs


def test_lazily_packed_micro_batches_are_the_eager_ones_and_run_once():
    seqs = _random_seqs(SHAPES)
    batch = rank_batch(seqs, 0, mask_dtype=torch.bool, row_tokens=None, sizes=[2, 0, 3])
    starts = [0, 2, 2]
    for micro, start in zip(batch.micro_batches(), starts, strict=True):
        eager = pack_range(batch.tokens, start, micro.rows.stop, 0, "cpu", torch.bool, None)
        for again in (batch.pack(micro), batch.pack(micro)):  # every pass packs the same tensors
            assert (again.rows, again.width, again.is_dummy) == (eager.rows, eager.width, eager.is_dummy)
            assert (micro.width, micro.is_dummy) == (eager.width, eager.is_dummy)  # the plan without packing
            for name in ("input_ids", "position_ids", "attention_mask", "completion_index", "completion_ids"):
                a, b = getattr(again, name), getattr(eager, name)
                assert (a is None and b is None) or torch.equal(a, b), name
    micros = list(batch.packed(batch.micro_batches()))  # the loop is over: every one was released
    assert all(m.released and m.attention_mask is None for m in micros)
    with pytest.raises(RuntimeError, match="released after its pass"):
        micros[0].model_inputs()


def _loss_parts(model, micro, mask, weights, scored: bool):
    """log pi, entropy (tau = 0.7, EOS 2 banned before 2 tokens), the gradient of sum(w log pi), and
    sum_p |dL/dz_pv| |h_ph|: the sum of absolute terms of the head weight's gradient."""
    model.zero_grad()
    head_in = []
    hook = model.lm_head.register_forward_hook(lambda m, args, out: head_in.append(args[0].detach()))
    logits = scored_logits(model, micro) if scored else model(**micro.model_inputs()).logits
    hook.remove()
    logits.retain_grad()
    logp, ent = packed_completion_logprobs(logits, micro, mask, True, 16, 0.7, 2, (2,))
    (logp * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    G, H = logits.grad.flatten(0, 1).abs(), head_in[0].flatten(0, 1).abs()  # [rows, V], [rows, H]
    return logits.shape, logp.detach(), ent, grads, G.T @ H


def test_scored_head_gives_the_full_logits_log_probs_entropy_and_gradients(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    seqs = _random_seqs(SHAPES)  # 5 sequences of 4..210 tokens: rows of the longest, a boolean mask
    batch = rank_batch(seqs, 0, mask_dtype=torch.bool, row_tokens=None)
    micro = batch.pack(batch.minibatches[0][0])
    mask = batch.part("completion_mask", micro)
    weights = torch.linspace(-1.0, 1.0, mask.numel()).reshape(mask.shape)
    R, Lr = micro.input_ids.shape
    N = int(micro.completion_valid.sum())
    assert R > 1 and N < R * Lr
    full_shape, logp, ent, grads, _ = _loss_parts(model, micro, mask, weights, scored=False)
    shape, logp2, ent2, grads2, head_terms = _loss_parts(model, micro, mask, weights, scored=True)
    assert full_shape == (R, Lr, 64) and shape == (1, N, 64)
    # the same hidden states through the same head rows: the log-probs and entropies agree to the packing
    # tolerance (tests/tolerance.py; measured: bit-equal)
    torch.testing.assert_close(logp2, logp, atol=PACKED_LOGPROB_ATOL, rtol=0)
    torch.testing.assert_close(ent2, ent, atol=PACKED_LOGPROB_ATOL, rtol=0)
    # the head weight's gradient sum_p dL/dz_pv h_ph runs over the R * Lr positions (zeros off the scored ones)
    # or over the N scored ones: the same terms in another order, |d| <= (R Lr - 1) eps sum_p |terms|
    assert grads.keys() == grads2.keys()
    head = grads.pop("lm_head.weight")
    bound = reduction_rtol(torch.float32, R * Lr) * head_terms
    assert bool(((grads2.pop("lm_head.weight") - head).abs() <= bound).all())
    # below the head, the gradient reaching the hidden states is the same ([N, H] rows, zeros elsewhere): the
    # layers' backward repeats the same sums, so the packing tolerance relative to each gradient's scale
    # (measured: bit-equal)
    for name, g in grads.items():
        atol = PACKED_LOGPROB_ATOL * float(g.abs().max())
        torch.testing.assert_close(grads2[name], g, atol=atol, rtol=0, msg=name)


def _tiny(config_cls, **extra):
    torch.manual_seed(0)
    cfg = dict(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
    )  # fmt: skip
    return config_cls(**cfg, **extra)


def _scored_equals_full(model, mask_dtype) -> None:
    seqs = _random_seqs([(3, 4), (5, 6), (2, 3)])
    batch = rank_batch(seqs, 0, mask_dtype=mask_dtype, row_tokens=None)
    micro = batch.pack(batch.minibatches[0][0])
    with torch.no_grad():
        full = model(**micro.model_inputs()).logits  # [R, Lr, V]
        scored = scored_logits(model, micro)  # [1, N, V]
    assert micro.input_ids.size(0) > 1
    expected = full.reshape(-1, full.size(-1))[micro.logit_positions]
    torch.testing.assert_close(scored[0], expected, atol=1e-6, rtol=0)


def test_tied_embeddings_and_a_lora_head_keep_their_logits():
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tied = Qwen2ForCausalLM(_tiny(Qwen2Config, tie_word_embeddings=True)).eval()
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    _scored_equals_full(tied, torch.bool)
    adapters = LoraConfig(r=4, target_modules=["q_proj", "lm_head"], init_lora_weights=False)  # B != 0: they count
    lora = get_peft_model(Qwen2ForCausalLM(_tiny(Qwen2Config)), adapters).eval()
    assert type(lora.get_output_embeddings()).__module__.startswith("peft")  # the head is PEFT's wrapper
    _scored_equals_full(lora, torch.bool)


def test_a_soft_capped_head_keeps_its_cap():
    # Gemma2 caps after the head: z -> 5 tanh(z / 5), which its own forward applies to the scored rows
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = _tiny(Gemma2Config, final_logit_softcapping=5.0)
    model = Gemma2ForCausalLM._from_config(config, attn_implementation="eager").eval()
    _scored_equals_full(model, torch.float32)
    batch = rank_batch(_random_seqs([(3, 4), (5, 6)]), 0, mask_dtype=torch.float32, row_tokens=None)
    with torch.no_grad():
        logits = scored_logits(model, batch.pack(batch.minibatches[0][0]))
    assert float(logits.abs().max()) <= 5.0  # capped


def test_a_model_whose_head_does_not_read_the_rows_is_refused():
    class LastOnly(torch.nn.Module):  # a head on the last position only, whatever it is asked
        def __init__(self):
            super().__init__()
            self.embed, self.lm_head = torch.nn.Embedding(96, 8), torch.nn.Linear(8, 96)

        def get_output_embeddings(self):
            return self.lm_head

        def forward(self, input_ids, **kwargs):
            return type("Out", (), {"logits": self.lm_head(self.embed(input_ids)[:, -1:])})

    batch = rank_batch(_random_seqs([(3, 4), (5, 6)]), 0, mask_dtype=torch.bool, row_tokens=None)
    with pytest.raises(ValueError, match="LastOnly: its forward called the output embedding with"):
        scored_logits(LastOnly(), batch.pack(batch.minibatches[0][0]))


def logits_bytes(micro, vocab: int, itemsize: int) -> dict[str, int]:
    """Bytes of the vocabulary-sized tensors one policy micro-batch holds at the peak of its backward,
    before and after the head ran on scored rows only:

        full:   logits [R, Lr, V] + their gathered [N, V] copy + both gradients = 2 (R Lr + N) V b
        scored: logits [1, N, V] + their gradient                              = 2 N V b (the plan's term)
    """
    R, Lr = micro.input_ids.shape
    n = int(micro.completion_valid.sum())
    return {"full": 2 * (R * Lr + n) * vocab * itemsize, "scored": scored_bytes(vocab, n, itemsize)}


def test_logits_bytes_of_the_reviews_example():
    # token_budget 32768 in rows of 4096 (R = 8), 70% of the tokens scored (N = 22937), V = 151936, bf16:
    #   full   = 2 (32768 + 22937) 151936 * 2 = 33.85e9 B
    #   scored = 2 * 22937 * 151936 * 2        = 13.94e9 B
    class Micro:
        input_ids = torch.empty((8, 4096), device="meta")
        completion_valid = torch.ones(22937, dtype=torch.bool)

    got = logits_bytes(Micro, 151936, 2)
    assert got == {"full": 2 * (32768 + 22937) * 151936 * 2, "scored": 2 * 22937 * 151936 * 2}
    assert round(got["full"] / 1e9, 2) == 33.85 and round(got["scored"] / 1e9, 2) == 13.94


ZERO3_CHILD = """
import os, sys, torch
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import deepspeed
from transformers import AutoModelForCausalLM
from learner.head import scored_logits
from learner.packing import packed_completion_logprobs
from learner.worker import deepspeed_config
from learner.config import LearnerConfig
from tests.reference_batch import rank_batch
from tests.standins import deepspeed_engine
from tests.test_packing import SHAPES, _random_seqs
from tests.tolerance import PACKED_LOGPROB_ATOL
from deepspeed.utils import safe_get_full_grad

torch.distributed.init_process_group("gloo")
batch = rank_batch(_random_seqs(SHAPES), 0, mask_dtype=torch.bool, row_tokens=None)
micro = batch.pack(batch.minibatches[0][0])
mask = batch.part("completion_mask", micro)
weights = torch.linspace(-1.0, 1.0, mask.numel()).reshape(mask.shape)
out = []
for scored in (False, True):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32, attn_implementation="sdpa")
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as Qwen2.5-0.5B
    config = deepspeed_config(LearnerConfig(zero_stage=3), "float32")
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), config=config)
    logits = scored_logits(engine, micro) if scored else engine(**micro.model_inputs()).logits
    logp = packed_completion_logprobs(logits, micro, mask, False, 16, 0.7)
    engine.backward((logp * weights).sum())
    grads = {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()}
    out.append((tuple(logits.shape), logp.detach(), grads))
(full_shape, logp, grads), (shape, logp2, grads2) = out
R, Lr = micro.input_ids.shape
assert full_shape == (R, Lr, 64) and shape == (1, int(micro.completion_valid.sum()), 64), (full_shape, shape)
torch.testing.assert_close(logp2, logp, atol=PACKED_LOGPROB_ATOL, rtol=0)
for name, g in grads.items():
    torch.testing.assert_close(grads2[name], g, atol=PACKED_LOGPROB_ATOL * float(g.abs().max()), rtol=0, msg=name)
print("ok", len(grads))
"""


@pytest.mark.slow
def test_the_scored_head_under_a_real_zero3_engine_with_tied_embeddings(tiny_model_dir):
    # DeepSpeed ZeRO-3 partitions the head's (here tied) weight and gathers it in its own forward pre-hook on the
    # module; the row-picking hook runs beside it. One gloo rank in a child process (no process group is left in
    # this one): the engine's log-probs and full gradients equal those of the [R, Lr, V] logits (measured: log-probs
    # bit-equal, gradients within 2.9e-6 of 12.8)
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, "-c", ZERO3_CHILD, tiny_model_dir, port], cwd=root, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
