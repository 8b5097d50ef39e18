"""Token-budget microbatches (actor.max_tokens_per_microbatch): every sample exactly once, the
budget kept, pad fraction by hand; shared-prompt rows longer than the budget split with their
prompt; and on the real tiny engine the Trainer's update and loss equal the count-based path to
float tolerance while train/pad_fraction is the hand-computed one."""
import dataclasses
import importlib.util
import random
from pathlib import Path

import pytest

from dsrl.actor.batch import Sample
from dsrl.actor.packing import padded_tokens, plan_microbatches
from dsrl.rollout.samples import pack_microbatches

PAD = 0


def _sample(index, p, r, prompt_id=None):
    base = 100 + 10 * (index if prompt_id is None else prompt_id)
    return Sample(prompt_ids=[base + k for k in range(p)], response_ids=[7] * r, rollout_log_probs=[0.0] * r,
                  group=index if prompt_id is None else prompt_id, index=index)


def _pad_fraction(mbs):
    padded, total = map(sum, zip(*(padded_tokens(mb) for mb in mbs)))
    return padded / total


def test_budget_bins_by_length_and_pad_fraction_by_hand():
    # lengths (prompt + response) 10, 4, 9, 3, each its own prompt (dense rows)
    s = [_sample(0, 6, 4), _sample(1, 2, 2), _sample(2, 5, 4), _sample(3, 2, 1)]
    # count-based, 2 per microbatch: [10, 4] -> 2*10 - 14 = 6 padded; [9, 3] -> 18 - 12 = 6
    assert plan_microbatches(s, micro_batch_size=2) == [[0, 1], [2, 3]]
    assert _pad_fraction(pack_microbatches(s, 2, PAD)) == pytest.approx(12 / 38)
    # budget 20: sorted 10, 9 -> 2*10 = 20 fits; 4 would make 3*10 > 20 -> [4, 3]: 2*4 = 8
    assert plan_microbatches(s, micro_batch_size=2, max_tokens=20) == [[0, 2], [1, 3]]
    mbs = pack_microbatches(s, 2, PAD, max_tokens=20)
    assert [tuple(mb["input_ids"].shape) for mb in mbs] == [(2, 10), (2, 4)]
    assert _pad_fraction(mbs) == pytest.approx((1 + 1) / (20 + 8))
    # a row longer than the budget gets a microbatch of its own
    assert plan_microbatches(s, micro_batch_size=2, max_tokens=8) == [[0], [2], [1, 3]]


@pytest.mark.parametrize("shared", [False, True])
def test_every_sample_exactly_once_and_the_budget_kept(shared):
    rng = random.Random(0)
    s = []
    for g in range(6):  # groups of 1-5 samples sharing a prompt of 2-20 tokens, responses 1-16
        p = rng.randint(2, 20)
        for _ in range(rng.randint(1, 5)):
            s.append(_sample(len(s), p, rng.randint(1, 16), prompt_id=g))
    for budget in (0, 24, 40, 64, 100, 1000):
        plan = plan_microbatches(s, micro_batch_size=3, max_tokens=budget, shared_prompt=shared)
        assert sorted(i for mb in plan for i in mb) == list(range(len(s))), budget
        mbs = pack_microbatches(s, 3, PAD, max_tokens=budget, shared_prompt=shared)
        assert [mb["sample_indices"] for mb in mbs] == plan
        if budget:
            for mb in mbs:
                rows, width = mb["input_ids"].shape
                assert rows * width <= budget or rows == 1, (budget, rows, width)


def test_a_shared_prompt_row_longer_than_the_budget_is_split_with_its_prompt():
    # one group: prompt of 4, responses of 5, 5, 5 -> 19 tokens in one row; budget 14 -> parts of 14 and 9
    s = [_sample(i, 4, 5, prompt_id=0) for i in range(3)]
    mbs = pack_microbatches(s, 8, PAD, max_tokens=14, shared_prompt=True)
    assert [mb["sample_indices"] for mb in mbs] == [[0, 1], [2]]
    assert [mb["input_ids"][0, :4].tolist() for mb in mbs] == [[100, 101, 102, 103]] * 2
    assert [padded_tokens(mb) for mb in mbs] == [(0, 14), (0, 9)]


# ------------------------------------------------------------------ real engine, through the Trainer
_spec = importlib.util.spec_from_file_location("_real_engine_for_token_budget",
                                               Path(__file__).parents[1] / "trainer" / "_real_engine.py")
rt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rt)


def _hand_pad_fraction(samples, groups_of_indices, shared):
    """Padded / total positions from sample lengths alone: rows x longest row - real tokens."""
    padded = total = 0
    for idx in groups_of_indices:
        rows = []
        for i in idx:
            s = samples[i]
            if shared and rows and rows[-1][0] == list(s.prompt_ids):
                rows[-1][1] += len(s.response_ids)
            else:
                rows.append([list(s.prompt_ids), len(s.prompt_ids) + len(s.response_ids)])
        width = max(r[1] for r in rows)
        total += width * len(rows)
        padded += width * len(rows) - sum(r[1] for r in rows)
    return padded / total


@pytest.mark.slow
@pytest.mark.parametrize("shared", ["off", "on"])
def test_token_budget_trains_like_count_based(tiny_model_path, tiny_tokenizer, tmp_path, shared):
    samples = rt.make_samples(tiny_tokenizer, [[1, 0, 0], [1, 1, 0], [0, 1, 0]])
    runs = {}
    for budget in (0, 40):
        cfg = rt.make_cfg(tiny_model_path, reuse_logprobs="on")
        cfg.actor = dataclasses.replace(cfg.actor, shared_prompt=shared, max_tokens_per_microbatch=budget)
        actor = rt.build_engine(tiny_model_path, micro_batch_size=4)
        before = rt.params(actor)
        trainer = rt.make_trainer(cfg, actor, tiny_tokenizer, tmp_path / f"{shared}{budget}", samples=samples)
        seen = []
        real = actor.forward_backward

        def spy(mb, *a, seen=seen, real=real, **k):
            seen.append(list(mb["sample_indices"]))
            return real(mb, *a, **k)
        actor.forward_backward = spy
        metrics = trainer.train_on(samples, 1)
        runs[budget] = (metrics, rt.update(before, rt.params(actor)), seen)
    (m0, u0, seen0), (m1, u1, seen1) = runs[0], runs[40]
    assert sorted(i for mb in seen1 for i in mb) == list(range(9))  # every sample trained once
    assert seen1 != seen0  # the budget really regrouped the samples
    assert m1["train/microbatches"] == len(seen1)
    on = shared == "on"
    assert m0["train/pad_fraction"] == pytest.approx(_hand_pad_fraction(samples, seen0, on), abs=1e-12)
    assert m1["train/pad_fraction"] == pytest.approx(_hand_pad_fraction(samples, seen1, on), abs=1e-12)
    assert m1["train/pad_fraction"] < m0["train/pad_fraction"]
    # same global normalizers, different microbatch sums: equal to float tolerance
    assert m1["train/loss"] == pytest.approx(m0["train/loss"], rel=1e-5, abs=1e-7)
    scale = max(float(u.abs().max()) for u in u0.values())
    assert scale > 1e-3
    for n, u in u0.items():
        assert float((u1[n] - u).abs().max()) <= 1e-4 * scale, n
