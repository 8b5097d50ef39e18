"""The critic of PPO with GAE: the policy's HF backbone plus a scalar value head, on its own
DeepSpeed engine (ZeRO 0-3) with its own optimizer, so the value loss can only ever move the
critic and the policy loss only the actor.

Values are aligned like the actor's log-probs (dsrl.loss.types): column t of a microbatch's
[B, T-1] values is V(tokens 0..t), the state from which target token t+1 is generated, read from
the backbone's hidden state at position t. The critic packs like the actor
(dsrl.stages.critic): shared-prompt microbatches (dsrl.actor.shared_prompt; decided for the
critic's own model by critic.shared_prompt, null = actor.shared_prompt) are forwarded with their
4-D mask and position ids, the value head runs on the kept positions and the response-aligned
[B, R] values are gathered through `logit_index`, exactly where the actor reads its logits.

Gradient scaling follows the actor (dsrl.actor.engine): value losses return Aggregator partial
sums, `backward` multiplies by the DP world size to undo DeepSpeed's averaging, GAS=1 with a
manual accumulation boundary, so the gradient is that of the global value loss whatever the
microbatch or rank split."""
from __future__ import annotations

from typing import Callable, Iterable, List, Mapping, Optional

import torch

from dsrl.actor.block_attention import BLOCKS_KEY, attention_by_blocks, blocks_pay_off
from dsrl.actor.device import to_device
from dsrl.actor.engine import _DTYPES, DeepSpeedModel, build_ds_config, init_distributed, load_pretrained
from dsrl.actor.optim import adamw, skip_single_rank_allreduce
from dsrl.actor.shared_prompt import additive_mask, is_shared_prompt_batch
from dsrl.loss.types import Reduction
from dsrl.loss.value import ValueLoss, ValueLossInputs, finish_value_metrics, get_value_loss

_DS_TAG = "critic"  # sub-folder of a dsrl checkpoint holding the critic's DeepSpeed files
VALUE_HEAD_SEED = 1234  # the fresh head is the same on every rank and for every ZeRO stage


class ValueModel(torch.nn.Module):
    """An HF base model (no LM head) and a linear head from the last hidden state to one value."""

    def __init__(self, backbone: torch.nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.value_head = torch.nn.Linear(hidden_size, 1)

    def forward(self, input_ids, attention_mask, position_ids=None, keep: int = 0, **attention_kwargs) -> torch.Tensor:
        """[B, T] float32 values (the last `keep` positions when keep > 0); `attention_kwargs` reach
        the attention layers (a shared-prompt batch's blocks, dsrl.actor.block_attention)."""
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False, **attention_kwargs)
        hidden = out.last_hidden_state
        if keep:
            hidden = hidden[:, -keep:]
        return self.value_head(hidden).squeeze(-1).float()


def _fresh_head(head: torch.nn.Linear, hidden_size: int) -> None:
    """N(0, 1/(hidden+1)) weights (small initial values, as OpenRLHF's critic), zero bias, from a
    fixed seed."""
    g = torch.Generator().manual_seed(VALUE_HEAD_SEED)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=g) / (hidden_size + 1))
        head.bias.zero_()


