"""Sequence packing: packed == unpadded on the tiny Qwen2, the packed layout, and the planner."""

import random

import pytest
import torch

from learner.algorithms.aggregation import token_weights
from learner.algorithms.policy_losses import ppo_clip_loss
from learner.packing import (
    block_causal_mask,
    packed_at_completion,
    packed_completion_logprobs,
    plan_micro_batches,
)
from tests.reference_batch import TrainSequence, completion_logprobs, packed, pad_sequences, rank_batch
from tests.tolerance import PACKED_LOGPROB_ATOL, reduction_rtol

PAD = 0


def _seq(prompt, completion, with_optional=False, mask=None):
    c = len(completion)
    extra = {}
    if with_optional:
        extra = dict(
            old_logprobs=[-0.1 * (t + 1) for t in range(c)],
            ref_logprobs=[-0.2 * (t + 1) for t in range(c)],
            returns=[0.5 + t for t in range(c)],
            old_values=[0.25 * t for t in range(c)],
        )
    return TrainSequence(
        prompt_token_ids=list(prompt),
        completion_token_ids=list(completion),
        completion_mask=mask if mask is not None else [1] * c,
        advantages=[0.1 * (t + 1) for t in range(c)],
        sampler_logprobs=[-0.5 - 0.01 * t for t in range(c)],
        policy_versions=[3] * c,
        **extra,
    )


def _random_seqs(shapes, seed=0):
    """Sequences of (prompt, completion) lengths with token ids from the tiny vocab (4..52)."""
    g = random.Random(seed)
    return [
        _seq(
            [g.randrange(4, 53) for _ in range(p)],
            [g.randrange(4, 53) for _ in range(c)],
            mask=[0 if t == 1 else 1 for t in range(c)],
        )  # one untrained token inside each completion
        for p, c in shapes
    ]


# very different lengths: 4 .. 210 tokens, a 1-token completion, a 1-token prompt
SHAPES = [(3, 1), (20, 190), (1, 7), (9, 33), (5, 2)]


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    out = {}
    for impl in ("sdpa", "eager"):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation=impl)
        out[impl] = model.eval()
    return out


def _unpadded_logprobs(model, seqs):
    """One forward per sequence, no padding, no packing: the reference. List of [c_i] tensors."""
    out = []
    for s in seqs:
        p = len(s.prompt_token_ids)
        ids = torch.tensor([s.prompt_token_ids + s.completion_token_ids])
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)  # [len, V]
        comp = torch.tensor(s.completion_token_ids)
        out.append(
            logp[p - 1 : p - 1 + len(comp)].gather(1, comp[:, None]).squeeze(1)
            * torch.tensor(s.completion_mask, dtype=torch.float)
        )
    return out


# --------------------------------------------------------------------------- layout


def test_pack_layout_by_hand():
    seqs = [_seq([5, 6], [7, 8, 9]), _seq([10], [11])]
    b, _ = packed(seqs, PAD)
    # row: 5 6 | 7 8 9 | 10 | 11   (no padding: L = 5 + 2 = 7)
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1]]  # restarts at the second sequence
    assert b.seq_lens == [5, 2]
    # completion tokens sit at s_i + p_i + t: seq 0 at 0 + 2 + (0, 1, 2), seq 1 at 5 + 1 + 0
    assert b.completion_index.tolist() == [[2, 3, 4], [6, 0, 0]]
    assert b.completion_valid.tolist() == [[True, True, True], [True, False, False]]
    assert b.completion_ids.tolist() == [[7, 8, 9], [11, 0, 0]]
    # the outputs that predict them: positions p - 1
    assert b.logit_positions.tolist() == [1, 2, 3, 5]
    assert b.completion_lengths == [3, 1]
    allowed = (b.attention_mask[0, 0] == 0).int().tolist()
    assert allowed == [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0],
        [0, 0, 0, 0, 0, 1, 0],  # the second sequence never sees the first
        [0, 0, 0, 0, 0, 1, 1],
    ]
    assert b.attention_mask.shape == (1, 1, 7, 7)
    assert b.attention_mask.min().item() == torch.finfo(torch.float32).min


