"""The shared-prompt layout by hand: packed rows, 4-D mask, position ids, the logits gather map,
response-aligned fields; and the auto/on/off decision (an inexact `on` names the key)."""
import types

import pytest
import torch

from dsrl.actor.batch import Sample, masked_rows
from dsrl.actor.packing import padded_tokens
from dsrl.actor.shared_prompt import (
    additive_mask,
    collate_shared_prompt,
    decide_shared_prompt,
    engine_uses_shared_prompt,
    pack_rows,
    prompt_runs,
)
from dsrl.config.schema import Config
from dsrl.errors import ConfigError
from dsrl.rollout.samples import pack_microbatches

PAD = 0


def _s(prompt, resp, index, group=0):
    return Sample(prompt_ids=list(prompt), response_ids=list(resp), group=group, index=index,
                  rollout_log_probs=[-0.5 * (k + 1) for k in range(len(resp))])


def _samples():
    # group A: prompt [11, 12, 13], responses of lengths 2 and 1; group B: prompt [21, 22], response of 3
    return [_s([11, 12, 13], [31, 32], 0), _s([11, 12, 13], [41], 1, 0), _s([21, 22], [51, 52, 53], 2, 1)]


def test_rows_mask_positions_and_gather_map_by_hand():
    mb = collate_shared_prompt(_samples(), PAD, {"advantages": [torch.tensor([1.0, 2.0]), torch.tensor([3.0]),
                                                                  torch.tensor([4.0, 5.0, 6.0])]})
    assert mb["input_ids"].tolist() == [[11, 12, 13, 31, 32, 41], [21, 22, 51, 52, 53, PAD]]
    assert mb["position_ids"].tolist() == [[0, 1, 2, 3, 4, 3], [0, 1, 2, 3, 4, 0]]
    m0 = mb["attention_mask"][0, 0].int().tolist()
    assert m0 == [[1, 0, 0, 0, 0, 0],   # prompt: causal
                  [1, 1, 0, 0, 0, 0],
                  [1, 1, 1, 0, 0, 0],
                  [1, 1, 1, 1, 0, 0],   # response 0: prompt + itself
                  [1, 1, 1, 1, 1, 0],
                  [1, 1, 1, 0, 0, 1]]   # response 1: prompt + itself, never response 0
    m1 = mb["attention_mask"][1, 0].int().tolist()
    assert m1[5] == [0, 0, 0, 0, 0, 1]  # the pad query attends only itself
    assert m1[4] == [1, 1, 1, 1, 1, 0]
    # keep the last L - (min prompt length - 1) = 6 - 1 = 5 positions: kept index = position - 1
    assert mb["logits_to_keep"] == 5
    # sample 0: targets 31 (from prompt end, pos 2), 32 (pos 3); sample 1: 41 (pos 2);
    # sample 2 (row 1, offset 5): 51 (pos 1), 52 (pos 2), 53 (pos 3); unused columns -> prompt end
    assert mb["logit_index"].tolist() == [[1, 2, 1], [1, 1, 1], [5 + 0, 5 + 1, 5 + 2]]
    assert mb["targets"].tolist() == [[31, 32, PAD], [41, PAD, PAD], [51, 52, 53]]
    assert mb["loss_mask"].tolist() == [[1, 1, 0], [1, 0, 0], [1, 1, 1]]
    assert mb["advantages"].tolist() == [[1, 2, 0], [3, 0, 0], [4, 5, 6]]
    assert [r.tolist() for r in masked_rows(mb["rollout_log_probs"], mb["loss_mask"])] == \
        [[-0.5, -1.0], [-0.5], [-0.5, -1.0, -1.5]]
    assert mb["sample_indices"] == [0, 1, 2]
    assert padded_tokens(mb) == (1, 12)  # 6 + 5 real tokens in 2 x 6 positions


