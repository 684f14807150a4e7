"""The learner group's step with fake ranks: the real ``RankStep`` on the tiny model with plain
torch optimisers, driven through in-process stand-ins for Ray actors. The wiring of a step
(planning, scoring, the separate critic's and reference's results, the estimator's halves,
whitening, training) runs in seconds without Ray or DeepSpeed."""

from __future__ import annotations

import asyncio
import pickle
import random

import pytest
import torch

from launch.config import load_config
from learner.critic import build_value_model
from learner.group import MIN_IS_MEAN, LearnerGroup
from learner.rank import Layout, Models, RankStep
from tests.fakes import LocalActor, PlainEngine, make_group
from tests.tolerance import PACKED_LOGPROB_ATOL, reduction_rtol

BASE = ["model.path=x", "data.prompts=x", "reward.function=x", "rollout.max_tokens=12", "learner.lr=0.05"]
EPS32 = torch.finfo(torch.float32).eps
# An importance weight w_t = exp(lp_t - sampler lp_t) whose float32 log-prob came out of another layout (rows
# packed otherwise, one rank or two) moves by |d lp_t| <= PACKED_LOGPROB_ATOL relative, plus an ulp for the
# subtraction (every fake sampler log-prob is -0.5 and |lp_t + 0.5| < 5: 5 eps) and one for exp (eps).
WEIGHT_RTOL = PACKED_LOGPROB_ATOL + 6 * EPS32


def loss_atol(sum_abs_terms: float, tokens: int, term_rtol: float) -> float:
    """|d loss| between two float32 losses sum_t l_t over ``tokens`` terms, each term moved by at most
    ``term_rtol`` (relative) and the sum taken in another order (tests/tolerance.py):
    sum_t |l_t| * (term_rtol + (tokens - 1) eps). ``sum_abs_terms``: sum_t |l_t|, the loss with -|A| in place
    of A, measured for the test's seeded batch and rounded up; the loss itself cancels, so it is far smaller."""
    return sum_abs_terms * (term_rtol + reduction_rtol(torch.float32, tokens))


def batches(seed: int = 0, prompts: int = 4, samples: int = 4) -> list:
    rng = random.Random(seed)
    return [
        make_group(p, [rng.random() for _ in range(samples)], completion_len=rng.randint(2, 9), seed=seed)
        for p in range(prompts)
    ]


def fake_group(model_dir: str, *overrides: str, ranks: int = 1, separate: bool = False, calls: list | None = None):
    """A learner group of ``ranks`` fake ranks; ``separate``: the critic (PPO) and the reference
    (a KL) on processes of their own, as ``resources.*.placement=separate`` places them."""
    from transformers import AutoModelForCausalLM

    cfg = load_config(None, BASE + list(overrides))
    algo = cfg.algorithm
    layout = Layout(pad_id=0, device=torch.device("cpu"), mask_dtype=torch.bool, row_tokens=None)

    def policy():
        torch.manual_seed(0)
        return PlainEngine(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), cfg.learner.lr)

    def critic():
        return PlainEngine(build_value_model(model_dir, "policy", 0), algo.critic.lr)

    def reference():
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval().requires_grad_(False)

    def rank(models: Models):
        return LocalActor(RankStep(models, algo, layout, cfg.rollout.max_tokens, ranks), calls)

    needs_critic, needs_ref = cfg.has_critic, cfg.has_reference
    together = Models(
        policy(),
        critic() if needs_critic and not separate else None,
        reference() if needs_ref and not separate else None,
    )
    workers = [rank(together)] + [
        rank(Models(policy(), together.critic and critic(), together.reference and reference()))
        for _ in range(ranks - 1)
    ]
    critics = [rank(Models(critic=critic())) for _ in range(ranks)] if needs_critic and separate else None
    references = [rank(Models(reference=reference()))] if needs_ref and separate else None
    return LearnerGroup(workers, algo, cfg.learner.token_budget, cfg.rollout.max_tokens, critics, references)


def step(group: LearnerGroup, groups: list) -> dict:
    return asyncio.run(group.train_step(groups))