def test_completion_fields_match_padded_batch():
    seqs = [_seq([5, 6], [7, 8, 9], mask=[1, 0, 1], with_optional=True), _seq([10], [11], with_optional=True)]
    (inputs, tokens), padded = packed(seqs, PAD), pad_sequences(seqs, PAD)
    assert torch.equal(inputs.completion_ids, padded.completion_ids)
    for name in ("completion_mask", "advantages", "sampler_logprobs", "old_logprobs", "ref_logprobs", "returns"):
        assert torch.equal(getattr(tokens, name), getattr(padded, name)), name
    assert torch.equal(tokens.old_values, padded.old_values)
    assert packed([_seq([1], [2])], PAD)[1].old_logprobs is None  # absent fields stay absent


def test_the_table_keeps_every_micro_batch_in_its_rows():
    # three sequences in micro-batches of 2 and 1: the second micro-batch reads table row 2 only
    seqs = [_seq([5], [7, 8], with_optional=True), _seq([6], [9], with_optional=True), _seq([4], [1, 2, 3], True)]
    batch = rank_batch(seqs, PAD, sizes=[2, 1])
    first, second = batch.minibatches[0]
    assert (first.rows, first.width, second.rows, second.width) == (slice(0, 2), 2, slice(2, 3), 3)
    assert batch.view(second).advantages.tolist() == [pytest.approx([0.1, 0.2, 0.3])]
    batch.write("old_logprobs", second, torch.tensor([[-1.0, -2.0, -3.0]]))  # what scoring stores ...
    assert batch.view(second).old_logprobs.tolist() == [[-1.0, -2.0, -3.0]]  # ... is what training reads
    assert batch.export_flat("old_logprobs").tolist() == pytest.approx([-0.1, -0.2, -0.1, -1.0, -2.0, -3.0])


def test_packed_at_completion_reads_position_before_each_token():
    b, _ = packed([_seq([5, 6], [7, 8, 9]), _seq([10], [11])], PAD)
    values = torch.arange(7.0)[None] * 10  # V(s_j) = 10 j, [1, L]
    # completion positions [[2,3,4],[6,-,-]] -> read j = p - 1 = [[1,2,3],[5,0,0]] -> x10
    assert packed_at_completion(values, b).tolist() == [[10.0, 20.0, 30.0], [50.0, 0.0, 0.0]]


def test_block_causal_mask_bool_form():
    # seq_lens [2, 1]: [[ok, -, -], [ok, ok, -], [-, -, ok]]
    assert block_causal_mask([[2, 1]], torch.bool)[0, 0].tolist() == [
        [True, False, False],
        [True, True, False],
        [False, False, True],
    ]


def test_block_causal_mask_in_bfloat16():
    m = block_causal_mask([[1, 2]], torch.bfloat16)
    # [[ok, -, -], [-, ok, -], [-, ok, ok]]
    assert (m[0, 0] == 0).int().tolist() == [[1, 0, 0], [0, 1, 0], [0, 1, 1]]
    assert m.dtype == torch.bfloat16 and m.min().item() == torch.finfo(torch.bfloat16).min


# --------------------------------------------------------------------------- packed == unpadded


@pytest.mark.parametrize(
    "impl,mask_dtype",
    [("sdpa", torch.float32), ("eager", torch.float32), ("sdpa", torch.bool), ("sdpa", None), ("eager", None)],
    ids=["sdpa-4d-additive", "eager-4d-additive", "sdpa-4d-bool", "sdpa-position-ids", "eager-position-ids"],
)
def test_packed_logprobs_equal_unpadded(models, impl, mask_dtype):
    model = models[impl]
    seqs = _random_seqs(SHAPES)
    with torch.no_grad():
        reference = _unpadded_logprobs(model, seqs)
        batch, tokens = packed(seqs, PAD, mask_dtype=mask_dtype)
        logits = model(**batch.model_inputs()).logits
        logprobs, entropy = packed_completion_logprobs(logits, batch, tokens.completion_mask, with_entropy=True)
        padded_batch = pad_sequences(seqs, PAD)
        padded_logits = model(input_ids=padded_batch.input_ids, attention_mask=padded_batch.attention_mask).logits
        padded, padded_entropy = completion_logprobs(padded_logits, padded_batch, with_entropy=True)
    for i, ref in enumerate(reference):
        c = len(ref)
        assert (logprobs[i, :c] - ref).abs().max().item() < PACKED_LOGPROB_ATOL, f"sequence {i}"
        assert (logprobs[i, c:] == 0).all()
    assert (logprobs - padded).abs().max().item() < PACKED_LOGPROB_ATOL
    # H = -sum_v p_v log p_v: a mean of log-probs under p, so it moves no more than they do
    assert (entropy - padded_entropy).abs().max().item() < PACKED_LOGPROB_ATOL
    assert logprobs[0, 0].item() < 0  # a real log-prob, not a zeroed slot