class CriticEngine(DeepSpeedModel):
    """A DeepSpeed-wrapped value model: `values` (forward-only) and `train_step` (value loss ->
    backward -> optimizer step)."""

    ds_tag = _DS_TAG
    checkpoint_name = "critic"
    role = "critic"  # engine_uses_shared_prompt: critic.shared_prompt decides this engine's layout

    def __init__(self, model_path: str, *, zero_stage: int = 0, dtype: str = "float32",
                 attn_implementation: str = "eager", lr: float = 1e-5, betas: Iterable[float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, grad_clip: float = 1.0, micro_batch_size: int = 8,
                 gradient_checkpointing: bool = False, persistence_threshold: int = 10000,
                 node_local_checkpoints: bool = False):
        import deepspeed
        from transformers import AutoConfig, AutoModel

        init_distributed()
        self.zero_stage = int(zero_stage)
        self._nonfinite_loss = False
        self.last_step_skipped = False
        ds_config = build_ds_config(zero_stage, micro_batch_size, dtype=dtype, grad_clip=grad_clip,
                                    persistence_threshold=persistence_threshold,
                                    node_local_storage=node_local_checkpoints)
        self.ds_config = ds_config
        hf_config = AutoConfig.from_pretrained(model_path)
        # AutoModel on a causal-LM folder loads the base model and leaves the LM head out.
        backbone = load_pretrained(AutoModel, model_path, ds_config, zero_stage, config=hf_config,
                                   dtype=_DTYPES[dtype], attn_implementation=attn_implementation)
        if gradient_checkpointing:
            backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.hf_config = backbone.config  # the loaded model's (attention implementation resolved)
        hidden = int(hf_config.hidden_size)
        model = ValueModel(backbone, hidden)
        model.value_head.to(_DTYPES[dtype])
        _fresh_head(model.value_head, hidden)  # a plain parameter: DeepSpeed partitions it under ZeRO-3
        model.train()
        optimizer = adamw(model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        skip_single_rank_allreduce(self.engine)

    # ------------------------------------------------------------------ forward
    def _values(self, mb: Mapping) -> torch.Tensor:
        """Values at every target column: [B, T-1] (dense layout) or [B, R] (shared-prompt)."""
        if not is_shared_prompt_batch(mb):
            return self.engine(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"])[:, :-1]
        dtype = self.module.backbone.get_input_embeddings().weight.dtype
        with attention_by_blocks(self.module.backbone, blocks_pay_off(mb)) as by_blocks:
            blocks = {"dsrl_blocks": mb[BLOCKS_KEY]} if by_blocks else {}
            v = self.engine(input_ids=mb["input_ids"], attention_mask=additive_mask(mb["attention_mask"], dtype),
                            position_ids=mb["position_ids"], keep=int(mb["logits_to_keep"]), **blocks)
        index = mb["logit_index"].to(v.device)
        return v.reshape(-1).index_select(0, index.reshape(-1)).view(index.shape)

    def values(self, microbatches: Iterable[Mapping], *, progress=None) -> List[torch.Tensor]:
        """Forward-only values of each microbatch (0 off the loss mask), on the host: the `values`
        GAE reads and the `old_values` the clipped value loss keeps V near."""
        return self._forward_only(microbatches, self._values, progress)

    # ------------------------------------------------------------------ training
    def forward_backward(self, mb: Mapping, loss_fn: ValueLoss, config: Mapping, reduction: Reduction, *,
                         is_last: bool = True):
        """One microbatch: values, value loss (fixed inputs: returns, old_values), backward; the
        reducer is built from the loss mask on this engine's device."""
        mb = to_device(mb, self.engine.device)
        reduce = reduction.build(mb["loss_mask"])
        v = self._values(mb)
        fixed = {k: mb[k] for k in ("returns", "old_values") if k in mb}
        out = loss_fn(ValueLossInputs(values=v, mask=mb["loss_mask"], batch=fixed, config=config, reduce=reduce))
        self._nonfinite_loss |= not bool(torch.isfinite(out.loss.detach()).all())
        self.engine.set_gradient_accumulation_boundary(bool(is_last))
        self.engine.backward(out.loss * float(self.dp_world_size), scale_wrt_gas=False)
        return out

    def train_step(self, microbatches: List[Mapping], config: Mapping,
                   reduction: Reduction, *, loss: str = "clipped") -> dict:
        """One critic optimizer step over this rank's microbatches (every rank the same number:
        pad with empty ones, as the actor's). `reduction`: the mode and the step's global counts,
        from which each microbatch's reducer is built on this engine's device. Returns global metrics (collective): critic/value_loss,
        critic/value_clipfrac, critic/explained_variance, critic/values, critic/returns,
        critic/grad_norm."""
        from dsrl.distributed.collectives import all_reduce_sum

        loss_fn = get_value_loss(loss)
        sums: dict = {}
        for i, mb in enumerate(microbatches):
            out = self.forward_backward(mb, loss_fn, config, reduction, is_last=i == len(microbatches) - 1)
            for name, value in out.metrics.items():
                sums[name] = sums.get(name, 0.0) + float(value)
        grad_norm = self.optimizer_step()
        names = sorted(sums)
        metrics = finish_value_metrics(dict(zip(names, all_reduce_sum([sums[n] for n in names]))))
        metrics["critic/grad_norm"] = grad_norm
        return metrics

    # optimizer_step, save_checkpoint (into `folder`/critic), load_checkpoint and full_parameters:
    # DeepSpeedModel's.


def critic_model_path(cfg, model_path: str, resolve_path: Callable[[str], str] = str) -> Optional[str]:
    """The critic's backbone folder (critic.path after `resolve_path`, else the actor's
    `model_path`), or None when algo.advantage_estimator reads no values (no critic is built)."""
    from dsrl.loss.registry import get_advantage_estimator

    if not getattr(get_advantage_estimator(cfg.algo.advantage_estimator), "needs_values", False):
        return None
    return resolve_path(cfg.critic.path) if cfg.critic.path else model_path


def build_critic(cfg, model_path: str, *, dtype: str, attn_implementation: str,
                 resolve_path: Callable[[str], str] = str) -> Optional[CriticEngine]:
    """The critic of `cfg` (Config), or None when algo.advantage_estimator reads no values.
    `model_path`/`dtype`/`attn_implementation`: the actor's resolved ones; critic.path, when set,
    overrides the path after `resolve_path` (dsrl.main: a model name such as smollm2 -> its folder)."""
    path = critic_model_path(cfg, model_path, resolve_path)
    if path is None:
        return None
    c, a = cfg.critic, cfg.actor
    return CriticEngine(path, zero_stage=a.zero_stage if c.zero_stage is None else c.zero_stage,
                        dtype=dtype, attn_implementation=attn_implementation, lr=c.lr, betas=a.betas, eps=a.eps,
                        weight_decay=c.weight_decay, grad_clip=c.grad_clip,
                        micro_batch_size=c.micro_batch_size or a.micro_batch_size,
                        gradient_checkpointing=c.gradient_checkpointing,
                        persistence_threshold=a.stage3_param_persistence_threshold,
                        node_local_checkpoints=cfg.trainer.checkpoint_storage == "node_local")
