"""The episode runner's bookkeeping with a scripted worker (the real engine is in
test_episodes_vllm.py): trajectories equal the chat template's tokenization of the whole
conversation (so observations were rendered right, whether a turn ended with its end-of-turn
token or was cut), model tokens and log-probs sit where the mask says, one generate call per
turn batches every live episode, and max_turns / the token budget / a raising environment end
episodes with the right finish reason."""
from __future__ import annotations

import pytest

from agent_testkit import EPISODE_SEED_STRIDE, ScriptedEnv, ScriptedWorker
from dsrl.agent.episodes import episode_metrics, run_episodes, trajectories_to_samples

S = EPISODE_SEED_STRIDE


def _seeds(n):
    return [e * S for e in range(n)]


def _texts(e, t):
    return f"Guess {e} number {t} is 7."


def _template_ids(tok, messages):
    text = tok.apply_chat_template(messages, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("eos", [True, False], ids=["turns-end-with-eos", "turns-cut-by-cap"])
def test_trajectory_equals_template_of_whole_conversation(tiny_tokenizer, eos):
    tok = tiny_tokenizer
    worker = ScriptedWorker(tok, _texts, eos=lambda e, t: eos)
    cap = 64 if eos else 5  # cut turns: 5 tokens, no end-of-turn token
    envs = [ScriptedEnv(done_after=3) for _ in range(2)]
    trajs = run_episodes(worker, tok, envs, max_turns=5, max_episode_tokens=400, max_turn_tokens=cap,
                         seeds=_seeds(2))
    for e, tr in enumerate(trajs):
        assert tr.finish_reason == "done" and tr.turns == 3 and tr.reward == 1.0
        full = _template_ids(tok, tr.messages)
        ids = tr.prompt_ids + tr.response_ids
        # The template ends the last assistant message with "<|im_end|>\n"; the trajectory ends
        # at the last sampled token (<|im_end|> when it ended, else the template adds it).
        tail = tok("<|im_end|>\n" if not eos else "\n", add_special_tokens=False)["input_ids"]
        assert ids + tail == full
        # model tokens at the mask, exactly as sampled, with their log-probs in order
        for t, (a, b) in enumerate(tr.turn_spans):
            assert tr.response_ids[a:b] == worker.sampled[(e, t)]
            assert tr.model_mask[a:b] == [1] * (b - a)
            assert tr.rollout_log_probs[a:b] == [-(k + 1) / 100 - e for k in range(b - a)]
        env_pos = [i for i, m in enumerate(tr.model_mask) if m == 0]
        assert env_pos and all(tr.rollout_log_probs[i] == 0.0 for i in env_pos)
        assert len(tr.model_mask) == len(tr.response_ids) == len(tr.rollout_log_probs)


def test_one_generate_call_per_turn_with_all_live_episodes(tiny_tokenizer):
    worker = ScriptedWorker(tiny_tokenizer, _texts)
    envs = [ScriptedEnv(done_after=d) for d in (1, 3, 2, 3)]
    trajs = run_episodes(worker, tiny_tokenizer, envs, max_turns=5, max_episode_tokens=400, max_turn_tokens=32,
                         seeds=_seeds(4))
    assert [n for n, _ in worker.calls] == [4, 3, 2]  # live episodes per turn
    assert [t.turns for t in trajs] == [1, 3, 2, 3]
    assert [envs[i].actions for i in range(4)][0] == [_texts(0, 0)]


def test_max_turns_ends_episode(tiny_tokenizer):
    worker = ScriptedWorker(tiny_tokenizer, _texts)
    envs = [ScriptedEnv(done_after=10, step_reward=0.25) for _ in range(2)]
    trajs = run_episodes(worker, tiny_tokenizer, envs, max_turns=2, max_episode_tokens=400, max_turn_tokens=32,
                         seeds=_seeds(2))
    for tr in trajs:
        assert tr.finish_reason == "max_turns" and tr.turns == 2
        assert tr.turn_rewards == [0.25, 0.25] and tr.reward == 0.5
        assert tr.model_mask[-1] == 1  # no observation appended after the last turn


def test_token_budget_cuts_the_turn_and_ends_episode(tiny_tokenizer):
    tok = tiny_tokenizer

    def texts(e, t):  # episode 1's first turn is short: it has more room left than episode 0
        return "Hi." if (e, t) == (1, 0) else _texts(e, t)

    probe = run_episodes(ScriptedWorker(tok, texts), tok, [ScriptedEnv(done_after=10) for _ in range(2)],
                         max_turns=2, max_episode_tokens=400, max_turn_tokens=64, seeds=_seeds(2))
    second = [p.turn_spans[1][0] for p in probe]  # where turn 2 starts: turn 1 + the observation
    budget = second[0] + 3  # episode 0: room for 3 tokens of its second turn
    worker = ScriptedWorker(tok, texts)
    trajs = run_episodes(worker, tok, [ScriptedEnv(done_after=10) for _ in range(2)], max_turns=5,
                         max_episode_tokens=budget, max_turn_tokens=64, seeds=_seeds(2))
    tr = trajs[0]
    # one call per turn: the cap is the largest room of a live episode (episode 1's)
    assert worker.calls[1] == (2, budget - second[1])
    assert tr.finish_reason == "budget" and tr.turns == 2 and len(tr.response_ids) == budget
    a, b = tr.turn_spans[1]
    assert b - a == 3 and len(worker.sampled[(0, 1)]) > 3  # cut to its room: a prefix of what was sampled
    assert tr.response_ids[a:b] == worker.sampled[(0, 1)][:3]
    assert tr.rollout_log_probs[a:b] == [-0.01, -0.02, -0.03]
    assert tr.turn_finish[-1] == "length"
    assert all(len(t.response_ids) <= budget for t in trajs)


def test_observation_that_does_not_fit_ends_episode(tiny_tokenizer):
    tok = tiny_tokenizer
    worker = ScriptedWorker(tok, _texts)
    first = len(tok(_texts(0, 0), add_special_tokens=False)["input_ids"]) + 1
    tr = run_episodes(worker, tok, [ScriptedEnv(done_after=10)], max_turns=5, max_episode_tokens=first + 3,
                      max_turn_tokens=64, seeds=[0])[0]
    assert tr.finish_reason == "budget" and tr.turns == 1 and tr.model_mask == [1] * first


def test_raising_env_ends_only_its_episode(tiny_tokenizer):
    worker = ScriptedWorker(tiny_tokenizer, _texts)
    envs = [ScriptedEnv(done_after=3, raise_at=2), ScriptedEnv(done_after=3)]
    trajs = run_episodes(worker, tiny_tokenizer, envs, max_turns=5, max_episode_tokens=400, max_turn_tokens=32,
                         seeds=_seeds(2))
    assert [t.finish_reason for t in trajs] == ["env_error", "done"]
    assert "scripted failure" in trajs[0].infos[-1]["error"]
    m = episode_metrics(trajs)
    assert m["agent/finish_env_error"] == 0.5 and m["agent/finish_done"] == 0.5 and m["agent/turns"] == 2.5


def test_samples_carry_model_mask_and_rewards(tiny_tokenizer):
    worker = ScriptedWorker(tiny_tokenizer, _texts)
    envs = [ScriptedEnv(done_after=2, final_reward=r) for r in (1.0, 0.0)]
    trajs = run_episodes(worker, tiny_tokenizer, envs, max_turns=5, max_episode_tokens=400, max_turn_tokens=32,
                         seeds=_seeds(2))
    samples = trajectories_to_samples(trajs, groups=[0, 0], tokenizer=tiny_tokenizer, index_offset=10)
    for s, tr in zip(samples, trajs):
        assert s.response_ids == tr.response_ids and s.extra["model_mask"] == tr.model_mask
        assert s.rollout_log_probs == tr.rollout_log_probs and s.extra["turns"] == 2
    assert [s.reward for s in samples] == [1.0, 0.0] and [s.index for s in samples] == [10, 11]
    assert "obs 1" in samples[0].text


def test_bad_arguments_name_the_key(tiny_tokenizer):
    w = ScriptedWorker(tiny_tokenizer, _texts)
    with pytest.raises(ValueError, match="rollout.max_turns"):
        run_episodes(w, tiny_tokenizer, [ScriptedEnv()], max_turns=0, max_episode_tokens=10, max_turn_tokens=5)
    with pytest.raises(ValueError, match="rollout.max_model_len=8"):
        run_episodes(w, tiny_tokenizer, [ScriptedEnv()], max_turns=1, max_episode_tokens=10, max_turn_tokens=5,
                     max_context=8, seeds=[0])
