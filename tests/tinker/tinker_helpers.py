"""A tiny random Llama checkpoint for the Tinker work-unit tests (built on the fly, no hub)."""
from __future__ import annotations

import os


def build_tiny_llama(out_dir: str, seed: int = 0) -> str:
    """Write a random-init Llama (vocab 1024, hidden 128, 4 heads, 2 layers, intermediate 256)
    to `out_dir` (fp32 safetensors) and return the path. Idempotent."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    cfg = LlamaConfig(vocab_size=1024, hidden_size=128, num_attention_heads=4, num_key_value_heads=4,
                      num_hidden_layers=2, intermediate_size=256, max_position_embeddings=256,
                      tie_word_embeddings=False, attention_dropout=0.0, pad_token_id=None,
                      bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    # Larger-than-default init so log-probs and their gradients are far from uniform.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(out_dir)
    return out_dir


class PlainEngine:
    """A minimal stand-in for ActorEngine (same forward_backward contract, plain autograd, no
    DeepSpeed) for fast TrainingSession tests. `calls` counts forwards."""

    def __init__(self, model):
        self.model = model
        self.hf_config = model.config
        self.calls = 0

    def forward_backward(self, mb, objective, config, reduction, *, is_last=True, forward_only=False, **_):
        import contextlib

        import torch

        from dsrl.actor.logprobs import token_logprobs
        from dsrl.loss.types import LossInputs

        self.calls += 1
        ctx = torch.no_grad() if forward_only else contextlib.nullcontext()
        with ctx:
            logits = self.model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits[:, :-1]
            lp, _ = token_logprobs(logits, mb["targets"])
            fixed = {k: v for k, v in mb.items() if k not in ("input_ids", "attention_mask", "targets")}
            out = objective.fn(LossInputs(log_probs=lp, mask=mb["loss_mask"], batch=fixed, config=config,
                                          reduce=reduction.build(mb["loss_mask"]), sample_indices=mb.get("sample_indices")))
        if not forward_only:
            out.loss.backward()
        return out


class NoForwardEngine:
    """Has a vocab size but fails on any forward: validation must happen first."""

    class _Cfg:
        vocab_size = 1024

    hf_config = _Cfg()

    def forward_backward(self, *a, **k):
        raise AssertionError("forward ran before validation finished")


def load_plain(path):
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    m.train()
    return m


def reference_loss(model, datums, loss_fn, config=None):
    """Autograd reference: the summed Tinker loss of `datums` on a plain HF model, one datum at
    a time (no padding), written directly from the protocol formulas."""
    import torch

    cfg = {"ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
           "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
           "dro": {"beta": 0.05}}.get(loss_fn, {})
    cfg.update(config or {})
    total = 0.0
    lps = []
    for d in datums:
        ids = torch.as_tensor(d.model_input, dtype=torch.long)[None]
        logits = model(input_ids=ids).logits[0].float()
        tgt = torch.as_tensor(d.loss_fn_inputs["target_tokens"], dtype=torch.long)
        lp = torch.log_softmax(logits, -1).gather(-1, tgt[:, None])[:, 0]
        lps.append(lp.detach())
        f = {k: torch.as_tensor(v, dtype=torch.float32) for k, v in d.loss_fn_inputs.items() if k != "target_tokens"}
        if loss_fn == "cross_entropy":
            tok = -f["weights"] * lp
        else:
            q, A = f["logprobs"], f["advantages"]
            r = torch.exp(lp - q)
            if loss_fn == "importance_sampling":
                tok = -r * A
            elif loss_fn == "ppo":
                tok = -torch.minimum(r * A, torch.clamp(r, cfg["clip_low_threshold"], cfg["clip_high_threshold"]) * A)
            elif loss_fn == "cispo":
                tok = -torch.clamp(r, cfg["clip_low_threshold"], cfg["clip_high_threshold"]).detach() * lp * A
            else:
                tok = -(lp * A - 0.5 * cfg["beta"] * (lp - q) ** 2)
        total = total + tok.sum()
    return total, lps


def random_datums(n, loss_fn, seed=0, vocab=1024, min_len=3, max_len=9):
    """Random datums with explicit targets that differ from the next input token."""
    import torch

    from dsrl.actor.work_units import Datum

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        N = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        toks = torch.randint(3, vocab, (N,), generator=g).tolist()
        inp = {"target_tokens": torch.randint(3, vocab, (N,), generator=g).tolist()}
        if loss_fn == "cross_entropy":
            inp["weights"] = (torch.rand(N, generator=g) * 2 - 0.5).tolist()
        else:
            inp["logprobs"] = (-torch.rand(N, generator=g) * 8 - 4).tolist()
            inp["advantages"] = torch.randn(N, generator=g).tolist()
        out.append(Datum(model_input=toks, loss_fn_inputs=inp))
    return out


def full_grads(actor):
    """Full accumulated gradient of every parameter of an ActorEngine (closes the accumulation
    window first, as optim_step would; collective under ZeRO)."""
    from deepspeed.utils import safe_get_full_grad

    actor._close_accumulation_window()
    out = {}
    for n, p in actor.module.named_parameters():
        g = safe_get_full_grad(p)
        out[n] = None if g is None else g.detach().float().clone().reshape(p.ds_shape if hasattr(p, "ds_shape") else p.shape)
    return out


def full_params(actor):
    with actor.full_parameters():
        return {n: p.detach().float().clone() for n, p in actor.module.named_parameters()}


def two_rank_worker(rank, world, port, model_path, out_dir, stages, split):
    """Each rank gets its share of the datums; rank 0 saves the full gradient per ZeRO stage."""
    import os

    import torch

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    from dsrl.actor.engine import ActorEngine
    from dsrl.actor.work_units import AdamParams, TrainingSession

    data = random_datums(5, "ppo", seed=21)
    mine = data[:split] if rank == 0 else data[split:]
    for stage in stages:
        actor = ActorEngine(model_path, zero_stage=stage, persistence_threshold=0, micro_batch_size=2, grad_clip=0.0)
        sess = TrainingSession(actor, micro_batch_size=2)
        res = sess.forward_backward(mine, "ppo")
        g = full_grads(actor)
        if rank == 0:
            torch.save({"grads": g, "loss": res.metrics["loss:sum"], "n_out": len(res.loss_fn_outputs)},
                       os.path.join(out_dir, f"zero{stage}.pt"))
        # optim_step on both ranks: every rank must end with the same full parameters.
        before = full_params(actor)
        sess.optim_step(AdamParams(learning_rate=1e-3))
        after = full_params(actor)
        torch.save({"before": before, "after": after}, os.path.join(out_dir, f"params_zero{stage}_rank{rank}.pt"))
        torch.distributed.barrier()
        del sess, actor
