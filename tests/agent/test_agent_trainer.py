"""Multi-turn episodes through the REAL Trainer (dsrl.trainer.Trainer.fit) on the tiny model
(float32), with the real rollout workers: the hf backend (HFWorker sharing the actor's module)
and, marked slow, vLLM. For every step the test checks what the trainer really trained and
scored (tests/agent/agent_trainer_kit.Spy wraps the real methods):
- the loss mask of every training microbatch is the model mask (environment tokens 0);
- rollout log-probs cover exactly the model tokens (0.0 on environment tokens, sampled values on
  model tokens), over episodes of several turns;
- the old-policy pass (reuse off) and the training forward give, at model tokens, the log-probs
  the worker sampled with (fp32, 1e-4): the token ids sampled are the ids scored;
- rollout/response_length counts model tokens only; agent/* metrics are logged (over every
  dynamic-sampling round)."""
from __future__ import annotations

import json

import pytest
import torch

from agent_trainer_kit import Spy, agent_cfg, build_actor, build_trainer
from dsrl.actor.masks import model_tokens, response_loss_mask

TOL = 1e-4


def _check_steps(spy: Spy, *, old_pass: bool, steps: int = 2, samples_per_step: int = 4) -> dict:
    """The per-step checks of the module docstring; returns counts for the caller's checks."""
    assert len(spy.trained) == steps and all(len(b) == samples_per_step for b in spy.trained)
    env_tokens = multi_turn = 0
    for batch in spy.trained:
        for s in batch:
            mask = response_loss_mask(s)
            rl = torch.tensor(s.rollout_log_probs)
            assert len(rl) == len(s.response_ids) == len(mask)
            assert torch.equal(rl[mask == 0], torch.zeros(int((mask == 0).sum())))  # env tokens: exactly 0
            assert bool((rl[mask == 1] < 0).all())  # every model token carries its sampling log-prob
            env_tokens += int((mask == 0).sum())
            multi_turn += s.extra["turns"] > 1
    assert env_tokens > 0 and multi_turn > 0  # episodes of several turns, environment tokens between them
    old = [(samples, rows) for desc, samples, rows in spy.scored if desc == "actor forward"]
    assert len(old) == (steps if old_pass else 0)
    for samples, rows in old:  # the old-policy pass, read back one value per response token
        for s, row in zip(samples, rows):
            mask = response_loss_mask(s).bool()
            assert row.shape == (len(s.response_ids),)
            torch.testing.assert_close(row[mask], torch.tensor(s.rollout_log_probs)[mask], atol=TOL, rtol=0)
            assert torch.equal(row[~mask], torch.zeros(int((~mask).sum())))
    trained_model_tokens = sum(model_tokens(s) for b in spy.trained for s in b)
    loss_tokens = 0.0
    for mb, lp in spy.train_forwards:  # the training forward of every microbatch
        lm, rm = mb["loss_mask"], mb["response_mask"]
        assert bool((lm <= rm).all()) and float((rm - lm).sum()) > 0  # env columns: response yes, loss no
        diff = ((lp - mb["rollout_log_probs"]) * lm).abs().max()
        assert float(diff) < TOL, float(diff)
        loss_tokens += float(lm.sum())
    assert loss_tokens == trained_model_tokens
    return {"model_tokens": [sum(model_tokens(s) for s in b) / len(b) for b in spy.trained]}


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("shared_prompt", ["on", "off"])
def test_guess_the_number_two_steps_hf(tmp_path, tiny_model_path, tiny_tokenizer, shared_prompt):
    """textarena's game; reuse off (the old-policy pass runs), entropy bonus so every sample is
    trained and the weights move between the steps (the hf worker shares them)."""
    cfg = agent_cfg(tiny_model_path, env="guess_the_number",
                    algo={"reuse_logprobs": "off", "entropy_coef": 0.01}, actor={"shared_prompt": shared_prompt})
    actor = build_actor(cfg)
    before = {k: v.clone() for k, v in actor.state_dict_for_export().items()}
    trainer = build_trainer(cfg, actor, tiny_tokenizer, tmp_path)
    spy = Spy(trainer)
    trainer.fit()
    counts = _check_steps(spy, old_pass=True)
    moved = max(float((v - before[k]).abs().max()) for k, v in actor.state_dict_for_export().items())
    assert moved > 0
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    for r, n_model in zip(rows, counts["model_tokens"]):
        assert r["rollout/response_length"] == pytest.approx(n_model)  # model tokens only
        assert r["agent/turns"] > 1 and r["agent/env_tokens"] > 0
        assert r["agent/model_tokens"] == pytest.approx(n_model)
        assert r["reward/mean"] == pytest.approx(r["agent/reward"])
        assert r["rollout/logprob_diff"] < TOL and r["timing/old_logprobs"] > 0