@pytest.mark.parametrize("row_tokens", [None, 200, 250], ids=["rows-of-longest", "rows-200", "rows-250"])
def test_multi_row_packing_equals_unpadded(models, row_tokens):
    # several rows, each holding whole sequences back to back, padded at the row ends only
    model = models["sdpa"]
    seqs = _random_seqs(SHAPES)
    with torch.no_grad():
        reference = _unpadded_logprobs(model, seqs)
        batch, tokens = packed(seqs, PAD, mask_dtype=torch.bool, row_tokens=row_tokens)
        assert batch.input_ids.shape[0] > 1  # really several rows
        logprobs = packed_completion_logprobs(model(**batch.model_inputs()).logits, batch, tokens.completion_mask)
    for i, ref in enumerate(reference):
        assert (logprobs[i, : len(ref)] - ref).abs().max().item() < PACKED_LOGPROB_ATOL, f"sequence {i}"


def test_rows_are_first_fit_decreasing_and_never_split_a_sequence():
    from learner.packing import assign_rows

    # lengths 5, 3, 4, 2 into rows of the longest (5): [5], [4], [3, 2]
    assert assign_rows([5, 3, 4, 2], None) == [[0], [2], [1, 3]]
    # rows of 7: [5, 2], [4, 3]
    assert assign_rows([5, 3, 4, 2], 7) == [[0, 3], [2, 1]]
    assert assign_rows([9, 1], 4) == [[0], [1]]  # a longer sequence still gets its own row


def test_without_mask_or_positions_sequences_leak(models):
    # negative control: the same row with neither a mask nor restarting positions is plain causal
    # attention over all sequences, and the later sequences' log-probs move far beyond PACKED_LOGPROB_ATOL
    model = models["sdpa"]
    seqs = _random_seqs(SHAPES)
    with torch.no_grad():
        reference = _unpadded_logprobs(model, seqs)
        batch, tokens = packed(seqs, PAD, mask_dtype=None)
        mask = tokens.completion_mask
        leaky = packed_completion_logprobs(model(input_ids=batch.input_ids).logits, batch, mask)
        # and position_ids without use_cache=False: transformers skips its packing detection
        no_cache_off = packed_completion_logprobs(
            model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits, batch, mask
        )
    assert (leaky[0, :1] - reference[0]).abs().max() < PACKED_LOGPROB_ATOL  # the first sees nothing earlier
    assert (leaky[1, :190] - reference[1]).abs().max() > 1e-2
    assert (no_cache_off[1, :190] - reference[1]).abs().max() > 1e-2


def test_logits_to_keep_gives_the_same_logprobs(models):
    model = models["sdpa"]
    seqs = _random_seqs(SHAPES)
    batch, tokens = packed(seqs, PAD)
    with torch.no_grad():
        full = packed_completion_logprobs(model(**batch.model_inputs()).logits, batch, tokens.completion_mask)
        kept_logits = model(**batch.model_inputs(), logits_to_keep=batch.logit_positions).logits
        kept = packed_completion_logprobs(kept_logits, batch, tokens.completion_mask)
    # N = 1 + 190 + 7 + 33 + 2 = 233 predicting positions instead of L = 271
    assert kept_logits.shape[1] == 233 and batch.input_ids.shape[1] == 271
    # The same hidden states h; only the lm_head's GEMM runs on 233 rows instead of 271, and the GEMM may
    # block its d = 128-term dot products otherwise (it does under MKL_CBWR=COMPATIBLE): each logit moves by
    # |d z_v| <= 127 eps sum_i |h_i W_vi|, and z_y - lse(z) by at most twice the largest (measured: 2.4e-7 of
    # about 6e-5 allowed); a position read off by one is off by units
    with torch.no_grad():
        h = model.model(**batch.model_inputs()).last_hidden_state  # [1, L, d], after the final norm
        weight = model.lm_head.weight  # [V, d]
        d_logit = reduction_rtol(torch.float32, weight.shape[1]) * (h.abs() @ weight.abs().T).max()
    assert (kept - full).abs().max() <= 2 * d_logit