def test_short_runs_share_a_row_as_diagonal_blocks():
    # runs of 8 (A), 3 (B) and 4 (C) tokens: rows no longer than 8, longest first -> [A], [C, B]
    s = [_s([11, 12, 13, 14], [31, 32, 33, 34], 0, 0), _s([21, 22], [51], 1, 1), _s([61, 62], [71, 72], 2, 2)]
    mb = collate_shared_prompt(s, PAD)
    assert mb["input_ids"].tolist() == [[11, 12, 13, 14, 31, 32, 33, 34], [61, 62, 71, 72, 21, 22, 51, PAD]]
    assert mb["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 0, 1, 2, 0]]
    assert mb["attention_mask"][1, 0].int().tolist() == [
        [1, 0, 0, 0, 0, 0, 0, 0],   # C's prompt: causal
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],   # C's response: its prompt + itself
        [1, 1, 1, 1, 0, 0, 0, 0],
        [0, 0, 0, 0, 1, 0, 0, 0],   # B's prompt: never sees C
        [0, 0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 1, 1, 1, 0],   # B's response
        [0, 0, 0, 0, 0, 0, 0, 1]]   # pad: only itself
    # keep from the earliest first-prompt end (C's, position 1): K = 8 - 1 = 7, kept index = position - 1
    assert mb["logits_to_keep"] == 7
    # A (row 0): prompt end 3, then 4, 5, 6; B (row 1, prompt end at 5): 7 + 4; C (row 1): 7 + [0, 1], unused -> 7 + 0
    assert mb["logit_index"].tolist() == [[2, 3, 4, 5], [11, 11, 11, 11], [7, 8, 7, 7]]
    assert mb["targets"].tolist() == [[31, 32, 33, 34], [51, PAD, PAD, PAD], [71, 72, PAD, PAD]]
    assert mb["sample_indices"] == [0, 1, 2]
    assert padded_tokens(mb) == (1, 16)  # one row per run would pad to 3 x 8 = 24 positions


def test_pack_rows_first_fit_longest_first():
    assert pack_rows([8, 3, 4]) == [[0], [2, 1]]
    assert pack_rows([5, 5, 5]) == [[0], [1], [2]]
    assert pack_rows([2, 9, 4, 3, 5]) == [[1], [4, 2], [3, 0]]
    assert pack_rows([]) == []


def test_a_group_split_across_microbatches_gets_the_prompt_in_each_part():
    s = _samples()
    mbs = pack_microbatches(s, 1, PAD, shared_prompt=True)
    assert [mb["input_ids"].tolist() for mb in mbs] == \
        [[[11, 12, 13, 31, 32]], [[11, 12, 13, 41]], [[21, 22, 51, 52, 53]]]
    assert prompt_runs(s) == [[0, 1], [2]]
    # same prompt again after another group: a new row, not merged with the first
    assert prompt_runs([s[0], s[2], s[1]]) == [[0], [1], [2]]


def test_additive_mask_is_zero_where_allowed_and_lowest_elsewhere():
    allowed = torch.tensor([[[[True, False], [True, True]]]])
    for dtype in (torch.float32, torch.bfloat16):
        m = additive_mask(allowed, dtype)
        assert m.dtype == dtype
        assert m[0, 0, 0, 0] == 0 and m[0, 0, 1, 1] == 0 and m[0, 0, 1, 0] == 0
        assert m[0, 0, 0, 1] == torch.finfo(dtype).min


def _hf(model_type="llama", attn="eager", **kw):
    return types.SimpleNamespace(model_type=model_type, _attn_implementation=attn, **kw)


def test_decision_auto_on_off():
    assert decide_shared_prompt("auto", _hf()).on
    assert decide_shared_prompt("on", _hf(attn="sdpa")).on
    assert not decide_shared_prompt("off", _hf()).on
    off = decide_shared_prompt("auto", _hf(model_type="gpt2"))
    assert not off.on and "gpt2" in off.reason
    assert not decide_shared_prompt("auto", _hf(attn="flash_attention_2")).on
    assert not decide_shared_prompt("auto", _hf(model_type="qwen2", use_sliding_window=True, sliding_window=64)).on
    hooked = decide_shared_prompt("auto", _hf(), hooks=["my.hook"])
    assert not hooked.on and "before_train_step_hooks" in hooked.reason
    assert decide_shared_prompt("on", _hf(), hooks=["my.hook"]).on


@pytest.mark.parametrize("hf", [_hf(model_type="gpt2"), _hf(attn="flash_attention_2")])
def test_on_where_not_exact_is_a_config_error_naming_the_key(hf):
    with pytest.raises(ConfigError, match=r"actor\.shared_prompt=on"):
        decide_shared_prompt("on", hf)


