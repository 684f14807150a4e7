"""Advantage estimators and reward statistics, as pure functions over tensors.

Per-token tensors are ``[B, T]`` over completion tokens with ``mask`` ``[B, T]``
(1.0 real token, 0.0 padding). Values in padded slots are never read: they are
replaced by zero before any arithmetic, so garbage (even NaN) there cannot leak.

Group estimators take one scalar reward per completion, ``rewards`` ``[N]`` with
``N = num_groups * G``, grouped consecutively: rows ``g*G .. g*G+G-1`` are the ``G``
completions of prompt ``g``.

Follows:
* reward-to-go and GAE: Schulman et al. 2016, "High-Dimensional Continuous Control
  Using Generalized Advantage Estimation".
* GRPO outcome and process supervision: Shao et al. 2024, "DeepSeekMath" (sec. 4.1.2, 4.1.3).
* Dr. GRPO: Liu et al. 2025, "Understanding R1-Zero-Like Training" (no std division).
* RLOO: Ahmadian et al. 2024, "Back to Basics" (leave-one-out baseline).
* Running moments: Chan, Golub & LeVeque 1979, parallel variance combination.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _float_mask(mask: Tensor, like: Tensor) -> Tensor:
    return mask.to(like.dtype) if mask.dtype != like.dtype else mask


def _zero_padding(x: Tensor, mask: Tensor) -> Tensor:
    # torch.where (not x * mask) so NaN/inf garbage in padded slots becomes exactly 0.
    return torch.where(mask > 0, x, torch.zeros_like(x))


# ---------------------------------------------------------------------------------------
# Per-token estimators
# ---------------------------------------------------------------------------------------


def turn_discounts(mask: Tensor, gamma: float) -> Tensor:
    """Per-step discounts that discount across the turns of an episode, not across its tokens.

    ``d_t = gamma`` at a model token followed (after environment tokens, mask 0) by another model token of
    the same sequence: the last token of a turn that is not the episode's last; ``d_t = 1`` elsewhere.
    With ``reward_to_go`` / ``gae`` (which skip the mask's gaps) a reward ``k`` turns later counts
    ``gamma^k``: ``G_t = r_t + d_t G_{t'}``, ``t'`` the next model token.

    Args:
        mask: ``[B, T]`` 1 on the model's tokens, 0 on environment tokens and padding.
        gamma: discount per turn.

    Returns:
        ``[B, T]`` discounts (a single-turn sequence: all 1).

    Example: mask ``[1, 1, 0, 0, 1, 0]`` -> ``[1, gamma, 1, 1, 1, 1]``.
    """
    m = mask > 0
    later = torch.flip(torch.cummax(torch.flip(m.int(), [-1]), -1).values, [-1]) > 0  # a model token at or after t
    after = torch.zeros_like(later)
    after[:, :-1] = later[:, 1:]  # a model token strictly after t
    nxt = torch.zeros_like(m)
    nxt[:, :-1] = m[:, 1:]
    ends_turn = m & ~nxt & after  # the turn's last token, another turn follows
    return torch.where(
        ends_turn, torch.full_like(mask, gamma, dtype=torch.float32), torch.ones_like(mask, dtype=torch.float32)
    )


def _discounts(gamma: float | Tensor, t: int) -> float | Tensor:
    return gamma[:, t] if isinstance(gamma, Tensor) else gamma


def reward_to_go(rewards: Tensor, mask: Tensor, gamma: float | Tensor = 1.0) -> Tensor:
    """Discounted reward-to-go ``G_t = r_t + gamma_t G_{t'}`` within each sequence, ``t'`` the next
    position of the mask: ``G_t = sum_{k >= t} gamma^(k-t) r_k`` on a contiguous mask.

    Args:
        rewards: ``[B, T]`` per-token rewards.
        mask: ``[B, T]`` the sequence's steps (its completion, or an episode's model tokens). A gap in
            it (an episode's environment tokens; right padding) is skipped: it adds no reward, takes no
            discount and gets G = 0.
        gamma: discount factor, or ``[B, T]`` per-step discounts (``turn_discounts``).

    Returns:
        ``[B, T]`` reward-to-go, zero off the mask.
    """
    mask = _float_mask(mask, rewards)
    rewards = _zero_padding(rewards, mask)
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])  # [B]; G_{t'}
    for t in reversed(range(rewards.shape[1])):
        step = rewards[:, t] + _discounts(gamma, t) * running  # G_t = r_t + gamma_t G_{t'}
        running = torch.where(mask[:, t] > 0, step, running)  # a gap passes G_{t'} on unchanged
        returns[:, t] = running * mask[:, t]
    return returns


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float | Tensor, lam: float) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation over completion tokens.

    Args:
        rewards: ``[B, T]`` per-token rewards (e.g. KL-shaped, task reward on the last token).
        values: ``[B, T]`` critic values V(s_t).
        mask: ``[B, T]`` the steps: V(s_{t'}) = 0 past the last one; a gap (an episode's environment
            tokens; padding) is skipped, so ``t'`` is the next position of the mask and the gap's
            advantages and returns are 0.
        gamma: discount factor, or ``[B, T]`` per-step discounts (``turn_discounts``).
        lam: GAE lambda.

    Returns:
        ``(advantages, returns)``, both ``[B, T]`` and zero off the mask;
        ``returns = values + advantages`` (the value-function target).
    """
    mask = _float_mask(mask, rewards)
    rewards = _zero_padding(rewards, mask)
    values = _zero_padding(values, mask)
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])  # [B]; V(s_{t'}), 0 past the end
    next_advantage = torch.zeros_like(rewards[:, 0])  # [B]; A_{t'}
    for t in reversed(range(rewards.shape[1])):
        g, on = _discounts(gamma, t), mask[:, t] > 0
        delta = rewards[:, t] + g * next_value - values[:, t]  # delta_t = r_t + gamma_t V_{t'} - V_t
        advantage = delta + g * lam * next_advantage  # A_t = delta_t + gamma_t lam A_{t'}
        next_advantage = torch.where(on, advantage, next_advantage)
        next_value = torch.where(on, values[:, t], next_value)
        advantages[:, t] = next_advantage * mask[:, t]
    returns = (values + advantages) * mask  # R_t = V_t + A_t
    return advantages, returns


# ---------------------------------------------------------------------------------------
# Group (outcome) estimators: rewards [N], N = num_groups * G
# ---------------------------------------------------------------------------------------


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"group rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    return rewards.view(-1, group_size)  # [num_groups, G]


def grpo_advantages(rewards: Tensor, group_size: int, eps: float = 1e-6) -> Tensor:
    """GRPO outcome advantages ``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)``.

    ``std`` is the POPULATION std (divide by G, ``unbiased=False``), so a group of one
    gives 0 rather than NaN. (TRL uses the sample std, divide by G-1; the two differ by
    the constant factor sqrt((G-1)/G).)

    Args:
        rewards: ``[N]`` scalar rewards, groups of ``group_size`` consecutive rows.
        group_size: G.
        eps: added to the std; a group of identical rewards gets advantage 0.

    Returns:
        ``[N]`` advantages.
    """
    grouped = _grouped(rewards, group_size)
    mean = grouped.mean(dim=1, keepdim=True)  # [num_groups, 1]
    std = grouped.std(dim=1, unbiased=False, keepdim=True)  # [num_groups, 1]; sqrt(sum (r - mean)^2 / G)
    return ((grouped - mean) / (std + eps)).reshape(-1)  # A_i = (r_i - mean) / (std + eps)


def dr_grpo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """Dr. GRPO advantages ``A_i = r_i - mean(r_group)`` (no std division). ``[N] -> [N]``."""
    grouped = _grouped(rewards, group_size)
    return (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)  # A_i = r_i - mean


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """RLOO advantages ``A_i = r_i - (sum_{j != i} r_j) / (G - 1)``. ``[N] -> [N]``.

    Algebraically ``A_i = G / (G - 1) * (r_i - mean)``, i.e. a rescaled Dr. GRPO.
    """
    if group_size < 2:
        raise ValueError(f"RLOO needs group_size >= 2, got {group_size}")
    grouped = _grouped(rewards, group_size)
    leave_one_out = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)  # mean of the other G-1
    return (grouped - leave_one_out).reshape(-1)  # A_i = r_i - mean_{j != i} r_j


