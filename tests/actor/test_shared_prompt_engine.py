"""Shared-prompt forward on the real DeepSpeed engine (tiny Llama, float32), ZeRO 0 and 3: loss,
entropy, parameter gradient and the AdamW update equal the dense path to float tolerance, with
groups of unequal response lengths and groups split across microbatches; the training forward's
log-probs equal the standalone scoring pass bit-exactly (so log-prob reuse stays exact); and the
Trainer wires the layout (actor.shared_prompt) into scoring and training."""
import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch

from dsrl.actor.batch import masked_rows
from dsrl.loss.registry import get_objective
from dsrl.loss.types import Reduction
from dsrl.rollout.samples import pack_microbatches

pytestmark = pytest.mark.slow

_spec = importlib.util.spec_from_file_location("_real_engine_for_shared_prompt",
                                               Path(__file__).parents[1] / "trainer" / "_real_engine.py")
rt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rt)

# Three groups of three responses of unequal lengths (1-9 tokens); rewards give every group signal.
REWARDS = [[1, 0, 0], [1, 1, 0], [0, 1, 0]]
# Measured float32 agreement here is ~2e-6 (log-probs) and ~1e-6 relative (gradients).
LP_TOL = 2e-5
GRAD_REL_TOL = 1e-4


def _advantages(samples):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(len(s.response_ids), generator=g) for s in samples]


def _run(model_path, samples, pad, *, zero_stage, shared, micro_batch_size=4):
    """Every microbatch forward/backward (PPO, ratio 1: old = detached training log-probs,
    token-mean over all tokens), then the optimizer step. Returns loss, entropy sum, per-sample
    log-probs, full gradients and the parameter update."""
    from deepspeed.utils import safe_get_full_grad

    eng = rt.build_engine(model_path, zero_stage=zero_stage, micro_batch_size=micro_batch_size)
    before = rt.params(eng)
    mbs = pack_microbatches(samples, micro_batch_size, pad, {"advantages": _advantages(samples)},
                            shared_prompt=shared)
    tokens = float(sum(len(s.response_ids) for s in samples))
    loss, ent = 0.0, 0.0
    for i, mb in enumerate(mbs):
        reduce = Reduction("token-mean", global_tokens=tokens)
        out = eng.forward_backward(mb, get_objective("ppo"), {}, reduce, reuse_training_logprobs=True,
                                   is_last=i == len(mbs) - 1)
        loss += float(out.loss.detach())
        ent += float(out.metrics["entropy"])
    grads = {n: safe_get_full_grad(p).clone() for n, p in eng.module.named_parameters()}
    eng.optimizer_step()
    after = rt.params(eng)
    lps = []
    for mb, lp in zip(mbs, eng.score(mbs)):
        lps.extend(masked_rows(lp, mb["loss_mask"]))
    return {"loss": loss, "entropy": ent, "grads": grads, "update": rt.update(before, after), "lps": lps,
            "n_mb": len(mbs), "rows": sum(mb["input_ids"].shape[0] for mb in mbs)}


@pytest.fixture(scope="module")
def samples(tiny_tokenizer):
    return rt.make_samples(tiny_tokenizer, REWARDS)


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_shared_prompt_equals_dense(tiny_model_path, tiny_tokenizer, samples, zero_stage):
    pad = tiny_tokenizer.pad_token_id
    assert len({len(s.response_ids) for s in samples}) > 3  # unequal response lengths
    dense = _run(tiny_model_path, samples, pad, zero_stage=zero_stage, shared=False)
    shared = _run(tiny_model_path, samples, pad, zero_stage=zero_stage, shared=True)
    # micro_batch_size 4 over 3 groups of 3: groups 1 and 2 are split across microbatches,
    # so 3 microbatches hold 5 packed rows (dense: 9 rows).
    assert (shared["n_mb"], shared["rows"], dense["rows"]) == (3, 5, 9)
    _assert_equal_dense(shared, dense)


