"""rollout.backend=hf (dsrl.rollout.hf_worker): sampling log-probs against an independent HF
forward, seeds, eos, nucleus, weight sharing and pushes, on the tiny random Llama in fp32."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from dsrl.rollout.hf_worker import HFWorker, nucleus_logits

PROMPTS = [[1, 17, 250, 31, 9], [1, 44, 45, 46]]


@pytest.fixture(scope="module")
def worker(tiny_model_path):
    torch.set_num_threads(2)
    return HFWorker(str(tiny_model_path), dtype="float32", device="cpu", seed=3)


@pytest.fixture(scope="module")
def reference(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32).eval()


def _reference_logprobs(model, prompt, tokens, temperature, top_p=1.0):
    """Full-sequence forward (no cache) of prompt + tokens; the log-prob of each sampled token
    under logits / T, over the top-p nucleus."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1: -1].float() / temperature
    if top_p < 1.0:
        logits = nucleus_logits(logits, top_p)
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampling_logprobs_equal_an_independent_forward(worker, reference, temperature):
    groups = worker.generate(PROMPTS, n=3, temperature=temperature, top_p=1.0, max_tokens=7, seeds=[11, 12 << 16])
    assert [len(g) for g in groups] == [3, 3]
    for prompt, group in zip(PROMPTS, groups):
        for c in group:
            assert len(c.token_ids) == len(c.logprobs) >= 1
            ref = _reference_logprobs(reference, prompt, c.token_ids, temperature)
            torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=2e-5, rtol=0)
            assert c.finish_reason in ("stop", "length")
            assert c.finish_reason == "length" or c.token_ids[-1] in worker.eos_token_ids


def test_top_p_logprobs_are_over_the_renormalized_nucleus(worker, reference):
    groups = worker.generate(PROMPTS[:1], n=4, temperature=1.0, top_p=0.5, max_tokens=5, seeds=[5])
    for c in groups[0]:
        ref = _reference_logprobs(reference, PROMPTS[0], c.token_ids, 1.0, top_p=0.5)
        torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=2e-5, rtol=0)


def test_nucleus_by_hand():
    # probabilities 0.5, 0.3, 0.15, 0.05 (logits = log p), in scrambled order
    p = torch.tensor([[0.15, 0.5, 0.05, 0.3]])
    logits = p.log()
    keep = torch.isfinite(nucleus_logits(logits, 0.7))
    assert keep.tolist() == [[False, True, False, True]]  # 0.5 < 0.7, 0.5 + 0.3 reaches it
    assert torch.isfinite(nucleus_logits(logits, 0.8)).tolist() == [[False, True, False, True]]
    assert torch.isfinite(nucleus_logits(logits, 0.81)).tolist() == [[True, True, False, True]]
    assert torch.isfinite(nucleus_logits(logits, 0.1)).tolist() == [[False, True, False, False]]
    assert torch.equal(nucleus_logits(logits, 1.0), logits)


def test_seeds_make_sampling_reproducible_and_batch_independent(worker):
    kw = dict(temperature=1.0, top_p=1.0, max_tokens=6)
    a = worker.generate(PROMPTS, n=2, seeds=[100, 200], **kw)
    b = worker.generate(PROMPTS, n=2, seeds=[100, 200], **kw)
    assert [[c.token_ids for c in g] for g in a] == [[c.token_ids for c in g] for g in b]
    assert [[c.logprobs for c in g] for g in a] == [[c.logprobs for c in g] for g in b]
    # sample k of seed s is sample 0 of seed s + k (vLLM's convention), whatever the batch
    alone = worker.generate(PROMPTS[1:], n=1, seeds=[201], **kw)[0][0]
    # another batch shape: ids equal (a flip needs a draw within round-off of a boundary), log-probs to fp32
    assert alone.token_ids == a[1][1].token_ids
    torch.testing.assert_close(torch.tensor(alone.logprobs), torch.tensor(a[1][1].logprobs), atol=1e-5, rtol=0)
    other = worker.generate(PROMPTS, n=2, seeds=[101, 299], **kw)
    assert [[c.token_ids for c in g] for g in other] != [[c.token_ids for c in g] for g in a]