def test_two_ranks_split_the_batch_like_one_rank(tiny_model_dir):
    # Before the update both copies of the model are the same, so the ranks' loss shares (global
    # normalisers) add up to one rank's loss, and every token is trained exactly once.
    b = batches()
    one = step(fake_group(tiny_model_dir, "learner.token_budget=40"), b)
    two = step(fake_group(tiny_model_dir, "learner.token_budget=40", ranks=2), b)
    assert one["tokens"] == two["tokens"] == sum(len(t.completion_token_ids) for g in b for t in g.trajectories)
    # At the first update the ratio is exactly 1, so l_t = -A_t w_t / N: w_t from log-probs in other rows,
    # A_t within an ulp, N = 96 terms in another order; sum_t |l_t| = 0.023 (measured):
    #   atol = 0.03 * (1.07e-5 + 1.2e-7 + 95 * 1.19e-7) = 6.6e-7  (measured: 1e-10 to 4e-10)
    tokens = int(one["tokens"])
    assert two["loss"] == pytest.approx(one["loss"], abs=loss_atol(0.03, tokens, WEIGHT_RTOL + EPS32))
    # mean_t |A_t| over 96 float32 terms (an ulp each), summed per rank: rel = 95 eps + eps = 1.1e-5
    rel = reduction_rtol(torch.float32, tokens) + EPS32
    assert two["advantage_abs_mean"] == pytest.approx(one["advantage_abs_mean"], rel=rel)  # measured: 4.5e-8
    assert one["advantage_abs_mean"] > 0.1  # GRPO advantages of random rewards: a real signal


def test_what_crosses_between_driver_and_ranks_is_flat_arrays(tiny_model_dir):
    # 16 prompts x 4 samples x ~100 tokens: as Python lists the per-token fields would pickle to
    # hundreds of KB in-band; as numpy arrays they travel out of band and the pickles stay small.
    calls: list = []
    b = [make_group(p, [0.1 * i for i in range(4)], completion_len=100, seed=p) for p in range(16)]
    group = fake_group(tiny_model_dir, "algorithm.kl.placement=loss", calls=calls)
    step(group, b)
    assert {name for name, _, _ in calls} == {"score", "summarise", "expand", "train"}
    for name, args, out in calls:
        buffers: list = []
        in_band = len(pickle.dumps((args, out), protocol=5, buffer_callback=buffers.append))
        assert in_band < 8_000, f"{name}: {in_band} bytes pickled in-band"
    (shard,) = next(args for name, args, _ in calls if name == "score")
    assert shard.tokens.completion_ids.nbytes == 16 * 4 * 100 * 4  # every token, once, as int32


def test_importance_weights_stay_fixed_across_epochs(tiny_model_dir):
    # rho = pi_old / pi_sampler is computed once per batch; with two epochs (a big step in between)
    # the mean rho over both epochs equals the first epoch's alone.
    b = batches(seed=1)
    once = step(fake_group(tiny_model_dir, "algorithm.loss.epochs=1"), b)
    twice = step(fake_group(tiny_model_dir, "algorithm.loss.epochs=2"), b)
    assert twice["tis_rho_mean"] == pytest.approx(once["tis_rho_mean"], rel=1e-5)
    assert abs(once["tis_rho_mean"] - 1) > 1e-3  # the sampler's log-probs differ from the learner's
    assert twice["approx_kl"] > 0  # the second epoch really saw a moved policy


@pytest.mark.parametrize("overrides", [["algorithm.name=ppo"], ["algorithm.name=ppo", "algorithm.kl.placement=reward"]])
def test_separate_critic_and_reference_train_like_colocated(tiny_model_dir, overrides):
    b = batches(seed=2)
    colocated = step(fake_group(tiny_model_dir, *overrides, "algorithm.estimator.whiten_advantages=true"), b)
    separate = step(
        fake_group(tiny_model_dir, *overrides, "algorithm.estimator.whiten_advantages=true", separate=True), b
    )
    for key in ("loss", "critic_value_mse", "advantage_abs_mean", "kl_ref_mean"):
        if key in colocated:
            assert separate[key] == pytest.approx(colocated[key], abs=1e-6), key
    assert colocated["critic_value_mse"] > 0


@pytest.mark.parametrize("name", ["reinforce", "rloo", "dr_grpo", "gspo", "cispo"])
def test_every_method_steps_with_fake_ranks(tiny_model_dir, name):
    metrics = step(fake_group(tiny_model_dir, f"algorithm.name={name}", ranks=2), batches(seed=3))
    assert metrics["tokens"] > 0 and torch.isfinite(torch.tensor(metrics["loss"]))