def _assert_equal_dense(shared, dense):
    """Loss, entropy, per-sample log-probs, gradients and the update of a shared-prompt run equal
    the dense run's to float tolerance."""
    assert shared["loss"] == pytest.approx(dense["loss"], rel=1e-5, abs=1e-7)
    assert shared["entropy"] == pytest.approx(dense["entropy"], rel=1e-5)
    for a, b in zip(shared["lps"], dense["lps"], strict=True):
        assert a.shape == b.shape
        assert float((a - b).abs().max()) <= LP_TOL
    gscale = max(float(g.abs().max()) for g in dense["grads"].values())
    assert gscale > 0
    for n, g in dense["grads"].items():
        assert float((shared["grads"][n] - g).abs().max()) <= GRAD_REL_TOL * gscale, n
    uscale = max(float(u.abs().max()) for u in dense["update"].values())
    assert uscale > 1e-3  # a real step (update ~ -0.1 * gradient: see _real_engine)
    for n, u in dense["update"].items():
        assert float((shared["update"][n] - u).abs().max()) <= GRAD_REL_TOL * uscale, n


def test_runs_sharing_a_row_equal_dense(tiny_model_path, tiny_tokenizer, samples):
    """A whole group plus one sample of each other group: the two short runs share a row
    (dsrl.actor.shared_prompt.pack_rows) as blocks on its diagonal; loss, log-probs, gradient and
    update still equal the dense path (ZeRO-0)."""
    from dsrl.actor.shared_prompt import prompt_runs

    pad = tiny_tokenizer.pad_token_id
    subset = [samples[i] for i in (0, 1, 2, 3, 6)]
    dense = _run(tiny_model_path, subset, pad, zero_stage=0, shared=False, micro_batch_size=5)
    shared = _run(tiny_model_path, subset, pad, zero_stage=0, shared=True, micro_batch_size=5)
    assert (len(prompt_runs(subset)), shared["n_mb"], shared["rows"]) == (3, 1, 2)  # 3 runs in 2 rows
    assert shared["loss"] == pytest.approx(dense["loss"], rel=1e-5, abs=1e-7)
    for a, b in zip(shared["lps"], dense["lps"], strict=True):
        assert float((a - b).abs().max()) <= LP_TOL
    gscale = max(float(g.abs().max()) for g in dense["grads"].values())
    for n, g in dense["grads"].items():
        assert float((shared["grads"][n] - g).abs().max()) <= GRAD_REL_TOL * gscale, n
    uscale = max(float(u.abs().max()) for u in dense["update"].values())
    for n, u in dense["update"].items():
        assert float((shared["update"][n] - u).abs().max()) <= GRAD_REL_TOL * uscale, n


def test_training_forward_equals_scoring_pass_bit_exactly(tiny_model_path, tiny_tokenizer, samples):
    """Reuse stays exact: the training forward (train mode, autograd on) and the standalone
    pass (eval, no grad) give identical log-probs; the reuse and old-pass paths give identical
    loss, gradients and update."""
    from deepspeed.utils import safe_get_full_grad

    pad = tiny_tokenizer.pad_token_id
    results = []
    for reuse in (False, True):
        eng = rt.build_engine(tiny_model_path, micro_batch_size=4)
        (mb,) = pack_microbatches(samples[:5], 5, pad, {"advantages": _advantages(samples[:5])}, shared_prompt=True)
        train_lp, _ = eng.target_logprobs(mb, with_entropy=True)
        assert train_lp.requires_grad
        (scored,) = eng.score([mb])
        assert torch.equal(train_lp.detach() * mb["loss_mask"], scored)  # the same packed microbatch
        if not reuse:
            mb["old_log_probs"] = scored
        reduce = Reduction("token-mean", global_tokens=float(mb["loss_mask"].sum()))
        out = eng.forward_backward(mb, get_objective("ppo"), {}, reduce, reuse_training_logprobs=reuse)
        grads = [safe_get_full_grad(p).clone() for p in eng.module.parameters()]
        eng.optimizer_step()
        results.append((out, grads, rt.params(eng)))
    (a, ga, pa), (b, gb, pb) = results
    assert torch.equal(a.loss, b.loss)
    assert float(a.metrics["ppo_kl"]) == 0.0  # ratio exactly 1 on the old-pass path too
    assert all(torch.equal(x, y) for x, y in zip(ga, gb))
    rt.assert_params_equal(pa, pb)


