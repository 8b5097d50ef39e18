"""Advantage estimators and the single entry point the trainer calls, `compute_advantages`.

Estimator signature (registry `register_advantage`):

    fn(rewards[N], mask[N, L], group_ids[N] | None, config, kl[N, L] | None) -> (advantages, returns)

`rewards` are raw scalar rewards (group normalisation happens here, not on the rollout side);
`group_ids` label the prompt group of each sample (None = contiguous blocks of
n_samples_per_prompt). Outputs are [N, L] and exactly 0 where the mask is 0. An estimator with
the attribute `needs_values = True` (gae) also receives `values=` [N, L], the critic's values.

Episodes split into several sequences (the agent endpoint: an agent that rewrote its history
trains as several samples sharing the episode's reward): rollout_data["episode_ids"] [N] labels
each sample's episode, and the group statistics count every episode once (episodes A=1 in three
samples, B=1, C=0, D=0: group mean 1/2, not 4/6). An estimator with the attribute
`per_episode = True` receives `episode_ids=` (the built-in group estimators); one without it is
refused when an episode has several samples.
"""
from __future__ import annotations

from typing import Any, MutableMapping, Optional

import torch
import torch.distributed as dist
from torch.nn.utils.rnn import pad_sequence

from dsrl.loss.detach import detach_fixed_scores, fixed
from dsrl.loss.kl import approx_kl
from dsrl.loss.opd import apply_opd_kl_to_advantages
from dsrl.loss.options import opt
from dsrl.loss.registry import get_advantage_estimator, register_advantage

GRPO_STD_EPS = 1e-6
WHITEN_EPS = 1e-8


def group_index(n: int, group_ids: Optional[Any], config: Any) -> torch.Tensor:
    """Dense group index in [0, G) for each of n samples."""
    if group_ids is not None:
        ids = torch.as_tensor(group_ids)
        if ids.shape != (n,):
            raise ValueError(f"group_ids has shape {tuple(ids.shape)}, expected ({n},)")
        return torch.unique(ids, return_inverse=True)[1]
    k = int(opt(config, "n_samples_per_prompt"))
    if k <= 0 or n % k:
        raise ValueError(f"{n} samples do not split into groups of n_samples_per_prompt={k}; pass group_ids")
    return torch.arange(n) // k


def split_episodes(n: int, episode_ids: Optional[Any]) -> Optional[torch.Tensor]:
    """Dense episode index of each of n samples; None without labels or when every episode has one sample."""
    if episode_ids is None:
        return None
    ids = torch.as_tensor(episode_ids)
    if ids.shape != (n,):
        raise ValueError(f"episode_ids has shape {tuple(ids.shape)}, expected ({n},)")
    eid = torch.unique(ids, return_inverse=True)[1]
    return eid if n and int(eid.max()) + 1 < n else None


def group_stats(rewards: torch.Tensor, gid: torch.Tensor, episodes: Optional[torch.Tensor] = None):
    """Per-sample (group mean, group unbiased std, group size, group sum); std is NaN for size 1.
    `episodes` (dense episode index per sample, split_episodes): the statistics are the episodes'
    (each counted once, size = episodes in the group), gathered back to every sample of each."""
    if episodes is not None:
        episodes = episodes.to(rewards.device)
        n_ep = int(episodes.max()) + 1
        first = torch.full((n_ep,), len(rewards), dtype=torch.long, device=rewards.device).scatter_reduce_(
            0, episodes, torch.arange(len(rewards), device=rewards.device), reduce="amin")
        ep_gid = gid.to(rewards.device)[first]
        if not (bool((rewards == rewards[first][episodes]).all()) and bool((gid.to(rewards.device) == ep_gid[episodes]).all())):
            raise ValueError("the samples of an episode (episode_ids) must share its reward and its group")
        return tuple(x[episodes] for x in group_stats(rewards[first], ep_gid))
    g = int(gid.max()) + 1 if gid.numel() else 0
    gid = gid.to(rewards.device)
    count = torch.zeros(g, dtype=rewards.dtype, device=rewards.device).index_add_(0, gid, torch.ones_like(rewards))
    total = torch.zeros_like(count).index_add_(0, gid, rewards)
    mean = total / count
    sq = torch.zeros_like(count).index_add_(0, gid, (rewards - mean[gid]).square())
    std = (sq / (count - 1)).sqrt()
    return mean[gid], std[gid], count[gid], total[gid]