@pytest.mark.slow
def test_calculator_two_steps_hf_reuse_on(tmp_path, tiny_model_path, tiny_tokenizer):
    """The tool task on arith questions; reuse on: no old-policy pass, and the training
    forward's log-probs at model tokens equal the sampled ones. (The random tiny model never
    writes a tool call, so its episodes end after one turn: the multi-turn masks of calculator
    episodes are checked with a scripted model in test_agent_rollout.py.)"""
    cfg = agent_cfg(tiny_model_path, env="calculator", algo={"reuse_logprobs": "on", "entropy_coef": 0.01})
    actor = build_actor(cfg)
    trainer = build_trainer(cfg, actor, tiny_tokenizer, tmp_path)
    spy = Spy(trainer)
    trainer.fit()
    assert len(spy.trained) == 2 and not [d for d, _, _ in spy.scored if d == "actor forward"]
    for batch in spy.trained:
        for s in batch:
            assert len(s.rollout_log_probs) == len(s.response_ids) == len(s.extra["model_mask"])
            assert s.reward in (0.0, 1.0, 1.1)
    assert spy.train_forwards
    for mb, lp in spy.train_forwards:
        assert float(((lp - mb["rollout_log_probs"]) * mb["loss_mask"]).abs().max()) < TOL
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and all(r["timing/old_logprobs"] == 0.0 for r in rows)
    assert all("agent/tool_calls" in r and r["train/grad_norm"] > 0 for r in rows)


@pytest.mark.slow
def test_guess_the_number_two_steps_vllm(tmp_path, tiny_model_path, tiny_tokenizer):
    """The same checks with the real vLLM engine (its own processes; weights pushed after step 1
    and verified by the sync probe) at temperature 0.8: token identity between what vLLM
    sampled and what the trainer scored, over several turns, on both steps."""
    cfg = agent_cfg(tiny_model_path, env="guess_the_number", backend="vllm",
                    rollout={"temperature": 0.8}, algo={"reuse_logprobs": "off", "entropy_coef": 0.01})
    actor = build_actor(cfg)
    trainer = build_trainer(cfg, actor, tiny_tokenizer, tmp_path)
    try:
        spy = Spy(trainer)
        trainer.fit()
    finally:
        trainer.worker.close()
    _check_steps(spy, old_pass=True)
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["agent/turns"] > 1 for r in rows)
    # the probe on the first push (rollout.sync_probe_every auto); the pushes between are checked by the
    # train step on its samples (the run stops otherwise)
    assert rows[0]["rollout/sync_logprob_diff"] < TOL and all(r.get("rollout/sync_logprob_diff", 0.0) < TOL for r in rows)


@pytest.mark.slow
def test_dynamic_sampling_rounds_of_episodes(tmp_path, tiny_model_path, tiny_tokenizer):
    """Dynamic sampling drops groups whose episodes all got the same reward (the random model
    loses every game: -1) and generates more rounds; the step trains the fillers and its agent/*
    metrics cover every generated episode (2 rounds of 4)."""
    cfg = agent_cfg(tiny_model_path, env="guess_the_number", trainer={"total_steps": 1},
                    algo={"dynamic_sampling": True, "max_sampling_rounds": 2, "entropy_coef": 0.01})
    trainer = build_trainer(cfg, build_actor(cfg), tiny_tokenizer, tmp_path)
    spy = Spy(trainer)
    trainer.fit()
    (row,) = _rows(tmp_path)
    assert row["rollout/sampling_rounds"] == 2 and row["rollout/filler_groups"] == 2
    assert len(spy.trained) == 1 and len(spy.trained[0]) == 4
    assert row["agent/reward"] == pytest.approx(row["reward/mean"]) and row["agent/turns"] > 1