def test_trainer_uses_the_layout_for_old_pass_and_training(tiny_model_path, tiny_tokenizer, samples, tmp_path):
    """train_on with actor.shared_prompt=on vs off (old-policy pass on, 4 samples per
    microbatch): the same update to float tolerance, fewer padded tokens, and `auto` picks on."""
    runs = {}
    for mode in ("off", "on", "auto"):
        cfg = rt.make_cfg(tiny_model_path, reuse_logprobs="off")
        cfg.actor = dataclasses.replace(cfg.actor, shared_prompt=mode)
        actor = rt.build_engine(tiny_model_path, micro_batch_size=4)
        before = rt.params(actor)
        trainer = rt.make_trainer(cfg, actor, tiny_tokenizer, tmp_path / mode, samples=samples)
        metrics = trainer.train_on(samples, 1)
        runs[mode] = (metrics, rt.update(before, rt.params(actor)), actor._shared_prompt_decision.on)
    (m_off, u_off, on_off), (m_on, u_on, on_on), (_, u_auto, on_auto) = runs["off"], runs["on"], runs["auto"]
    assert (on_off, on_on, on_auto) == (False, True, True)
    assert m_on["train/loss"] == pytest.approx(m_off["train/loss"], rel=1e-5, abs=1e-7)
    assert m_on["train/microbatches"] == m_off["train/microbatches"] == 3
    assert m_on["train/pad_fraction"] < m_off["train/pad_fraction"]
    scale = max(float(u.abs().max()) for u in u_off.values())
    for n, u in u_off.items():
        assert float((u_on[n] - u).abs().max()) <= GRAD_REL_TOL * scale, n
    rt.assert_params_equal(u_auto, u_on)  # auto == on, bit for bit (the same layout: the same shapes)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_sdpa_attention_takes_the_shared_prompt_mask(tiny_model_path, tiny_tokenizer, samples, device):
    """sdpa (the CUDA default) applies the same 4-D mask: scoring agrees with the dense layout."""
    from dsrl.actor.device import to_device
    from dsrl.actor.engine import ActorEngine

    torch.manual_seed(0)
    eng = ActorEngine(str(tiny_model_path), attn_implementation="sdpa", trainable=False, micro_batch_size=4)
    assert eng.hf_config._attn_implementation == "sdpa"
    pad = tiny_tokenizer.pad_token_id
    out = {}
    for shared in (False, True):
        mbs = [to_device(mb, device) for mb in pack_microbatches(samples, 4, pad, shared_prompt=shared)]
        out[shared] = [row.cpu() for mb, lp in zip(mbs, eng.score(mbs)) for row in masked_rows(lp, mb["loss_mask"])]
    for a, b in zip(out[True], out[False], strict=True):
        assert float((a - b).abs().max()) <= LP_TOL


def test_long_responses_attend_by_blocks_and_equal_dense(tiny_model_path, tiny_tokenizer, block_attention_calls):
    """Two groups of 8 responses of 24-30 tokens after 4- and 6-token prompts: the masked rows
    would compute >= 2x the score entries the blocks need, so the attention runs by blocks
    (dsrl.actor.block_attention, counted); loss, log-probs, gradient and update equal dense (ZeRO-0)."""
    from long_groups import long_group

    g = torch.Generator().manual_seed(5)
    samples = long_group(g, 4, 0, 0) + long_group(g, 6, 1, 8)
    pad = tiny_tokenizer.pad_token_id
    dense = _run(tiny_model_path, samples, pad, zero_stage=0, shared=False, micro_batch_size=8)
    assert not block_attention_calls
    shared = _run(tiny_model_path, samples, pad, zero_stage=0, shared=True, micro_batch_size=8)
    layers = 2  # the tiny Llama's decoder layers: 2 microbatches x (training forward + scoring pass)
    assert len(block_attention_calls) == 2 * 2 * layers
    _assert_equal_dense(shared, dense)