def _broadcast(per_sample: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.to(per_sample.dtype)
    return per_sample[:, None] * m


def _kl(kl: Optional[torch.Tensor], mask: torch.Tensor, dtype) -> torch.Tensor:
    if kl is None:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return torch.where(mask > 0, kl.to(dtype).nan_to_num(0.0, 0.0, 0.0), torch.zeros((), dtype=dtype, device=mask.device))


@register_advantage("grpo")
def grpo(rewards, mask, group_ids, config, kl=None, *, episode_ids=None):
    """Group-centred reward, divided by (unbiased group std + 1e-6) if grpo_std_normalization.
    As miles: the division is skipped for groups of size 1 or with std 0 (their centred reward is
    0 anyway; this only avoids 0/0). KL is ignored (use the KL loss)."""
    mean, std, count, _ = group_stats(rewards, group_index(len(rewards), group_ids, config),
                                      split_episodes(len(rewards), episode_ids))
    adv = rewards - mean
    if opt(config, "grpo_std_normalization"):
        divide = (count > 1) & (std > 0)
        adv = torch.where(divide, adv / (std.nan_to_num(1.0) + GRPO_STD_EPS), adv)
    a = _broadcast(adv, mask)
    return a, a.clone()


@register_advantage("dr_grpo")
def dr_grpo(rewards, mask, group_ids, config, kl=None, *, episode_ids=None):
    """Dr. GRPO: group mean-centring only (no std division, which biases toward easy/hard groups)."""
    mean, _, _, _ = group_stats(rewards, group_index(len(rewards), group_ids, config),
                                split_episodes(len(rewards), episode_ids))
    a = _broadcast(rewards - mean, mask)
    return a, a.clone()


@register_advantage("rloo")
def rloo(rewards, mask, group_ids, config, kl=None, *, episode_ids=None):
    """REINFORCE leave-one-out: A_i = r_i − mean_{j≠i} r_j. A group of one has no other sample:
    its baseline is 0 (plain REINFORCE) rather than undefined."""
    _, _, count, total = group_stats(rewards, group_index(len(rewards), group_ids, config),
                                     split_episodes(len(rewards), episode_ids))
    baseline = torch.where(count > 1, (total - rewards) / (count - 1).clamp(min=1), torch.zeros_like(rewards))
    a = _broadcast(rewards - baseline, mask)
    return a, a.clone()


@register_advantage("reinforce_pp", uses_kl_in_reward=True)
def reinforce_pp(rewards, mask, group_ids, config, kl=None, *, episode_ids=None):
    """REINFORCE++: token reward −kl_coef·kl_t on trainable tokens plus the raw reward at the last
    trainable token, discounted returns G_t = u_t + γ·G_{t+1}; A = R = G (0 on masked tokens).
    KL on non-trainable tokens (not sampled by the policy) is not charged."""
    dtype = rewards.dtype
    m = mask > 0
    if not bool(m.any(-1).all()):
        raise ValueError("reinforce_pp needs at least one trainable token per sample")
    u = -float(opt(config, "kl_coef")) * _kl(kl, mask, dtype)
    last = (m.to(torch.long) * torch.arange(1, m.shape[1] + 1, device=m.device)).argmax(-1)
    u = u.clone()
    u[torch.arange(len(rewards), device=u.device), last] += rewards
    gamma = float(opt(config, "gamma"))
    g = torch.zeros_like(u)
    running = torch.zeros_like(u[:, 0])
    for t in range(u.shape[1] - 1, -1, -1):
        running = u[:, t] + gamma * running
        g[:, t] = running
    a = g * m.to(dtype)
    return a, a.clone()


@register_advantage("reinforce_pp_baseline", uses_kl_in_reward=True)
def reinforce_pp_baseline(rewards, mask, group_ids, config, kl=None, *, episode_ids=None):
    """REINFORCE++ with a group-mean baseline: A_t = (r − mean_group r) − kl_coef·kl_t; R = A."""
    mean, _, _, _ = group_stats(rewards, group_index(len(rewards), group_ids, config),
                                split_episodes(len(rewards), episode_ids))
    a = _broadcast(rewards - mean, mask) - float(opt(config, "kl_coef")) * _kl(kl, mask, rewards.dtype)
    return a, a.clone()


@register_advantage("gae", uses_kl_in_reward=True)
def gae(rewards, mask, group_ids, config, kl=None, *, values=None):
    """PPO's GAE over the trainable tokens of each sample (miles' semantics): token reward
    u_t = -kl_coef*kl_t plus the raw reward at the last trainable token; masked positions (prompt,
    padding, environment tokens) are skipped as if absent, so TD steps join consecutive
    *trainable* tokens and the value after the last one is 0 (also for truncated samples):
    delta_t = u_t + gamma*V_next - V_t, A_t = delta_t + gamma*lambda*A_next, R = A + V.
    `values` [N, L]: the critic's value at each target column (column t = the state before
    token t+1 is generated, aligned like the log-probs). A = R = 0 on masked tokens."""
    if values is None:
        raise ValueError("algo.advantage_estimator=gae needs the critic's values (rollout_data['values'])")
    m = mask > 0
    dtype = rewards.dtype
    if values.shape != mask.shape:
        raise ValueError(f"gae: values have shape {tuple(values.shape)}, the loss mask {tuple(mask.shape)}")
    v = torch.where(m, values.to(dtype).nan_to_num(0.0, 0.0, 0.0), torch.zeros((), dtype=dtype, device=mask.device))
    u = -float(opt(config, "kl_coef")) * _kl(kl, mask, dtype)
    has_token = m.any(-1)
    last = (m.to(torch.long) * torch.arange(1, m.shape[1] + 1, device=m.device)).argmax(-1)
    rows = torch.nonzero(has_token).squeeze(-1)
    u = u.clone()
    u[rows, last[rows]] += rewards[rows]  # a sample without a trainable token gets nothing
    gamma, lam = float(opt(config, "gamma")), float(opt(config, "gae_lambda"))
    adv = torch.zeros_like(u)
    next_v = torch.zeros_like(u[:, 0])  # V after the last trainable token: 0
    next_a = torch.zeros_like(u[:, 0])
    for t in range(u.shape[1] - 1, -1, -1):
        here = m[:, t]
        a_t = u[:, t] + gamma * next_v - v[:, t] + gamma * lam * next_a
        adv[:, t] = torch.where(here, a_t, torch.zeros_like(a_t))
        next_v = torch.where(here, v[:, t], next_v)  # masked positions carry the next state through
        next_a = torch.where(here, a_t, next_a)
    ret = torch.where(m, adv + v, torch.zeros_like(adv))
    return adv, ret


gae.needs_values = True  # compute_advantages passes rollout_data["values"] (Trainer.train_on's critic pass)
# compute_advantages passes rollout_data["episode_ids"]: group statistics per episode (reinforce_pp
# has none: each sample's own reward).
for _estimator in (grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline):
    _estimator.per_episode = True


def whiten_advantages(adv: torch.Tensor, mask: torch.Tensor, group=None) -> torch.Tensor:
    """Masked whitening with global statistics: all-reduce [Σm·a, Σm·a², Σm] over `group` when
    torch.distributed is initialised, then (a − μ)·rsqrt(σ² + 1e-8), σ² unbiased (N/(N−1)) for
    N ≥ 2. Sums are taken in float64. Every rank joins the all-reduce even with an empty local mask
    (skipping would hang the others); masked positions come out as 0."""
    m = (mask > 0)
    a = torch.where(m, adv, torch.zeros_like(adv)).to(torch.float64)
    mf = m.to(torch.float64)
    stats = torch.stack([(a * mf).sum(), (a * a * mf).sum(), mf.sum()])
    if dist.is_available() and dist.is_initialized():
        from dsrl.distributed.collectives import all_reduce_

        all_reduce_(stats, group=group)  # host tensor: NCCL-safe
    s1, s2, n = stats.tolist()
    if n == 0:
        raise ValueError("whiten_advantages: the global loss-mask sum is 0 (no trainable token)")
    mean = s1 / n
    var = s2 / n - mean * mean
    if n >= 2:
        var = var * n / (n - 1)
    scale = 1.0 / (max(var, 0.0) + WHITEN_EPS) ** 0.5
    out = (adv.to(torch.float64) - mean) * scale
    return torch.where(m, out, torch.zeros_like(out)).to(adv.dtype)


def _pad(x) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    return pad_sequence([torch.as_tensor(t) for t in x], batch_first=True)


def compute_advantages(rollout_data: MutableMapping[str, Any], config: Any) -> MutableMapping[str, Any]:
    """Fill rollout_data["advantages"] and ["returns"] (detached, same layout as the mask).

    Reads: rewards [N]; loss_mask [N, L] (or a list of per-sample 1-D masks, then every per-token
    input is a list too and outputs are lists); optional group_ids [N]; optional episode_ids [N]
    (group statistics per episode, see the module docstring); old_log_probs /
    rollout_log_probs / ref_log_probs / teacher_log_probs / opd_reverse_kl; values (gae's critic).
    Order: persistent detach boundary -> KL-in-reward -> estimator -> OPD -> whitening.
    """
    detach_fixed_scores(rollout_data)  # first, before anything reads a score
    mask_in = rollout_data["loss_mask"]
    as_list = not isinstance(mask_in, torch.Tensor)
    lengths = [len(m) for m in mask_in] if as_list else None
    mask = _pad(mask_in)
    rewards = torch.as_tensor(rollout_data["rewards"])
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.float32)
    rewards = rewards.to(mask.device)

    src_key = "rollout_log_probs" if opt(config, "use_rollout_logprobs") else "old_log_probs"
    src = rollout_data.get(src_key)
    kl_coef = float(opt(config, "kl_coef"))
    if kl_coef != 0:
        ref = rollout_data.get("ref_log_probs")
        if src is None or ref is None:
            missing = src_key if src is None else "ref_log_probs"
            raise ValueError(f"kl_coef != 0 needs {missing} (KL-in-reward is incompatible with training log-prob reuse)")
        kl = approx_kl(_pad(src), _pad(ref), opt(config, "kl_loss_type"))
        kl = torch.where(mask > 0, kl.nan_to_num(0.0, 0.0, 0.0), torch.zeros_like(kl))
    else:
        # Also the reuse path, where no old-policy pass ran: zero KL shaped like the loss mask.
        kl = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)

    name = opt(config, "advantage_estimator")
    estimator = get_advantage_estimator(name)
    extra = {}
    if getattr(estimator, "needs_values", False):  # gae: the critic's values, a fixed input like the scores
        values = fixed(rollout_data.get("values"))
        if values is None:
            raise ValueError(f"algo.advantage_estimator={name} needs rollout_data['values'] from the critic")
        rollout_data["values"] = values
        extra["values"] = _pad(values).to(mask.device)
    episode_ids = rollout_data.get("episode_ids")
    if episode_ids is not None:
        if getattr(estimator, "per_episode", False):
            extra["episode_ids"] = episode_ids
        elif split_episodes(len(rewards), episode_ids) is not None:
            raise ValueError(f"algo.advantage_estimator={name}: an episode trains as several samples here "
                             f"(rollout_data['episode_ids']) and the estimator does not declare per_episode = True "
                             f"(taking episode_ids=, so that group statistics count each episode once)")
    adv, ret = estimator(rewards, mask, rollout_data.get("group_ids"), config, kl, **extra)

    if opt(config, "use_opd"):
        if src is None:
            raise ValueError(f"use_opd requires {src_key} as the student scores (OPD is incompatible with "
                             "training log-prob reuse)")
        if as_list:
            rows = apply_opd_kl_to_advantages(config, rollout_data, [a[:n] for a, n in zip(adv, lengths)], src)
            adv = _pad(rows)
        else:
            adv = apply_opd_kl_to_advantages(config, rollout_data, adv, src)
        adv = torch.where(mask > 0, adv, torch.zeros_like(adv))

    if opt(config, "normalize_advantages"):
        adv = whiten_advantages(adv, mask)

    adv, ret = adv.detach(), ret.detach()
    if as_list:
        adv = [a[:n] for a, n in zip(adv, lengths)]
        ret = [r[:n] for r, n in zip(ret, lengths)]
    rollout_data["advantages"] = adv
    rollout_data["returns"] = ret
    return rollout_data