@pytest.mark.parametrize(
    "overrides",
    [["algorithm.name=ppo"], ["algorithm.kl.placement=loss"], ["algorithm.kl.placement=reward"]],
    ids=["ppo", "kl-loss", "kl-reward"],
)
@pytest.mark.parametrize("separate", [False, True], ids=["colocated", "separate"])
def test_ranks_without_sequences_still_take_part(tiny_model_dir, overrides, separate):
    # 2 sequences on 4 ranks: two ranks hold none and run only dummy micro-batches, yet report
    # (empty) scores, summaries and metrics like the others
    b = [make_group(0, [1.0, 0.0], completion_len=4)]
    metrics = step(fake_group(tiny_model_dir, *overrides, "rollout.group_size=2", ranks=4, separate=separate), b)
    assert metrics["tokens"] == 8 and torch.isfinite(torch.tensor(metrics["loss"]))


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_masked_truncated_completions_train_no_token_but_count_in_their_group(tiny_model_dir, aggregation):
    def cut(groups):
        for g in groups:
            for t in g.trajectories[:2]:  # the first two samples of every group hit max_tokens
                t.finish_reason = "length"
        return groups

    lengths = [len(t.completion_token_ids) for g in batches() for t in g.trajectories[2:]]
    masked = step(
        fake_group(
            tiny_model_dir, "algorithm.shaping.mask_truncated=true", f"algorithm.loss.aggregation={aggregation}"
        ),
        cut(batches()),
    )
    assert masked["tokens"] == sum(lengths)  # only the completions that ended trained
    plain = step(fake_group(tiny_model_dir, f"algorithm.loss.aggregation={aggregation}"), cut(batches()))
    assert plain["tokens"] > masked["tokens"]

    everything_cut = [make_group(p, [1.0, 0.0, 1.0, 0.0], completion_len=4) for p in range(2)]
    for g in everything_cut:
        for t in g.trajectories:
            t.finish_reason = "length"
    nothing = step(
        fake_group(
            tiny_model_dir, "algorithm.shaping.mask_truncated=true", f"algorithm.loss.aggregation={aggregation}"
        ),
        everything_cut,
    )
    assert nothing["tokens"] == 0 and nothing["loss"] == 0.0  # no NaN from empty normalisers


def test_gradient_checkpointing_trains_the_same_step(tiny_model_dir):
    from learner.worker import enable_gradient_checkpointing

    plain, checkpointed = fake_group(tiny_model_dir), fake_group(tiny_model_dir)
    enable_gradient_checkpointing(checkpointed.workers[0]._target.models.policy.module)
    assert checkpointed.workers[0]._target.models.policy.module.is_gradient_checkpointing
    a, b = step(plain, batches()), step(checkpointed, batches())
    assert abs(a["loss"] - b["loss"]) < 1e-6
    pa = dict(plain.workers[0]._target.models.policy.module.named_parameters())
    pb = dict(checkpointed.workers[0]._target.models.policy.module.named_parameters())
    assert max(float((pa[n] - pb[n]).abs().max()) for n in pa) < 1e-6


@pytest.mark.parametrize(
    "overrides, scoring_pass",
    [
        ([], False),  # one update per batch: the old policy is the current one, trained on directly
        (["algorithm.loss.epochs=2"], True),
        (["algorithm.loss.minibatches=2"], True),
        (["algorithm.kl.placement=loss"], True),  # the KL's policy log-probs come before the update
    ],
)
def test_policy_scores_before_training_only_when_an_update_or_a_kl_needs_it(tiny_model_dir, overrides, scoring_pass):
    group = fake_group(tiny_model_dir, *overrides)
    rank = group.workers[0]._target
    modes = []  # the policy's mode at each forward: eval = the scoring pass, train = an update's forward
    rank.models.policy.module.register_forward_hook(lambda module, args, out: modes.append(module.training))
    step(group, batches())
    assert (False in modes) is scoring_pass
    assert True in modes


def test_masked_truncated_reward_counts_in_its_group_through_the_ranks(tiny_model_dir, monkeypatch):
    # The product's path (plan, shards, RankStep.summarise/expand, the driver's reduction): one group
    # {cut r=1 -> penalty -1; finished r=1; finished r=0} gives A = [-1.2247, 1.2247, 0] unmasked; with
    # algorithm.shaping.mask_truncated the cut row trains nothing and the others keep 1.2247 and 0 (on main before
    # the fix: 1.414 and -0.707, the cut row counted as reward 0).
    seen: list = []
    expand = RankStep.expand

    def recording(self, per_sequence):
        out = expand(self, per_sequence)
        seen.append(self.batch.column("advantages").clone())
        return out

    monkeypatch.setattr(RankStep, "expand", recording)
    group = make_group(0, [1.0, 1.0, 0.0], completion_len=3)
    group.trajectories[0].finish_reason = "length"
    step(
        fake_group(tiny_model_dir, "algorithm.shaping.truncation_penalty=-1", "algorithm.shaping.mask_truncated=true"),
        [group],
    )
    a = 1 / (2 / 3) ** 0.5
    assert sorted(seen[0][:, 0].tolist()) == pytest.approx([0.0, 0.0, a], abs=1e-4)
    assert seen[0].abs().sum().item() == pytest.approx(3 * a, abs=1e-3)  # a on the finished right answer's 3 tokens