def test_engine_decision_is_made_once_and_engines_without_a_model_config_stay_dense():
    cfg = Config()
    eng = types.SimpleNamespace(hf_config=_hf(), trainable=True, role="actor")
    assert engine_uses_shared_prompt(cfg, eng)
    eng.hf_config = _hf(model_type="gpt2")  # cached: not re-decided
    assert engine_uses_shared_prompt(cfg, eng)
    assert not engine_uses_shared_prompt(cfg, types.SimpleNamespace())


def test_the_critic_engine_reads_critic_shared_prompt_and_follows_the_actor_when_null():
    """role "critic": critic.shared_prompt decides, null = actor.shared_prompt; the train-step
    hooks (which never see the critic's microbatches) do not turn it off; an inexact `on`
    names critic.shared_prompt, and says it came from actor.shared_prompt when null."""
    import dataclasses

    def critic(hf=None):
        return types.SimpleNamespace(hf_config=hf or _hf(), trainable=True, role="critic")

    cfg = Config()
    cfg.trainer = dataclasses.replace(cfg.trainer, before_train_step_hooks=["my.hook"])
    assert cfg.critic.shared_prompt is None and cfg.actor.shared_prompt == "auto"
    assert engine_uses_shared_prompt(cfg, critic())  # auto, hooks set: on for the critic
    assert not engine_uses_shared_prompt(cfg, types.SimpleNamespace(hf_config=_hf(), trainable=True, role="actor"))
    cfg.actor = dataclasses.replace(cfg.actor, shared_prompt="off")
    eng = critic()
    assert not engine_uses_shared_prompt(cfg, eng)  # null follows the actor's off
    assert "critic.shared_prompt=null, so actor.shared_prompt=off" in eng._shared_prompt_decision.reason
    cfg.critic = dataclasses.replace(cfg.critic, shared_prompt="on")
    assert engine_uses_shared_prompt(cfg, critic())  # its own key wins over the actor's
    cfg.critic = dataclasses.replace(cfg.critic, shared_prompt="off")
    cfg.actor = dataclasses.replace(cfg.actor, shared_prompt="on")
    assert not engine_uses_shared_prompt(cfg, critic())
    with pytest.raises(ConfigError, match=r"^critic\.shared_prompt=on is not exact.*set critic\.shared_prompt=auto"):
        cfg.critic = dataclasses.replace(cfg.critic, shared_prompt="on")
        engine_uses_shared_prompt(cfg, critic(_hf(model_type="gpt2")))
    cfg.critic = dataclasses.replace(cfg.critic, shared_prompt=None)
    with pytest.raises(ConfigError, match=r"^critic\.shared_prompt=null, so actor\.shared_prompt=on is not exact"):
        engine_uses_shared_prompt(cfg, critic(_hf(model_type="gpt2")))


def test_validate_rejects_an_unknown_mode():
    import dataclasses

    from dsrl.validation.validate import validate

    cfg = Config()
    cfg.actor = dataclasses.replace(cfg.actor, shared_prompt="yes")
    with pytest.raises(ConfigError, match=r"actor\.shared_prompt"):
        validate(cfg)
    cfg.actor = dataclasses.replace(cfg.actor, shared_prompt="auto", max_tokens_per_microbatch=-1)
    with pytest.raises(ConfigError, match=r"actor\.max_tokens_per_microbatch"):
        validate(cfg)
    cfg.actor = dataclasses.replace(cfg.actor, max_tokens_per_microbatch=0)
    cfg.algo = dataclasses.replace(cfg.algo, advantage_estimator="gae", policy_loss="ppo")
    validate(cfg)  # the critic's keys default to null (the actor's)
    cfg.critic = dataclasses.replace(cfg.critic, shared_prompt="off", max_tokens_per_microbatch=512)
    validate(cfg)
    cfg.critic = dataclasses.replace(cfg.critic, shared_prompt="yes")
    with pytest.raises(ConfigError, match=r"critic\.shared_prompt='yes' is not one of"):
        validate(cfg)
    cfg.critic = dataclasses.replace(cfg.critic, shared_prompt=None, max_tokens_per_microbatch=-1)
    with pytest.raises(ConfigError, match=r"critic\.max_tokens_per_microbatch=-1 must be >= 0"):
        validate(cfg)
