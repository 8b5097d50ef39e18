"""The critic in the actor's layouts (dsrl.stages.critic.CriticUpdate on a real tiny critic,
float32, ZeRO-0): shared-prompt microbatches and token-budget bins give the dense layout's values,
per sample, in sample order (each also checked against an independent unpadded forward), and
one train step in each layout gives the dense layout's gradient and metrics.

The samples: a group of two sharing a 3-token prompt, a lone sample with an 8-token prompt, and
a group of three sharing a 5-token prompt; responses of 1-7 tokens. With 4 samples per
microbatch the last group is split across two microbatches; token budgets 14 and 28 reorder the
samples (longest rows first), 14 also splits the last group's shared row into two rows that
each carry the prompt, and 28 puts runs of different prompts in one microbatch."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from dsrl.actor.batch import Sample
from dsrl.actor.critic import CriticEngine
from dsrl.actor.nonfinite import SkipCounter
from dsrl.config.schema import Config
from dsrl.stages.critic import CriticUpdate

pytestmark = pytest.mark.slow  # one engine build, ~20 s on 2 shared cores

# float32: the shared-prompt forward sums the same terms in another order (4-D mask, other
# shapes); measured agreement here is ~4e-8 absolute on values of ~0.1-1 (the actor's
# log-prob test allows 2e-5: tests/actor/test_shared_prompt_engine.py).
VALUE_TOL = 2e-5
GRAD_REL_TOL = 1e-4  # gradients: max |delta| / max |g| per parameter (the actor's test: 1e-4)
MICRO_BATCH = 4
# name -> (critic.shared_prompt, critic.max_tokens_per_microbatch)
LAYOUTS = {"dense": ("off", 0), "shared": ("on", 0), "dense/budget28": ("off", 28),
           "shared/budget14": ("on", 14), "shared/budget28": ("on", 28)}
CLIP = 0.2
ALGO = {"value_clip": CLIP, "value_loss_coef": 1.0}


def _samples():
    g = torch.Generator().manual_seed(11)

    def ids(n):
        return torch.randint(10, 1000, (n,), generator=g).tolist()

    groups = [(ids(3), (6, 2)), (ids(8), (5,)), (ids(5), (3, 7, 1))]
    out = []
    for gi, (prompt, lengths) in enumerate(groups):
        for r in lengths:
            out.append(Sample(prompt_ids=prompt, response_ids=ids(r), rollout_log_probs=[0.0] * r,
                              group=gi, index=len(out), reward=float(len(out) % 2)))
    return out


def _update(critic, layout):
    """The product's CriticUpdate with the critic's layout keys set (the actor's left at their
    defaults: auto, 0), on a fresh layout decision."""
    shared, budget = LAYOUTS[layout]
    cfg = Config()
    cfg.algo = dataclasses.replace(cfg.algo, advantage_estimator="gae", policy_loss="ppo", loss_agg_mode="token-mean")
    cfg.critic = dataclasses.replace(cfg.critic, shared_prompt=shared, max_tokens_per_microbatch=budget,
                                     micro_batch_size=MICRO_BATCH)
    cfg.logger = dataclasses.replace(cfg.logger, progress=False)
    critic.__dict__.pop("_shared_prompt_decision", None)  # decided once per engine: once per layout here
    return CriticUpdate(cfg, critic, pad_id=0, algo=ALGO, skips=SkipCounter(3))


def _seen(critic, method):
    """Record the microbatches `method` of the critic gets (the real method still runs)."""
    seen = []
    real = getattr(critic, method)

    def spy(mbs, *a, **k):
        mbs = list(mbs)
        seen.append(mbs)
        return real(mbs, *a, **k)
    setattr(critic, method, spy)
    return seen, lambda: setattr(critic, method, real)


def _check_layout(layout, mbs, n_samples):
    """The microbatches really are in the layout asked for: shared rows or dense ones; the count
    plan keeps sample order, a budget regroups."""
    shared, budget = LAYOUTS[layout]
    assert all(("logit_index" in mb) == (shared == "on") for mb in mbs), layout
    mbs = [mb for mb in mbs if mb["sample_indices"] != [-1]]  # no rank padding (1 rank), but never counted
    assert mbs
    order = [i for mb in mbs for i in mb["sample_indices"]]
    assert sorted(order) == list(range(n_samples))
    assert (order == list(range(n_samples))) == (budget == 0), (layout, order)


@pytest.fixture(scope="module")
def critic(tiny_model_path):
    torch.manual_seed(0)
    # lr 1, Adam eps 10: a visible step (tests/actor/test_critic.py); no clip: the raw gradient norm.
    return CriticEngine(str(tiny_model_path), zero_stage=0, micro_batch_size=MICRO_BATCH, lr=1.0, eps=10.0,
                        grad_clip=0.0)


def _reference_values(critic, sample):
    """V at each response token from a plain forward of the critic's module on the one sequence
    (no batching, no padding, no DeepSpeed): response token k reads position P-1+k."""
    ids = torch.tensor([list(sample.prompt_ids) + list(sample.response_ids)])
    with torch.no_grad():
        v = critic.module(input_ids=ids, attention_mask=torch.ones_like(ids))
    P = len(sample.prompt_ids)
    return v[0, P - 1:P - 1 + len(sample.response_ids)]


def test_values_in_every_layout_equal_the_dense_ones_in_sample_order(critic):
    samples = _samples()
    refs = [_reference_values(critic, s) for s in samples]
    # The test can fail: a value read one position off (or another sample's) would differ by far
    # more than the tolerance.
    assert min(float((r[1:] - r[:-1]).abs().max()) for r in refs if len(r) > 1) > 1000 * VALUE_TOL
    results, packed = {}, {}
    for layout in LAYOUTS:
        seen, restore = _seen(critic, "values")
        try:
            results[layout] = _update(critic, layout).values(samples)
        finally:
            restore()
        _check_layout(layout, seen[0], len(samples))
        packed[layout] = seen[0]
    # shared/budget14: the last group's row split in two, each with the prompt; shared/budget28:
    # two prompts' runs in one microbatch.
    assert sum(mb["sample_indices"] in ([3], [4, 5]) for mb in packed["shared/budget14"]) == 2
    assert any(len({samples[i].group for i in mb["sample_indices"]}) > 1 for mb in packed["shared/budget28"])
    dense = results["dense"]
    for i, (s, ref) in enumerate(zip(samples, refs)):
        assert dense[i].shape == (len(s.response_ids),)
        torch.testing.assert_close(dense[i], ref, rtol=0, atol=VALUE_TOL)
        for layout, values in results.items():
            assert values[i].shape == dense[i].shape, (layout, i)
            torch.testing.assert_close(values[i], dense[i], rtol=0, atol=VALUE_TOL, msg=f"{layout}, sample {i}")
            torch.testing.assert_close(values[i], ref, rtol=0, atol=VALUE_TOL, msg=f"{layout}, sample {i}")


def test_one_train_step_in_every_layout_gives_the_dense_gradient_and_metrics(critic):
    """Each layout trains from the same weights (restored before each step): the gradient at the
    optimizer step (value head, embedding, an attention projection; every parameter checked)
    and the step's metrics equal the dense layout's. Returns and old values are per-token
    fields aligned with the samples; old values = V -+ (0.1-0.8 or 1.2-1.9) * clip, so the
    clipped branch of the value loss is taken for some tokens and not for others, and no token
    sits on the clip boundary (where float rounding could flip value_clipfrac)."""
    from deepspeed.utils import safe_get_full_grad

    samples = _samples()
    g = torch.Generator().manual_seed(5)
    values = _update(critic, "dense").values(samples)

    def offset(n):
        far = torch.rand(n, generator=g) < 0.5
        size = 0.1 + 0.7 * torch.rand(n, generator=g) + 1.1 * far
        return torch.where(torch.rand(n, generator=g) < 0.5, -size, size) * CLIP
    fields = {"returns": [torch.rand(len(v), generator=g) * 2 - 0.5 for v in values],
              "old_values": [v + offset(len(v)) for v in values]}
    # Nor does a clipped token sit where its clipped and unclipped terms tie (value_clipfrac
    # counts clipped > unclipped): each differs by > 1e-4.
    for v, old, ret in zip(values, fields["old_values"], fields["returns"]):
        moved = (v - old).abs() > CLIP
        assert bool(((v - old).abs() - CLIP).abs().min() > 0.01)
        gap = ((old + (v - old).clamp(-CLIP, CLIP) - ret) ** 2 - (v - ret) ** 2).abs()
        assert bool((gap[moved] > 1e-4).all())
    start = [p.detach().clone() for p in critic.module.parameters()]
    names = [n for n, _ in critic.module.named_parameters()]
    runs = {}
    for layout in LAYOUTS:
        with torch.no_grad():
            for p, p0 in zip(critic.module.parameters(), start):
                p.copy_(p0)
        grads = {}
        real_step = critic.optimizer_step

        def step_spy():
            grads.update({n: safe_get_full_grad(p).clone() for n, p in zip(names, critic.module.parameters())})
            return real_step()
        critic.optimizer_step = step_spy
        seen, restore = _seen(critic, "train_step")
        try:
            metrics = _update(critic, layout).step(samples, fields, step=1)
        finally:
            restore()
            critic.optimizer_step = real_step
        _check_layout(layout, seen[0], len(samples))
        assert not critic.last_step_skipped
        runs[layout] = (metrics, grads)
    with torch.no_grad():
        for p, p0 in zip(critic.module.parameters(), start):
            p.copy_(p0)

    m0, g0 = runs["dense"]
    assert 0 < m0["critic/value_clipfrac"] < 1 and m0["critic/value_loss"] > 0 and m0["critic/grad_norm"] > 0
    for n in ("value_head.weight", "value_head.bias", "backbone.embed_tokens.weight",
              "backbone.layers.0.self_attn.q_proj.weight"):
        assert float(g0[n].abs().max()) > 0, n
    for layout, (metrics, grads) in runs.items():
        assert set(metrics) == set(m0), layout
        for k, v in m0.items():
            assert metrics[k] == pytest.approx(v, rel=1e-5, abs=1e-7), (layout, k)
        for n, g_dense in g0.items():
            scale = float(g_dense.abs().max())
            assert float((grads[n] - g_dense).abs().max()) <= GRAD_REL_TOL * scale, (layout, n)


def test_long_responses_read_values_by_block_attention(critic, block_attention_calls):
    """A group of 8 responses of 24-30 tokens after a 4-token prompt: the critic's shared row
    attends by blocks (dsrl.actor.block_attention, counted) and its values equal each sample's
    own unpadded forward."""
    from long_groups import long_group

    samples = long_group(torch.Generator().manual_seed(7), 4, 0, 0, vocab=(10, 1000))
    update = _update(critic, "shared")
    update.micro_batch_size = 8  # the whole group in one row
    values = update.values(samples)
    assert block_attention_calls, "the critic's long shared row did not attend by blocks"
    for s, v in zip(samples, values):
        torch.testing.assert_close(v, _reference_values(critic, s), rtol=0, atol=VALUE_TOL)