def test_masked_truncated_completion_keeps_its_kl_in_the_baseline(tiny_model_dir, monkeypatch):
    # KL in the reward: every row's R_i = task reward - beta sum_t KL_t. A masked (cut) row must keep its KL
    # term as it keeps its task reward, or the finished rows' group baseline moves when it is masked (the
    # outside review's case: -1.043 / -0.306 unmasked became -0.876 / -0.523 masked).
    seen: list = []
    expand = RankStep.expand

    def recording(self, per_sequence):
        out = expand(self, per_sequence)
        seen.append((self.batch.column("completion_mask").clone(), self.batch.column("advantages").clone()))
        return out

    monkeypatch.setattr(RankStep, "expand", recording)
    kl = ["algorithm.kl.placement=reward", "algorithm.kl.beta=0.5", "algorithm.kl.estimator=k1"]
    runs = {}
    for masked in (False, True):
        group = fake_group(tiny_model_dir, *kl, *(["algorithm.shaping.mask_truncated=true"] if masked else []))
        step(group, batches())  # one update: the policy moves away from the reference, so KL != 0
        cut = make_group(9, [1.0, 1.0, 0.0], completion_len=5, seed=3)
        cut.trajectories[0].finish_reason = "length"
        seen.clear()
        step(group, [cut])
        runs[masked] = seen[0]
    (_, plain), (mask, masked) = runs[False], runs[True]
    trained = mask.sum(-1) > 0
    assert trained.sum() == 2 and plain[~trained].abs().sum() > 0  # the cut row trains only unmasked
    assert plain[trained].abs().sum() > 1e-3
    torch.testing.assert_close(masked[trained], plain[trained], atol=1e-5, rtol=1e-4)
    assert masked[~trained].abs().sum() == 0


def test_batch_normalised_importance_weights_have_one_global_mean_on_any_number_of_ranks(tiny_model_dir):
    # tis.normalize divides the truncated weights by their mean over the step's trained tokens, summed over
    # the ranks: one rank and two see the same mean, and at the first update the policy loss (linear in the
    # weights) is the plain one divided by it
    b, common = batches(seed=1), ["learner.token_budget=40", "algorithm.tis.cap=1.05"]
    plain = step(fake_group(tiny_model_dir, *common), b)
    one = step(fake_group(tiny_model_dir, *common, "algorithm.tis.normalize=true"), b)
    two = step(fake_group(tiny_model_dir, *common, "algorithm.tis.normalize=true", ranks=2), b)
    assert 0.0 < one["tis_batch_mean"] < 1.0  # the fake sampler disagrees, and truncation at 1.05 cuts more
    # The batch mean is sum_t w_t / N over the step's N = 92 trained tokens, summed in float64, with
    # w_t = exp(lp_t + 0.5) ~ 0.025 (none reaches the cap). One rank and two pack the rows differently, so
    # each w_t moves by WEIGHT_RTOL (relative), and a mean of positive terms moves by at most its terms'
    # largest relative change; add the float64 sum of N terms in another order, (N - 1) eps64:
    #   rel = 1e-5 + 6 * 1.19e-7 + 91 * 2.2e-16 = 1.07e-5  (measured: 0 to 6.5e-9 over the matrix rows).
    # A wrong normaliser is far outside it: one rank's mean over its 46 tokens is 3.9e-3 from the batch's.
    tokens = int(one["tokens"])
    rel = WEIGHT_RTOL + reduction_rtol(torch.float64, tokens)
    assert two["tis_batch_mean"] == pytest.approx(one["tis_batch_mean"], rel=rel)
    divided = max(one["tis_batch_mean"], MIN_IS_MEAN)  # one minibatch: its mean is the batch's (floored)
    # l_t = -A_t w_t / (divided N): sum_t |l_t| = 0.22 (measured), 76x the loss (0.0029). The same rows in the
    # same order, each term once divided by 0.1 (an ulp): atol = 0.3 * (1.2e-7 + 91 eps) = 3.3e-6 (measured:
    # 5e-9); dividing by the unfloored mean would be 4x off
    assert one["loss"] == pytest.approx(plain["loss"] / divided, abs=loss_atol(0.3, tokens, EPS32))
    # other rows on two ranks: each w_t moves by WEIGHT_RTOL; the divisor is the floor on both:
    #   atol = 0.3 * (1.07e-5 + 91 eps) = 6.5e-6  (measured: 2e-9 to 7e-9)
    assert two["loss"] == pytest.approx(one["loss"], abs=loss_atol(0.3, tokens, WEIGHT_RTOL))


