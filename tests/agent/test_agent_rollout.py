"""generate_episode_samples, the trainer's entry: n episodes per prompt as one GRPO group, each
(prompt, episode, turn) with its own seed, Samples whose loss mask is the model mask; and the
calculator environment end to end through the runner (a scripted model calls the tool, reads
the result, answers: reward 1.1, the result's tokens are environment tokens)."""
from __future__ import annotations

import pytest
import torch

from agent_testkit import ScriptedWorker
from dsrl.actor.batch import Sample, collate
from dsrl.actor.masks import response_loss_mask
from dsrl.agent.rollout import EPISODE_SEED_STRIDE, generate_episode_samples
from dsrl.data.arith import ArithSource

STRIDE = EPISODE_SEED_STRIDE


def _calc_script(e, t):
    # even episodes use the tool then answer; odd ones answer wrong at once
    if e % 2 == 0:
        return "<tool>calc: 47 + 38</tool>" if t == 0 else "85"
    return "84"


def test_groups_seeds_and_masks(tiny_tokenizer):
    tok = tiny_tokenizer
    prompts = [ArithSource(digits=2).make_prompt((47, 38), "train")] * 2
    worker = ScriptedWorker(tok, _calc_script, stride=STRIDE)
    samples, metrics = generate_episode_samples(
        worker, tok, prompts, env="calculator", env_kwargs={}, n=2, max_turns=3, max_episode_tokens=200,
        max_turn_tokens=32, temperature=1.0, top_p=1.0, seeds=[0, 2 * STRIDE], index_offset=5)
    # prompt g's episode k has seed s_g + k * STRIDE: episodes 0..3 in ScriptedWorker's terms
    assert sorted(worker.sampled) == [(0, 0), (0, 1), (1, 0), (2, 0), (2, 1), (3, 0)]
    assert [s.group for s in samples] == [0, 0, 1, 1] and [s.index for s in samples] == [5, 6, 7, 8]
    assert [s.reward for s in samples] == pytest.approx([1.1, 0.0, 1.1, 0.0])
    assert [s.extra["turns"] for s in samples] == [2, 1, 2, 1]
    assert metrics["agent/tool_calls"] == 0.5 and metrics["agent/reward"] == pytest.approx(0.55)

    s = samples[0]
    mask = response_loss_mask(s)
    env_text = tok.decode([t for t, m in zip(s.response_ids, mask.tolist()) if m == 0])
    model_text = tok.decode([t for t, m in zip(s.response_ids, mask.tolist()) if m == 1])
    assert "<result>85</result>" in env_text and "<result>" not in model_text
    assert model_text == "<tool>calc: 47 + 38</tool><|im_end|>85<|im_end|>"
    assert torch.equal(response_loss_mask(samples[1]), torch.ones(len(samples[1].response_ids)))


def test_loss_mask_in_collated_batch(tiny_tokenizer):
    """collate and collate_shared_prompt put the model mask in loss_mask (response token k at
    column P-1+k, resp. k) and ones in response_mask; a single-turn sample keeps all ones."""
    from dsrl.actor.shared_prompt import collate_shared_prompt

    s = Sample(prompt_ids=[1, 2, 3], response_ids=[10, 11, 12, 13], rollout_log_probs=[-0.5, 0.0, 0.0, -0.25],
               group=0, extra={"model_mask": [1, 0, 0, 1]})
    single = Sample(prompt_ids=[1, 2, 3], response_ids=[10, 11], rollout_log_probs=[-0.5, -0.1], group=0, index=1)
    batch = collate([s, single], pad_id=0)
    assert torch.equal(batch["loss_mask"], torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 1.0, 1.0, 0.0, 0.0]]))
    assert torch.equal(batch["response_mask"], torch.tensor([[0.0, 0.0, 1.0, 1.0, 1.0, 1.0],
                                                             [0.0, 0.0, 1.0, 1.0, 0.0, 0.0]]))
    shared = collate_shared_prompt([s, single], pad_id=0)
    assert torch.equal(shared["loss_mask"], torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0]]))
    assert torch.equal(shared["response_mask"], torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="sample 7: model_mask has 2 entries for 4 response tokens"):
        response_loss_mask(Sample([1], [1, 2, 3, 4], [0.0] * 4, group=0, index=7, extra={"model_mask": [1, 0]}))


def test_limits_name_the_key(tiny_tokenizer):
    w = ScriptedWorker(tiny_tokenizer, _calc_script, stride=STRIDE)
    kw = dict(env="calculator", env_kwargs={}, max_episode_tokens=100, max_turn_tokens=8, temperature=1.0, top_p=1.0)
    with pytest.raises(ValueError, match="rollout.max_turns=300"):
        generate_episode_samples(w, tiny_tokenizer, [], n=1, max_turns=300, **kw)
    with pytest.raises(ValueError, match="algo.n_samples_per_prompt=300"):
        generate_episode_samples(w, tiny_tokenizer, [], n=300, max_turns=2, **kw)


def test_mean_episode_metrics_weights_rounds_by_episodes():
    """Dynamic sampling runs several rounds per step: the step's agent/* metrics are the means
    over every episode generated, i.e. weighted by each round's episode count."""
    from dsrl.agent.rollout import mean_episode_metrics

    rounds = [(8, {"agent/reward": 0.5, "agent/turns": 2.0}), (4, {"agent/reward": 1.0, "agent/turns": 1.0})]
    assert mean_episode_metrics(rounds) == pytest.approx({"agent/reward": (8 * 0.5 + 4 * 1.0) / 12,
                                                          "agent/turns": (8 * 2.0 + 4 * 1.0) / 12})
    assert mean_episode_metrics([]) == {}
