"""Sampling through vLLM behind the SDK's SamplingClient (one engine for the module, its core in
its own process): sampled log-probs and prompt log-probs equal the trainer's log-probs of the
same tokens, every snapshot samples with its own weights (the latest after a step, the old one
still the old), a LoRA client's named sampler checkpoint is its adapter (PEFT loads it over the
base in transformers; a new sampling client samples from it),
stop tokens end a sequence (included, STOP), and an RL loop (sampling + importance_sampling)
raises the reward."""
from __future__ import annotations

import numpy as np
import pytest
from serve_helpers import MODEL_NAME, datum, logprobs, service_client, start_server

pytestmark = pytest.mark.slow  # vLLM engine start (~30-60 s on a shared 2-core machine)

SAMPLER = dict(dtype="float32", seed=0, max_model_len=256, kv_cache_gib=1, gpu_memory_utilization=0.3,
               enforce_eager=True)


@pytest.fixture(scope="module")
def server(tiny_model_path, tmp_path_factory):
    srv = start_server(tiny_model_path, tmp_path_factory.mktemp("serve_sampling_store"), sampling=True,
                       sampler=SAMPLER, allow_full_parameter=False)
    yield srv
    srv.stop()


def _types():
    from tinker import types

    return types


def _trainer_logprobs(tc, tokens):
    """log p(tokens[i] | tokens[:i]) for i >= 1 from the training client (a forward)."""
    d = datum(tokens[:-1], target_tokens=tokens[1:], weights=[0.0] * (len(tokens) - 1))
    return logprobs(tc.forward([d], "cross_entropy").result())[0]


def test_sampled_and_prompt_logprobs_match_training_and_snapshots_keep_their_weights(sc):
    types = _types()
    tc = sc.create_lora_training_client(MODEL_NAME, rank=4, seed=0).result()
    tok = tc.get_tokenizer()
    prompt = types.ModelInput.from_ints(tok.encode("1+2="))
    first = tc.save_weights_and_get_sampling_client().result()
    res = first.sample(prompt, 3, types.SamplingParams(max_tokens=6, temperature=1.0)).result()
    assert len(res.sequences) == 3
    seq = res.sequences[0]
    assert len(seq.tokens) == len(seq.logprobs) == 6 and seq.stop_reason == "length"
    full = prompt.to_ints() + list(seq.tokens)
    train_lp = _trainer_logprobs(tc, full)
    np.testing.assert_allclose(seq.logprobs, train_lp[-6:], rtol=0, atol=1e-4)
    prompt_lp = first.compute_logprobs(types.ModelInput.from_ints(full)).result()
    assert prompt_lp[0] is None and len(prompt_lp) == len(full)
    np.testing.assert_allclose(prompt_lp[1:], train_lp, rtol=0, atol=1e-4)

    d = datum(full[:-1], target_tokens=full[1:], weights=[1.0] * (len(full) - 1))
    tc.forward_backward([d], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    second = tc.save_weights_and_get_sampling_client().result()
    new_lp = _trainer_logprobs(tc, full)
    assert np.abs(new_lp - train_lp).max() > 0.1  # the step changed the model
    np.testing.assert_allclose(second.compute_logprobs(types.ModelInput.from_ints(full)).result()[1:], new_lp,
                               rtol=0, atol=1e-4)
    # The first snapshot still samples from the weights it was taken with.
    np.testing.assert_allclose(first.compute_logprobs(types.ModelInput.from_ints(full)).result()[1:], train_lp,
                               rtol=0, atol=1e-4)


def test_named_sampler_checkpoint_loads_in_transformers_and_a_new_client(sc, server, tmp_path):
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM

    types = _types()
    tc = sc.create_lora_training_client(MODEL_NAME, rank=2, seed=1, train_attn=False).result()
    tok = tc.get_tokenizer()
    ids = tok.encode("7+8=15")
    d = datum(ids[:-1], target_tokens=ids[1:], weights=[1.0] * (len(ids) - 1))
    tc.forward_backward([d], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    path = tc.save_weights_for_sampler("final").result().path
    assert path.endswith("/sampler_weights/final")
    folder = server.service.store.resolve(path).folder
    # A LoRA client's sampler checkpoint is its adapter alone (PEFT's layout), not a merged model.
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                        "tinker.json"]
    adapter_bytes = sum(p.stat().st_size for p in folder.iterdir())
    base_bytes = sum(p.stat().st_size for p in Path(server.service.opts.model_path).glob("*.safetensors"))
    assert adapter_bytes < base_bytes / 5
    from peft import PeftModel

    hf = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(server.service.opts.model_path,
                                                                        dtype=torch.float32), str(folder))
    with torch.no_grad():
        lsm = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].double(), -1)
    hf_lp = lsm.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()
    np.testing.assert_allclose(hf_lp, _trainer_logprobs(tc, ids), rtol=0, atol=1e-4)
    named = sc.create_sampling_client(model_path=path).result()
    np.testing.assert_allclose(named.compute_logprobs(types.ModelInput.from_ints(ids)).result()[1:], hf_lp,
                               rtol=0, atol=1e-4)