def reinforce_baseline_advantages(rewards: Tensor, baseline: Tensor | float) -> Tensor:
    """REINFORCE with a baseline, ``A_i = r_i - b`` (``b`` scalar or broadcastable to ``[N]``)."""
    return rewards - baseline  # A_i = r_i - b


def broadcast_to_tokens(advantages: Tensor, mask: Tensor) -> Tensor:
    """Give every real token of sequence i the sequence advantage: ``[N], [N, T] -> [N, T]``."""
    mask = _float_mask(mask, advantages)
    return advantages.unsqueeze(-1) * mask  # A_{i,t} = A_i * m_{i,t}


# ---------------------------------------------------------------------------------------
# GRPO with process supervision
# ---------------------------------------------------------------------------------------


def accumulate_step_rewards(step_rewards: Tensor, step_end_mask: Tensor, mask: Tensor) -> Tensor:
    """Token advantage = sum of the rewards of the steps ending at or after the token.

    ``A_{i,t} = sum_{j : end(j) >= t} r_{i,j}`` (DeepSeekMath eq. process supervision).

    Args:
        step_rewards: ``[B, T]`` reward of each step at its step-end token, 0 elsewhere.
        step_end_mask: ``[B, T]`` 1 at step-end positions.
        mask: ``[B, T]`` completion mask.

    Returns:
        ``[B, T]`` token advantages, zero on padding.
    """
    mask = _float_mask(mask, step_rewards)
    at_ends = _zero_padding(step_rewards, _float_mask(step_end_mask, step_rewards) * mask)  # [B, T]
    suffix_sum = at_ends.flip(-1).cumsum(-1).flip(-1)  # [B, T]; sum_{k >= t} r_k
    return suffix_sum * mask


