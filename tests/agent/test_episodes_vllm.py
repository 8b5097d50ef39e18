"""Token identity over several turns with the REAL vLLM worker (tiny Llama, fp32): what the engine
sampled is what the trainer scores. The trajectories go through dsrl's collate and the
trainer's log-prob function (dsrl.actor.logprobs.token_logprobs) on an HF forward of the same
weights: at every model-token position the log-prob equals the engine's sampling log-prob
(temperature 0.8, fp32 tolerance 1e-4). Environment tokens are masked (mask 0, log-prob 0),
each turn is one generate call holding every live episode, and the sampled ids are not what
re-tokenizing their text would give (so a runner that re-tokenized would fail this test)."""
from __future__ import annotations

import pytest
import torch

from agent_testkit import CountingWorker, ScriptedEnv
from dsrl.actor.batch import collate
from dsrl.actor.logprobs import token_logprobs
from dsrl.agent.episodes import run_episodes, trajectories_to_samples
from dsrl.rollout.seeds import request_seeds

pytestmark = pytest.mark.slow

TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    from dsrl.rollout.vllm_worker import VLLMWorker

    worker = VLLMWorker(str(tiny_model_path), dtype="float32", seed=0, max_model_len=512, kv_cache_gib=1)
    yield worker
    worker.close()


@pytest.fixture(scope="module")
def hf_model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32).eval()


def test_multi_turn_token_identity_with_vllm(engine, hf_model, tiny_tokenizer):
    tok = tiny_tokenizer
    worker = CountingWorker(engine)
    envs = [ScriptedEnv(done_after=d) for d in (3, 2, 3)]
    trajs = run_episodes(worker, tok, envs, max_turns=4, max_episode_tokens=300, max_turn_tokens=12,
                         temperature=TEMPERATURE, top_p=1.0, seeds=request_seeds(7, 1, 0, 3))
    # one batched call per turn, holding every live episode
    assert worker.calls == [3, 3, 2]
    assert [t.turns for t in trajs] == [3, 2, 3] and all(t.finish_reason == "done" for t in trajs)

    # the model's tokens are exactly what the engine returned, turn by turn
    live = [[0, 1, 2], [0, 1, 2], [0, 2]]
    for turn, (episodes, returned) in enumerate(zip(live, worker.returned)):
        for e, groups in zip(episodes, returned):
            a, b = trajs[e].turn_spans[turn]
            assert trajs[e].response_ids[a:b] == groups[0]

    # re-tokenizing the sampled text would not give the sampled ids back
    roundtrip = [tok(tok.decode(t.response_ids[a:b]), add_special_tokens=False)["input_ids"]
                 == t.response_ids[a:b] for t in trajs for a, b in t.turn_spans]
    assert not all(roundtrip)

    # the trainer's view: collate + forward + token log-probs at the targets
    samples = trajectories_to_samples(trajs, groups=[0, 1, 2], tokenizer=tok)
    masks = [torch.tensor(s.extra["model_mask"], dtype=torch.float32) for s in samples]
    batch = collate(samples, tok.pad_token_id, {"model_mask": masks})
    with torch.no_grad():
        logits = hf_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    lp, _ = token_logprobs(logits, batch["targets"], temperature=TEMPERATURE)
    model = batch["model_mask"].bool()
    assert torch.equal(batch["loss_mask"].bool(), model)  # collate's loss mask is the model mask
    env = batch["response_mask"].bool() & ~model
    assert int(model.sum()) == sum(t.model_tokens for t in trajs) and int(env.sum()) > 0
    torch.testing.assert_close(lp[model], batch["rollout_log_probs"][model], atol=1e-4, rtol=0)
    assert torch.equal(batch["rollout_log_probs"][env], torch.zeros(int(env.sum())))
    # the environment's text is in the token stream as rendered (its observations are there)
    assert "obs 1" in samples[0].text and "obs 2" in samples[0].text and "obs 2" not in samples[1].text


def test_per_prompt_max_tokens_and_stop_strings_with_vllm(engine, tiny_tokenizer):
    """What the agent endpoint relies on (one batched call, each call with its own limits): each
    prompt generates up to its own max_tokens, and a stop string ends its completion at the token
    that completes it, that token kept in the ids (the text ends before the stop string), the ids
    a prefix of what the same seed samples without the stop string."""
    tok = tiny_tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say something."}], add_generation_prompt=True,
                                     tokenize=True)["input_ids"]
    stops = ["e", "a", "o", " "]
    kw = dict(n=1, temperature=1.0, top_p=1.0, seeds=[11, 12, 13])
    free = engine.generate([prompt] * 3, max_tokens=40, **kw)
    got = engine.generate([prompt] * 3, max_tokens=[2, 5, 40], stop=[[], [], stops], **kw)
    assert [len(g[0].token_ids) for g in got[:2]] == [2, 5]
    assert got[0][0].token_ids == free[0][0].token_ids[:2] and got[1][0].token_ids == free[1][0].token_ids[:5]
    ids = list(got[2][0].token_ids)
    assert got[2][0].finish_reason == "stop" and ids == list(free[2][0].token_ids[:len(ids)])
    assert any(s in tok.decode(ids) for s in stops) and not any(s in tok.decode(ids[:-1]) for s in stops)
    assert not any(s in got[2][0].text for s in stops)