def test_stop_token_ends_the_sequence_and_is_included(sc):
    types = _types()
    base = sc.create_sampling_client(base_model=MODEL_NAME).result()
    prompt = types.ModelInput.from_ints([1, 400, 500, 600])
    greedy = base.sample(prompt, 1, types.SamplingParams(max_tokens=5, temperature=0.0)).result().sequences[0]
    stop_at = greedy.tokens[2]
    cut = greedy.tokens.index(stop_at) + 1
    stopped = base.sample(prompt, 1, types.SamplingParams(max_tokens=5, temperature=0.0, stop=[stop_at])).result()
    s = stopped.sequences[0]
    assert s.stop_reason == "stop" and s.tokens == greedy.tokens[:cut] and len(s.logprobs) == cut


def test_rl_loop_with_importance_sampling_raises_reward(sc):
    """rl_loop style: groups of samples, reward = share of sampled tokens in the lower half of the
    vocabulary, advantage = reward - group mean, datums with target 0 / advantage 0 on the prompt,
    importance_sampling + AdamW, a new sampling client after every step. Sampling with top_k=4:
    a random-init model spreads its mass over the whole vocabulary, where no reward on token ids
    can be learned in a few steps; among its 4 likeliest tokens it can (measured: 0.42-0.52 ->
    0.91-1.0 in 6 steps for 3 seeds)."""
    types = _types()
    tc = sc.create_lora_training_client(MODEL_NAME, rank=8, seed=2).result()
    half = 49152 // 2
    prompts = [[1, 200 + 7 * i, 300 + 11 * i] for i in range(4)]
    params = types.SamplingParams(max_tokens=4, temperature=1.0, top_k=4, stop=[])  # stop=[]: always 4 tokens
    history = []
    for _ in range(6):
        smp = tc.save_weights_and_get_sampling_client().result()
        futures = [smp.sample(types.ModelInput.from_ints(p), 8, params) for p in prompts]
        data, rewards = [], []
        for p, fut in zip(prompts, futures):
            seqs = fut.result().sequences
            r = np.array([np.mean(np.asarray(s.tokens) < half) for s in seqs])
            rewards.extend(r)
            for s, adv in zip(seqs, r - r.mean()):
                n = len(p) - 1
                data.append(datum(p + list(s.tokens[:-1]), target_tokens=[0] * n + list(s.tokens),
                                  logprobs=[0.0] * n + list(s.logprobs), advantages=[0.0] * n + [adv] * len(s.tokens)))
        history.append(float(np.mean(rewards)))
        assert np.isfinite(tc.forward_backward(data, "importance_sampling").result().metrics["loss:sum"])
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert np.mean(history[-2:]) > history[0] + 0.2, history