def step_moments(step_rewards: Tensor, step_end_mask: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per sequence: how many steps it has, and the sum and sum of squares of their rewards.

    ``[B, T]`` (rewards at step-end tokens, step ends, completion mask) ``-> 3 x [B]``; the group
    statistics of ``grpo_process_advantages`` are sums of these over a group's rows, so they can be
    computed where each sequence is and reduced anywhere.
    """
    mask = _float_mask(mask, step_rewards)
    is_end = _float_mask(step_end_mask, step_rewards) * mask  # [B, T]
    rewards = _zero_padding(step_rewards, is_end)
    return is_end.sum(-1), rewards.sum(-1), (rewards * rewards).sum(-1)


def group_mean_std(count: Tensor, total: Tensor, total_sq: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """Mean and population std over each group's pooled values, from per-row moments ``[N]``.

    ``mean_g = sum_rows total / n_g``, ``var_g = sum_rows total_sq / n_g - mean_g^2``; every row of
    a group gets its group's ``(mean, std)`` (``[N]`` each). Computed in float64.
    """
    n = count.numel()
    if group_size < 1 or n % group_size != 0:
        raise ValueError(f"{n} sequences do not split into groups of {group_size}")
    sums = [x.double().view(-1, group_size).sum(-1) for x in (count, total, total_sq)]  # [num_groups] each
    steps = sums[0].clamp(min=1.0)
    mean = sums[1] / steps  # mean over the group's steps
    var = (sums[2] / steps - mean * mean).clamp(min=0.0)  # population variance
    repeat = lambda x: x.repeat_interleave(group_size).to(total.dtype)  # noqa: E731
    return repeat(mean), repeat(var.sqrt())


def normalise_step_rewards(
    step_rewards: Tensor, step_end_mask: Tensor, mask: Tensor, mean: Tensor, std: Tensor, eps: float = 1e-6
) -> Tensor:
    """``r~ = (r - mean_i) / (std_i + eps)`` at each step-end token, 0 elsewhere.

    ``[B, T]`` tensors as in ``grpo_process_advantages``; ``mean``, ``std``: ``[B]``, each row's group's.
    """
    mask = _float_mask(mask, step_rewards)
    is_end = _float_mask(step_end_mask, step_rewards) * mask
    rewards = _zero_padding(step_rewards, is_end)
    return (rewards - mean.unsqueeze(-1)) / (std.unsqueeze(-1) + eps) * is_end


def grpo_process_advantages(
    step_rewards: Tensor,
    step_end_mask: Tensor,
    mask: Tensor,
    group_size: int,
    eps: float = 1e-6,
    normalise: bool = True,
) -> Tensor:
    """GRPO process-supervision advantages.

    Step rewards are normalised over ALL steps of all G completions of a prompt,
    ``r~ = (r - mean(R_group)) / (std(R_group) + eps)`` (population std), and each token
    then gets the sum of the normalised rewards of the steps ending at or after it.

    Args:
        step_rewards: ``[B, T]`` reward of each step at its step-end token, 0 elsewhere;
            ``B = num_groups * G`` with groups of consecutive rows.
        step_end_mask: ``[B, T]`` 1 at step-end positions.
        mask: ``[B, T]`` completion mask.
        group_size: G.
        eps: added to the std.
        normalise: if False, skip the group normalisation (raw step rewards).

    Returns:
        ``[B, T]`` token advantages, zero on padding.
    """
    mask = _float_mask(mask, step_rewards)
    is_end = _float_mask(step_end_mask, step_rewards) * mask  # [B, T]
    rewards = _zero_padding(step_rewards, is_end)
    if normalise:
        mean, std = group_mean_std(*step_moments(rewards, is_end, mask), group_size)  # [B] each
        rewards = normalise_step_rewards(rewards, is_end, mask, mean, std, eps)
    return accumulate_step_rewards(rewards, is_end, mask)


# ---------------------------------------------------------------------------------------
# Whitening and reward normalisation
# ---------------------------------------------------------------------------------------


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is 1 (0 if there are none). 0-dim."""
    mask = _float_mask(mask, x)
    return _zero_padding(x, mask).sum() / mask.sum().clamp(min=1.0)


def masked_moments(x: Tensor, mask: Tensor) -> Tensor:
    """``[count, sum, sum of squares]`` of ``x`` over masked-in positions, float64 ``[3]``.

    Moments of several shards add up to the moments of their union, which is how whitening
    runs over a batch split across data-parallel ranks.
    """
    mask = _float_mask(mask, x).double()
    x = _zero_padding(x.double(), mask)
    return torch.stack([mask.sum(), x.sum(), (x * x).sum()])


def whiten(
    x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8, moments: Tensor | None = None
) -> Tensor:
    """Masked whitening ``(x - mean) / sqrt(var + eps)`` over the real tokens.

    ``var`` is the population variance over masked-in positions. With
    ``shift_mean=False`` the mean is added back (only the scale changes).

    Args:
        x: ``[B, T]`` (any shape matching ``mask``).
        mask: same shape, 1 for positions that count.
        moments: ``masked_moments`` of the whole population when ``x`` is one shard of it
            (default: ``x``'s own): ``mean = sum / n``, ``var = sum_sq / n - mean^2``.

    Returns:
        Same shape as ``x``, zero on padding.
    """
    mask = _float_mask(mask, x)
    x = _zero_padding(x, mask)
    count, total, total_sq = (moments if moments is not None else masked_moments(x, mask)).tolist()
    count = max(count, 1.0)
    mean = total / count
    var = max(total_sq / count - mean * mean, 0.0)  # population variance
    whitened = (x - mean) / (var + eps) ** 0.5  # (x - mu) / sqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask


def update_running_moments(
    count: Tensor | float, mean: Tensor | float, var: Tensor | float, batch: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Fold a batch into running (count, mean, population variance); Chan et al. parallel update.

    ``delta = mean_b - mean``, ``n = count + n_b``,
    ``mean' = mean + delta * n_b / n``,
    ``var' = (var * count + var_b * n_b + delta^2 * count * n_b / n) / n``.
    Start from ``(0, 0, 1)``. All elements of ``batch`` count.

    Returns:
        ``(count, mean, var)`` as 0-dim tensors, equal to the count/mean/population-variance
        of all the data seen so far.
    """
    batch = batch.detach().reshape(-1)
    dtype = batch.dtype if batch.is_floating_point() else torch.get_default_dtype()
    batch = batch.to(dtype)
    count = torch.as_tensor(count, dtype=dtype)
    mean = torch.as_tensor(mean, dtype=dtype)
    var = torch.as_tensor(var, dtype=dtype)
    batch_count = torch.tensor(float(batch.numel()), dtype=dtype)
    if batch.numel() == 0:
        return count, mean, var
    batch_mean = batch.mean()
    batch_var = batch.var(unbiased=False)
    total = count + batch_count
    delta = batch_mean - mean
    new_mean = mean + delta * batch_count / total  # mean' = mean + delta * n_b / n
    # M2' = M2_a + M2_b + delta^2 n_a n_b / n, with M2 = var * count
    m2 = var * count + batch_var * batch_count + delta**2 * count * batch_count / total
    return total, new_mean, m2 / total


def normalise_rewards(rewards: Tensor, mean: Tensor | float, var: Tensor | float, eps: float = 1e-8) -> Tensor:
    """Standardise rewards with running statistics, ``(r - mean) / sqrt(var + eps)``."""
    var = torch.as_tensor(var, dtype=rewards.dtype)
    return (rewards - mean) / torch.sqrt(var + eps)  # r' = (r - mu) / sqrt(var + eps)