def test_rejection_rules_drop_tokens_from_the_loss_and_say_how_many(tiny_model_dir):
    b = batches(seed=1)
    everything = "[{level: token, divergence: k2, high: 0.0}]"  # every token whose ratio is not exactly 1
    nothing = "[{level: sequence, divergence: k3, reduce: max, high: 1000.0}]"
    dropped = step(fake_group(tiny_model_dir, f"algorithm.tis.reject={everything}"), b)
    kept = step(fake_group(tiny_model_dir, f"algorithm.tis.reject={nothing}"), b)
    plain = step(fake_group(tiny_model_dir), b)
    assert dropped["reject_token_k2_frac"] > 0.9 and dropped["reject_token_frac"] > 0.9
    # kept_frac: the share of trained tokens the loss still weighs, here the complement of the rule's
    assert dropped["kept_frac"] == pytest.approx(1.0 - dropped["reject_token_frac"], abs=1e-12)
    assert abs(dropped["loss"]) < 0.1 * abs(plain["loss"])
    assert kept["reject_seq_max_k3_frac"] == 0.0 and kept["loss"] == pytest.approx(plain["loss"], rel=1e-6)


def test_the_exact_kl_loss_term_starts_at_zero_and_splits_over_ranks(tiny_model_dir):
    # the reference is the initial policy: the KL over the whole vocabulary is 0 at the first update, and after
    # a big step it is positive; two ranks see the same loss as one
    b, exact = batches(seed=2), ["algorithm.kl.placement=loss", "algorithm.kl.estimator=exact", "algorithm.kl.beta=0.5"]
    one = step(fake_group(tiny_model_dir, "learner.token_budget=40", *exact), b)
    two = step(fake_group(tiny_model_dir, "learner.token_budget=40", *exact, ranks=2), b)
    assert one["kl_ref"] == pytest.approx(0.0, abs=1e-6)
    # the KL term is exactly 0 on both (each rank's reference sees the policy's rows); the policy term as in
    # test_two_ranks_split_the_batch_like_one_rank, sum_t |l_t| = 0.024 (measured) over 60 tokens:
    #   atol = 0.03 * (1.07e-5 + 1.2e-7 + 59 * 1.19e-7) = 5.4e-7  (measured: 1e-10 to 6e-10)
    two_loss_atol = loss_atol(0.03, int(one["tokens"]), WEIGHT_RTOL + EPS32)
    assert two["loss"] == pytest.approx(one["loss"], abs=two_loss_atol)
    moved = fake_group(tiny_model_dir, *exact, "algorithm.loss.epochs=2")
    assert step(moved, b)["kl_ref"] > 1e-6  # the second epoch's policy differs from the reference


def test_a_steps_max_and_min_metrics_are_its_extremes_over_micro_batches_and_ranks(tiny_model_dir):
    """tis_rho_max is the largest ratio the step saw, on one rank or two: not a token-weighted mean of each
    micro-batch's largest (which read 0.0381 on one rank and 0.0402 on two for the same batch). (ratio_max/min
    are 1 at a batch's first update on every layout, so they tell nothing here.)"""
    b, common = batches(seed=1), ["learner.token_budget=40", "algorithm.tis.cap=1.05"]
    one = step(fake_group(tiny_model_dir, *common), b)
    two = step(fake_group(tiny_model_dir, *common, ranks=2), b)
    small = step(fake_group(tiny_model_dir, "learner.token_budget=12", "algorithm.tis.cap=1.05"), b)
    # the same tokens' ratios in other layouts: equal up to the weights' float32 change
    assert two["tis_rho_max"] == pytest.approx(one["tis_rho_max"], rel=WEIGHT_RTOL)
    assert small["tis_rho_max"] == pytest.approx(one["tis_rho_max"], rel=WEIGHT_RTOL)
    assert one["tis_rho_max"] > one["tis_rho_mean"]