def test_stops_at_eos_and_reports_length_otherwise(tiny_model_path, worker):
    first = worker.generate(PROMPTS[:1], n=1, temperature=0.0, top_p=1.0, max_tokens=3)[0][0]
    assert len(first.token_ids) == 3 and first.finish_reason == "length" and first.logprobs == []
    eos = first.token_ids[0]  # make the greedy first token the end of sequence
    stopper = HFWorker(str(tiny_model_path), module=worker.module, eos_token_ids=[eos], tokenizer=worker.tokenizer)
    c = stopper.generate(PROMPTS[:1], n=2, temperature=0.0, top_p=1.0, max_tokens=5)[0]
    assert [x.token_ids for x in c] == [[eos], [eos]] and {x.finish_reason for x in c} == {"stop"}
    assert c[0].text == worker.tokenizer.decode([eos], skip_special_tokens=True)


def test_shared_module_uses_live_weights_and_push_is_a_noop(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32)
    model.train()
    w = HFWorker(str(tiny_model_path), module=model)
    before = w.generate(PROMPTS[:1], n=1, temperature=0.0, top_p=1.0, max_tokens=4)[0][0].token_ids
    assert model.training  # the train/eval mode is restored
    assert w.push_weights({"anything": torch.zeros(1)}, 1) >= 0.0
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)  # tied to the embedding: a different model
    after = w.generate(PROMPTS[:1], n=1, temperature=0.0, top_p=1.0, max_tokens=4)[0][0].token_ids
    assert after != before


def test_own_copy_takes_pushed_weights(tiny_model_path, reference):
    w = HFWorker(str(tiny_model_path), dtype="float32", device="cpu")
    state = {k: v + 0.01 * torch.randn_like(v) for k, v in reference.state_dict().items() if k != "lm_head.weight"}
    w.push_weights(state, 3)
    got = w.module.state_dict()
    for k, v in state.items():
        assert torch.equal(got[k], v), k
    assert torch.equal(got["lm_head.weight"], state["model.embed_tokens.weight"])  # tied
    with pytest.raises(RuntimeError, match="step 4"):
        w.push_weights({"model.nope": torch.zeros(1)}, 4)


def test_bad_requests_are_named(worker):
    with pytest.raises(ValueError, match="1 seeds for 2 prompts"):
        worker.generate(PROMPTS, n=1, temperature=1.0, top_p=1.0, max_tokens=2, seeds=[1])
    with pytest.raises(ValueError, match="prompt 1 has 600 tokens"):
        worker.generate([[1, 2], [5] * 600], n=1, temperature=1.0, top_p=1.0, max_tokens=2)
    with pytest.raises(ValueError, match="top_p"):
        worker.generate(PROMPTS, n=1, temperature=1.0, top_p=0.0, max_tokens=2)


def test_own_copy_takes_weight_buckets_and_probes_like_an_independent_forward(tiny_model_path, reference):
    from dsrl.rollout.buckets import pack_buckets

    w = HFWorker(str(tiny_model_path), dtype="float32", device="cpu")
    state = {k: v + 0.01 * torch.randn_like(v) for k, v in reference.state_dict().items() if k != "lm_head.weight"}
    buckets = list(pack_buckets(state.items(), 64 << 10))
    assert len(buckets) > 2  # several buckets, some parameters larger than one
    w.push_weights(buckets, 5)
    got = w.module.state_dict()
    assert all(torch.equal(got[k], v) for k, v in state.items())
    with pytest.raises(RuntimeError, match="missing"):
        w.push_weights(buckets[:1], 6)  # a partial push must not pass silently
    seqs = [[1, 5, 9, 33], [2, 7, 7]]
    probe = w.probe_logprobs(seqs)
    ref_model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32).eval()
    ref_model.load_state_dict(state, strict=False)
    for seq, lps in zip(seqs, probe):
        ref = _reference_logprobs(ref_model, seq[:1], seq[1:], 1.0)
        torch.testing.assert_close(torch.tensor(lps), ref, atol=1e-5, rtol=0)