def test_packed_gradients_equal_sum_of_per_sequence_gradients(models):
    model = models["sdpa"]
    seqs = _random_seqs([(3, 4), (12, 60), (2, 9)], seed=1)
    params = [p for p in model.parameters() if p.requires_grad]
    # objective: sum_i sum_t A_{i,t} log pi(o_{i,t}) (advantages differ per token)
    reference = [torch.zeros_like(p) for p in params]
    for s in seqs:
        model.zero_grad()
        (one,) = _unpadded_logprobs(model, [s])
        (one * torch.tensor(s.advantages)).sum().backward()
        for acc, p in zip(reference, params, strict=True):
            acc += p.grad
    model.zero_grad()
    batch, tokens = packed(seqs, PAD)
    logprobs = packed_completion_logprobs(model(**batch.model_inputs()).logits, batch, tokens.completion_mask)
    (logprobs * tokens.advantages).sum().backward()
    # fp32 summation order differs (one row vs three): each gradient element sums over the row's L = 90
    # positions (dW = sum_p delta_p x_p^T), so it moves by (L - 1) eps sum_p |terms| = 1.06e-5 sum_p |terms|.
    # The terms are not kept; |g| plus the largest |g| of the same tensor stands in for their sum (gradients
    # reach ~50 here; measured under every row of bench/numerics_matrix.sh: at most 4.9% of this bound, where
    # the former 1e-5 + 1e-5 |g| was 71% used under MKL_CBWR=COMPATIBLE)
    rtol = reduction_rtol(torch.float32, batch.input_ids.numel())
    for p, ref in zip(params, reference, strict=True):
        assert ((p.grad - ref).abs() <= rtol * (ref.abs() + ref.abs().max())).all()
    model.zero_grad()
    assert max(r.abs().max().item() for r in reference) > 1e-3  # the gradients are not trivially 0


def test_empty_micro_batch_dummy_has_zero_loss_and_zero_gradients(models):
    # an empty planned micro-batch still runs forward + backward (ZeRO collectives), with weight 0
    model = models["sdpa"]
    batch, tokens = packed([], PAD)
    assert batch.is_dummy and batch.completion_lengths == [] and batch.input_ids.tolist() == [[PAD, PAD]]
    assert tokens.completion_mask.tolist() == [[0.0]]  # the table gives the dummy mask 0
    model.zero_grad(set_to_none=True)
    logprobs = packed_completion_logprobs(model(**batch.model_inputs()).logits, batch, tokens.completion_mask)
    weights = token_weights(tokens.completion_mask, "token_mean", num_tokens=100.0)  # mask 0 -> w = 0
    old, adv = torch.zeros_like(logprobs), torch.ones_like(logprobs)
    loss, _ = ppo_clip_loss(logprobs, old, adv, tokens.completion_mask, weights)
    loss.backward()
    assert loss.item() == 0.0
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads)  # every parameter took part in backward ...
    assert all((g == 0).all() for g in grads)  # ... with a zero gradient
    model.zero_grad()


# --------------------------------------------------------------------------- planner


def test_plan_by_hand():
    # longest first onto the least-loaded rank (ties -> rank 0):
    #   10 -> r0 (10) | 8 -> r1 (8) | 7 -> r1 (15) | 5 -> r0 (15) | 3 -> r0 (18, tie at 15) | 2 -> r1 (17)
    # first-fit decreasing, budget 10:
    #   r0: 10 -> [0]; 5 -> new [5]; 3 -> joins [5] (8)          -> [[0], [1, 5]]
    #   r1: 8 -> [4];  7 -> new [2]; 2 -> joins [4] (10 <= 10)   -> [[3, 4], [2]]
    lengths = [10, 3, 7, 2, 8, 5]
    assert plan_micro_batches(lengths, ranks=2, token_budget=10) == [[[[0], [1, 5]]], [[[3, 4], [2]]]]


def test_plan_over_budget_sequence_alone():
    # 25 > 10 gets its own micro-batch; 4 + 4 share one
    assert plan_micro_batches([25, 4, 4], ranks=1, token_budget=10) == [[[[0], [1, 2]]]]