def test_a_billion_samples_is_refused_at_once_and_the_server_serves_on(sc):
    """num_samples=10**9 got no answer and drove the server into MemoryError before; now the request
    fails alone, naming the field and serve.max_num_samples, and the next request is served."""
    import time

    types = _types()
    base = sc.create_sampling_client(base_model=MODEL_NAME).result()
    prompt = types.ModelInput.from_ints([1, 400, 500, 600])
    t0 = time.monotonic()
    with pytest.raises(Exception, match=r"num_samples=1000000000 must be in \[1, 128\] \(serve.max_num_samples\)"):
        base.sample(prompt, 10 ** 9, types.SamplingParams(max_tokens=2, temperature=0.0)).result()
    assert time.monotonic() - t0 < 30
    assert len(base.sample(prompt, 2, types.SamplingParams(max_tokens=2)).result().sequences) == 2


def test_provenance_spans_are_checked_against_what_was_sampled(sc, server):
    """A datum built from a sample with its provenance (prompt span + sampled span, the way the
    SDK's Datum.with_provenance takes them) trains; the same claim on a changed token, an unknown
    sequence, a run past the sequence, or a sequence of another session fails that request
    naming the datum and span; the client trains on."""
    import tinker

    types = _types()
    tc = sc.create_lora_training_client(MODEL_NAME, rank=4, seed=4).result()
    smp = tc.save_weights_and_get_sampling_client().result()
    prompt = [1, 410, 420, 430]
    seq = smp.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=5, temperature=1.0)) \
        .result().sequences[0]
    sid, toks = seq.sequence_id, list(seq.tokens)
    P, S = types.PromptProvenanceSpan, types.SampledProvenanceSpan

    def claim(tokens=None, target_span=None, input_spans=None):
        tokens = list(tokens or prompt + toks[:-1])
        d = datum(tokens, target_tokens=prompt[1:] + toks, weights=[0.0] * 3 + [1.0] * 5)
        return d.with_provenance(
            model_input=input_spans or [P(sequence_id=sid, length=4), S(sequence_id=sid, length=4)],
            loss_fn_inputs=target_span or [P(sequence_id=sid, offset=1, length=3), S(sequence_id=sid, length=5)])

    assert np.isfinite(tc.forward_backward([claim()], "cross_entropy").result().metrics["loss:sum"])
    changed = prompt + toks[:-1]
    changed[5] = (changed[5] + 1) % 1000 + 3
    with pytest.raises(tinker.RequestFailedError, match=rf"datum 0: model_input_spans\[1\]: position 5 holds token "
                                                        rf"{changed[5]}, but sampled token 1 of '{sid}' is {toks[1]}"):
        tc.forward_backward([claim(tokens=changed)], "cross_entropy").result()
    with pytest.raises(tinker.RequestFailedError, match=r"datum 1: loss_fn_input_spans\[0\] names sequence_id "
                                                        r"'nope', which this server did not sample"):
        tc.forward_backward([claim(), claim(target_span=[P(sequence_id="nope", length=3),
                                                         S(sequence_id=sid, length=5)])], "cross_entropy").result()
    with pytest.raises(tinker.RequestFailedError, match=r"prompt tokens \[2, 5\) of .* run past its 4 prompt tokens"):
        tc.forward_backward([claim(target_span=[P(sequence_id=sid, offset=2, length=3),
                                                S(sequence_id=sid, length=5)])], "cross_entropy").result()
    other = service_client(server.url)
    try:
        foreign = other.create_lora_training_client(MODEL_NAME, rank=4, seed=4).result()
        with pytest.raises(tinker.RequestFailedError, match=rf"names sequence_id '{sid}', sampled in another session"):
            foreign.forward_backward([claim()], "cross_entropy").result()
    finally:
        other.close("success").result()
    assert np.isfinite(tc.forward_backward([claim()], "cross_entropy").result().metrics["loss:sum"])