def test_plan_pads_ranks_to_the_same_micro_batch_count():
    # 10 -> r0, 5 -> r1, 5 -> r1 (5 < 10). budget 6: r0 [[0]], r1 [[1], [2]] -> r0 gets an empty one
    assert plan_micro_batches([10, 5, 5], ranks=2, token_budget=6) == [[[[0], []]], [[[1], [2]]]]


def test_plan_more_ranks_than_sequences():
    # 3 ranks, 1 sequence: ranks 1 and 2 run one dummy micro-batch each
    assert plan_micro_batches([4], ranks=3, token_budget=8) == [[[[0]]], [[[]]], [[[]]]]


def test_plan_minibatches_are_contiguous_ranges():
    # n = 7, M = 2: minibatch 0 = [0, 7 // 2) = {0, 1, 2}, minibatch 1 = {3, 4, 5, 6}
    plan = plan_micro_batches([3, 9, 4, 1, 1, 6, 2], ranks=2, token_budget=100, minibatches=2)
    for m, expected in enumerate([{0, 1, 2}, {3, 4, 5, 6}]):
        got = {i for rank in plan for micro in rank[m] for i in micro}
        assert got == expected


@pytest.mark.parametrize("ranks,budget,minibatches", [(1, 512, 1), (2, 1024, 1), (4, 700, 2), (3, 64, 3)])
def test_plan_invariants_on_a_long_tail(ranks, budget, minibatches):
    g = random.Random(ranks * 100 + budget)
    lengths = [min(4096, int(g.lognormvariate(4.5, 1.0)) + 1) for _ in range(300)]  # median ~90, tail to 4096
    plan = plan_micro_batches(lengths, ranks, budget, minibatches)
    assert plan == plan_micro_batches(lengths, ranks, budget, minibatches)  # deterministic
    assert len(plan) == ranks
    seen = sorted(i for rank in plan for mb in rank for micro in mb for i in micro)
    assert seen == list(range(len(lengths)))  # every index exactly once
    for m in range(minibatches):
        counts = {len(rank[m]) for rank in plan}
        assert len(counts) == 1  # same number of micro-batches on every rank
        for rank in plan:
            for micro in rank[m]:
                assert len(micro) <= 1 or sum(lengths[i] for i in micro) <= budget  # budget, or a lone long one
        tokens = [sum(lengths[i] for micro in rank[m] for i in micro) for rank in plan]
        longest = max(lengths[i] for rank in plan for micro in rank[m] for i in micro)
        assert max(tokens) - min(tokens) <= longest  # LPT balance bound


@pytest.mark.parametrize("args", [([], 1, 10, 1), ([3], 0, 10, 1), ([3], 1, 0, 1), ([3], 1, 10, 2), ([0], 1, 10, 1)])
def test_plan_bad_arguments_fail(args):
    with pytest.raises(ValueError):
        plan_micro_batches(*args)


def test_min_tokens_bans_the_stop_tokens_at_the_first_completion_positions_only(models):
    # The engine cannot sample a stop token before rollout.min_tokens: it sets their logits to -inf and
    # reports the log-probs of what remains. With min_tokens = 2 the packed log-probs equal an unpadded
    # log-softmax over logits whose stop ids are -inf at completion positions 0 and 1, and the plain one after.
    model = models["sdpa"]
    seqs = _random_seqs(SHAPES)
    stop_ids = (7, 11)
    with torch.no_grad():
        batch, tokens = packed(seqs, PAD, mask_dtype=torch.bool)
        logits = model(**batch.model_inputs()).logits
        got = packed_completion_logprobs(logits, batch, None, min_tokens=2, stop_ids=stop_ids)  # every token
        plain = packed_completion_logprobs(logits, batch, None)
        for i, s in enumerate(seqs):
            p, c = len(s.prompt_token_ids), len(s.completion_token_ids)
            z = model(input_ids=torch.tensor([s.prompt_token_ids + s.completion_token_ids])).logits[0, p - 1 : -1]
            z = z.float().clone()
            z[:2, list(stop_ids)] = float("-inf")
            ref = torch.log_softmax(z, -1).gather(1, torch.tensor(s.completion_token_ids)[:, None]).squeeze(1)
            assert (got[i, :c] - ref).abs().max().item() < PACKED_LOGPROB_ATOL, f"sequence {i}"
            assert torch.equal(got[i, 2:c], plain[i, 2:c])  # past min_tokens nothing is banned
    assert (got[:, :2] > plain[:, :2]).any()  # the ban moved mass to the remaining tokens
