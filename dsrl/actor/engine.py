"""The DeepSpeed actor: one HF causal LM wrapped in a ZeRO engine (stage 0-3).

It does three things: forward-only scoring of target tokens (old / reference / teacher passes),
the training microbatch (forward -> objective from the loss registry -> backward), and weight
export (full weights gathered under ZeRO-3) for the rollout push and the final checkpoint.
What it does alike with the critic (dsrl.actor.critic) lives in their base, `DeepSpeedModel`.

Gradient scaling: objectives return *partial sums* that add up across microbatches and ranks
to the global loss (see dsrl.loss.types.Aggregator; callers pass a `Reduction`, the counts,
and the engine builds the reducer on its device). DeepSpeed averages gradients over
data-parallel ranks, so `backward` multiplies the loss by the DP world size; gradient
accumulation is driven manually (`set_gradient_accumulation_boundary`) with GAS=1, so
DeepSpeed applies no 1/GAS factor. The parameter gradient is therefore exactly the gradient
of the global loss, whatever the microbatch or rank split."""
from __future__ import annotations

import contextlib
import os
from typing import Iterable, Mapping, Optional

import torch

from dsrl.actor.block_attention import BLOCKS_KEY, attention_by_blocks, blocks_pay_off
from dsrl.actor.device import to_device, to_host
from dsrl.actor.logprobs import token_logprobs
from dsrl.actor.nonfinite import guarded_step
from dsrl.actor.optim import adamw, skip_single_rank_allreduce
from dsrl.actor.shared_prompt import FORWARD_KEYS, additive_mask, head_rows, is_shared_prompt_batch
from dsrl.actor.stochastic import apply_dropout_knobs
from dsrl.distributed.ports import free_port
from dsrl.errors import ReuseInvariantError
from dsrl.loss.registry import ObjectiveSpec
from dsrl.loss.types import LossInputs, LossOutput, Reduction

_DS_TAG = "deepspeed"  # sub-folder of a dsrl checkpoint holding DeepSpeed's files
LORA_ADAPTER_DIR = "adapter"  # actor.lora: sub-folder of a saved HF folder holding the PEFT adapter
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def init_distributed(timeout_s: Optional[float] = None) -> None:
    """Initialise torch.distributed through DeepSpeed, once: the backend is DeepSpeed's
    accelerator's (nccl on CUDA; gloo on CPU, where DeepSpeed would name ccl). When the launch's
    ranks already met at MASTER_ADDR:MASTER_PORT to agree on the run folder
    (dsrl.distributed.run_dir), the process group is built on that same TCPStore (the port is
    taken), bound to cuda:LOCAL_RANK under NCCL as DeepSpeed itself does, and DeepSpeed wraps it.
    `timeout_s` (trainer.dist_timeout_s): the process group's timeout (None: DeepSpeed's default,
    30 min); a collective waiting longer for a rank fails."""
    import datetime

    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from dsrl.distributed.run_dir import take_store

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
    accel = get_accelerator()
    backend = "nccl" if accel.device_name() == "cuda" else "gloo"
    if accel.device_name() == "cuda":
        accel.set_device(int(os.environ["LOCAL_RANK"]))  # before any CUDA tensor of this rank
    from deepspeed.constants import default_pg_timeout

    timeout = datetime.timedelta(seconds=float(timeout_s)) if timeout_s else default_pg_timeout
    store = take_store()
    if store is not None:
        world = int(os.environ["WORLD_SIZE"])
        extra = {"device_id": accel.device(int(os.environ["LOCAL_RANK"]))} if backend == "nccl" and world > 1 else {}
        torch.distributed.init_process_group(backend, store=store, rank=int(os.environ["RANK"]), world_size=world,
                                             timeout=timeout, **extra)
    deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
    if backend == "gloo":
        _unlink_shm_allreduce_buffer()


def _unlink_shm_allreduce_buffer() -> None:
    """DeepSpeed's CPU backend, when every rank runs on this host (LOCAL_SIZE equals the world size,
    as its launcher sets), maps a 69 MB shared-memory buffer per rank for its shm allreduce, named
    /dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>, and never
    unlinks it: each such run left 69 MB per rank in /dev/shm, that is in memory, until the machine
    rebooted (11 GB on a 24 GB test machine after a day of suite runs). deepspeed.init_distributed
    returns on a rank only once it has mapped every other rank's buffer; after a barrier every rank
    has, so each unlinks its own name and the mappings stay valid until the ranks exit (a SIGKILLed
    run leaves nothing either)."""
    world = torch.distributed.get_world_size()
    if os.environ.get("LOCAL_SIZE") != str(world):  # DeepSpeed made no buffers (the same test on every rank)
        return
    from dsrl.distributed.shm_buffers import unlink_own_allreduce_buffer

    torch.distributed.barrier()
    unlink_own_allreduce_buffer(torch.distributed.get_rank())


def close_distributed() -> None:
    """End the default process group in step with the other ranks, before the interpreter exits.

    A process that leaves it to interpreter teardown can abort: gloo's worker threads still hold
    work objects whose release needs the (finalising) interpreter, and the rank dies with
    "terminate called without an active exception" (SIGABRT, exit -6) after its run succeeded,
    which a launcher reports as a failed run. So every rank that reached the same end (the last
    step, or a coordinated stop) waits at a barrier, which keeps rank 0, the host of the
    rendezvous store, alive until every peer is done with it, then destroys its group. Not for
    runs that failed: a peer may be gone, and a barrier would wait for it."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_world_size() > 1:
        dist.barrier()
    dist.destroy_process_group()


def build_ds_config(zero_stage: int, micro_batch_size: int, *, dtype: str = "float32",
                    grad_clip: float = 0.0, persistence_threshold: int = 10000,
                    node_local_storage: bool = False) -> dict:
    """DeepSpeed's config. `node_local_storage` (trainer.checkpoint_storage=node_local): the first
    rank of every node, not only rank 0, writes the non-partitioned checkpoint files, so each
    node's own disk holds what its ranks load."""
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    zero = {"stage": int(zero_stage)}
    if zero_stage == 3:
        zero.update(stage3_param_persistence_threshold=int(persistence_threshold),
                    stage3_gather_16bit_weights_on_model_save=False)
    return {
        "train_micro_batch_size_per_gpu": int(micro_batch_size),
        "gradient_accumulation_steps": 1,
        "train_batch_size": int(micro_batch_size) * world,
        "zero_optimization": zero,
        "gradient_clipping": float(grad_clip),
        "bf16": {"enabled": dtype == "bfloat16"},
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
        **({"checkpoint": {"use_node_local_storage": True}} if node_local_storage else {}),
    }


def load_pretrained(auto_class, model_path: str, ds_config: dict, zero_stage: int, **kwargs) -> torch.nn.Module:
    """``auto_class.from_pretrained(model_path, **kwargs)``, ZeRO-3 aware: transformers must
    know, so that it builds the model under zero.Init *and* loads the checkpoint into the
    partitioned parameters (a bare zero.Init context leaves every weight size-0 and the load
    fails). The HF flag is process-global: it is unset right after loading so a later
    non-ZeRO-3 engine in the same process is built normally."""
    hf_ds = None
    if zero_stage == 3:
        from transformers.integrations import HfDeepSpeedConfig

        hf_ds = HfDeepSpeedConfig(ds_config)
    try:
        return auto_class.from_pretrained(model_path, **kwargs)
    finally:
        if hf_ds is not None:
            from transformers.integrations.deepspeed import unset_hf_deepspeed_config

            unset_hf_deepspeed_config()
            del hf_ds


class DeepSpeedModel:
    """What the actor and the critic engines do alike on their DeepSpeed engine: eval-mode
    forward-only passes, the guarded optimizer step, the DeepSpeed checkpoint of sub-folder
    ``ds_tag`` and the full (gathered) parameters. A subclass sets ``engine`` (the DeepSpeed
    engine), ``zero_stage``, ``_nonfinite_loss`` (a microbatch loss since the last step was
    NaN/inf on this rank) and ``last_step_skipped`` (the last optimizer_step() skipped a
    non-finite step)."""

    ds_tag = _DS_TAG  # sub-folder of a dsrl checkpoint holding this engine's DeepSpeed files
    checkpoint_name = "DeepSpeed"  # names it in the error of a missing checkpoint
    trainable = True  # (an ActorEngine may be a frozen scorer: no optimizer state to load)

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def dp_world_size(self) -> int:
        return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1

    @torch.no_grad()
    def _forward_only(self, microbatches: Iterable[Mapping], forward, progress=None) -> list:
        """``forward(mb)`` of each microbatch (moved to the engine's device) in eval mode, masked
        to its loss mask, on the host; the module's train/eval mode is restored after."""
        microbatches = (to_device(mb, self.engine.device) for mb in microbatches)  # host -> engine device
        was_training = self.module.training
        self.module.eval()
        out = []
        try:
            for mb in microbatches:
                out.append((forward(mb) * mb["loss_mask"]).detach())
                if progress is not None:
                    progress.update(1)
        finally:
            self.module.train(was_training)
        return to_host(out)  # the trainer keeps scored outputs on the host

    def optimizer_step(self) -> float:
        """Apply the accumulated gradient; returns the global grad norm (before clipping).

        Skipped instead (`last_step_skipped`, see dsrl.actor.nonfinite) when any rank saw a
        non-finite microbatch loss or holds a non-finite gradient: no update, weights and
        optimizer state untouched, gradients discarded; returns NaN. Collective."""
        bad_loss, self._nonfinite_loss = self._nonfinite_loss, False
        norm, self.last_step_skipped = guarded_step(self.engine, self.zero_stage, bad_loss)
        return norm

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, folder: str) -> None:
        """DeepSpeed checkpoint (module, optimizer, scheduler; every rank its own partition) into
        `folder`/`ds_tag`. Collective: every rank must call it with the same folder."""
        self.engine.save_checkpoint(folder, tag=self.ds_tag, save_latest=False)

    def load_checkpoint(self, folder: str) -> None:
        """Restore what save_checkpoint wrote (module; optimizer and scheduler states when
        trainable). Collective."""
        path, _ = self.engine.load_checkpoint(folder, tag=self.ds_tag, load_optimizer_states=self.trainable,
                                              load_lr_scheduler_states=self.trainable)
        if path is None:
            raise FileNotFoundError(f"no {self.checkpoint_name} checkpoint under {folder}/{self.ds_tag}")

    # ------------------------------------------------------------------ weights
    @contextlib.contextmanager
    def full_parameters(self):
        """Full (gathered) parameters on every rank; a no-op below ZeRO-3."""
        if self.zero_stage == 3:
            import deepspeed

            params = list(self.module.parameters())
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                yield
        else:
            yield


class ActorEngine(DeepSpeedModel):
    """A DeepSpeed-wrapped causal LM. `trainable=False` builds a frozen scorer (reference or
    teacher) on its own DeepSpeed engine without an optimizer. `lora` (actor.lora, rank > 0):
    a PEFT adapter is the only trained part; exports and saves give merged HF weights (dsrl.actor.lora)."""

    def __init__(self, model_path: str, *, zero_stage: int = 0, dtype: str = "float32",
                 attn_implementation: str = "eager", attention_dropout: float = 0.0,
                 hidden_dropout: float = 0.0, trainable: bool = True, lr: float = 1e-5,
                 betas: Iterable[float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 grad_clip: float = 1.0, micro_batch_size: int = 8, gradient_checkpointing: bool = False,
                 persistence_threshold: int = 10000, temperature: float = 1.0, role: str = "actor",
                 lora=None, node_local_checkpoints: bool = False):
        import deepspeed
        from transformers import AutoConfig, AutoModelForCausalLM

        init_distributed()
        self.role = role
        self.temperature = float(temperature)
        self.trainable = trainable
        self.zero_stage = int(zero_stage)
        self._open_accumulation = False  # a backward ran with is_last=False since the last step
        self._nonfinite_loss = False  # a microbatch loss since the last step was NaN/inf on this rank
        self.last_step_skipped = False  # the last optimizer_step() skipped a non-finite step
        # Optimizer steps applied since the rollout engine last got these weights (weights_pushed):
        # under reuse the training forward must run the rollout's policy, so it must be 0 there.
        self.steps_since_push = 0
        self._pushed_versions: Optional[list] = None  # parameter versions at the last push (in-place edits)
        hf_config = AutoConfig.from_pretrained(model_path)
        # dsrl's two dropout knobs go onto the HF fields of the same name and nothing else; the
        # model's other dropout/noise fields stay as its config says (the reuse decision names them).
        apply_dropout_knobs(hf_config, attention_dropout=attention_dropout, hidden_dropout=hidden_dropout)
        ds_config = build_ds_config(zero_stage, micro_batch_size, dtype=dtype,
                                    grad_clip=grad_clip if trainable else 0.0,
                                    persistence_threshold=persistence_threshold,
                                    node_local_storage=node_local_checkpoints)
        self.ds_config = ds_config
        model = load_pretrained(AutoModelForCausalLM, model_path, ds_config, zero_stage, config=hf_config,
                                dtype=_DTYPES[dtype], attn_implementation=attn_implementation)
        if gradient_checkpointing and trainable:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.config.use_cache = False
        # actor.lora.rank > 0: a PEFT adapter before DeepSpeed wraps the model; only it trains (dsrl.actor.lora).
        from dsrl.actor.lora import apply_lora, lora_enabled

        self.lora = lora if trainable and lora_enabled(lora) else None
        if self.lora is not None:
            model = apply_lora(model, self.lora)
        self.hf_config = model.config
        if trainable:
            model.train()
            trained = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapter only
            optimizer = adamw(trained, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
            self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                                                     config=ds_config)
            skip_single_rank_allreduce(self.engine)
        else:
            model.eval()
            for p in model.parameters():
                p.requires_grad_(False)
            self.engine, _, _, _ = deepspeed.initialize(model=model, config=ds_config)
            self.optimizer = None
        # HF train() mode enables dropout modules; under reuse every one has p=0, which
        # dsrl.validation.reuse.reuse_for_model checks on this module before training starts.

    # ------------------------------------------------------------------ forward
    def logits(self, batch: Mapping) -> torch.Tensor:
        """Logits for every target column of a dense-layout microbatch: [B, T-1, V]."""
        out = self.engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
        return out.logits[:, :-1]

    def _shared_prompt_logprobs(self, batch: Mapping, with_entropy: bool):
        """One forward of the packed rows (4-D mask, restarted position ids); the LM head runs
        only on the positions some response token reads (one row per response token: the
        prompt's last position once per response of its row), and the log-probs go back into
        the response-aligned [B, R] layout, 0 past each response. Against heading every kept
        position and gathering [B, R, V] logits this skips padding, each response's last
        position and a copy of the logits; the gradient of a shared position is the sum over
        its rows (autograd through the row gather)."""
        valid = batch["response_mask"].to(self.engine.device) > 0
        rows = batch["logit_index"].to(valid.device)[valid]
        mask = additive_mask(batch["attention_mask"], self.module.get_input_embeddings().weight.dtype)
        with head_rows(self.module, rows), attention_by_blocks(self.module, blocks_pay_off(batch)) as by_blocks:
            blocks = {"dsrl_blocks": batch[BLOCKS_KEY]} if by_blocks else {}
            out = self.engine(input_ids=batch["input_ids"], attention_mask=mask, position_ids=batch["position_ids"],
                              logits_to_keep=int(batch["logits_to_keep"]), use_cache=False, **blocks)
        targets = batch["targets"].to(valid.device)[valid]
        lp, ent = token_logprobs(out.logits, targets[None], temperature=self.temperature, with_entropy=with_entropy)
        lp = lp.new_zeros(valid.shape).masked_scatter(valid, lp[0])
        if ent is not None:
            ent = ent.new_zeros(valid.shape).masked_scatter(valid, ent[0])
        return lp, ent

    def target_logprobs(self, batch: Mapping, *, with_entropy: bool = False):
        if is_shared_prompt_batch(batch):
            return self._shared_prompt_logprobs(batch, with_entropy)
        return token_logprobs(self.logits(batch), batch["targets"], temperature=self.temperature,
                              with_entropy=with_entropy)

    def score(self, microbatches: Iterable[Mapping], *, progress=None) -> list:
        """Forward-only log-probs of each microbatch's targets (masked to the loss mask), on the host."""
        return self._forward_only(microbatches, lambda mb: self.target_logprobs(mb)[0], progress)

    # ------------------------------------------------------------------ training
    def forward_backward(self, mb: Mapping, objective: ObjectiveSpec, config: Mapping, reduction: Reduction, *,
                         reuse_training_logprobs: bool = False, is_last: bool = True,
                         forward_only: bool = False, loss_scale: Optional[float] = None) -> LossOutput:
        """One microbatch: forward, objective, backward. `reduction` gives the aggregation mode
        and the step's global counts; the reducer is built here, from the loss mask on this
        engine's device. `loss_scale` defaults to the DP world size (undoes DeepSpeed's gradient
        averaging; see module docstring)."""
        if reuse_training_logprobs:
            self._check_reuse_evidence(forward_only)
        mb = to_device(mb, self.engine.device)  # host -> engine device (DeepSpeed does not move inputs)
        reduce = reduction.build(mb["loss_mask"])
        grad_ctx = torch.no_grad() if forward_only else contextlib.nullcontext()
        with grad_ctx:
            # Entropy always comes from the training forward (a metric even when not weighted).
            lp, ent = self.target_logprobs(mb, with_entropy=True)
            if ent is not None and float(config.get("entropy_coef", 0.0) or 0.0) == 0.0:
                ent = ent.detach()
            fixed = {k: v for k, v in mb.items() if k not in FORWARD_KEYS}  # objective inputs only
            inputs = LossInputs(log_probs=lp, mask=mb["loss_mask"], batch=fixed, config=config, reduce=reduce,
                                entropy=ent, reuse_training_logprobs=reuse_training_logprobs,
                                sample_indices=mb.get("sample_indices"))
            if reuse_training_logprobs and not lp.requires_grad:
                raise ReuseInvariantError("reuse_training_logprobs: the training forward's log-probs carry no "
                                          "gradient (a no-grad context or a frozen model): there is no "
                                          "training forward to reuse")
            out = objective.fn(inputs)
            if "rollout_log_probs" in mb:
                # Trainer-vs-rollout-engine agreement on these exact tokens (weight-push check).
                diff = (lp.detach() - mb["rollout_log_probs"]).abs() * mb["loss_mask"]
                out.metrics["rollout/abs_diff_sum"] = diff.sum()
                out.metrics["rollout/tokens"] = mb["loss_mask"].sum()
        if not forward_only:
            scale = float(self.dp_world_size if loss_scale is None else loss_scale)
            self._nonfinite_loss |= not bool(torch.isfinite(out.loss.detach()).all())
            self.engine.set_gradient_accumulation_boundary(bool(is_last))
            self.engine.backward(out.loss * scale, scale_wrt_gas=False)
            # is_last=False leaves the gradient unreduced (ZeRO-0/1) or not finalized (ZeRO-2);
            # optimizer_step() then closes the accumulation window itself (Tinker work units
            # never know which forward_backward is the last before optim_step).
            self._open_accumulation = not is_last
        return out

    def _check_reuse_evidence(self, forward_only: bool) -> None:
        """Runtime evidence that the training forward is the old-policy pass (reuse), checked on
        the engine itself, not restated from the config: no optimizer step since the rollout's
        weights were pushed, a forward with gradient, and (once per accumulation window) no
        submodule in train mode that makes the forward random."""
        if forward_only:
            raise ReuseInvariantError("reuse_training_logprobs with forward_only: there is no training forward")
        if self.steps_since_push:
            raise ReuseInvariantError(
                f"reuse_training_logprobs: {self.steps_since_push} optimizer step(s) since the rollout engine "
                "got these weights (weights_pushed), so the training forward is not the rollout's policy")
        if self._pushed_versions is not None:
            changed = [n for (n, _), v0, v1 in zip(self.module.named_parameters(), self._pushed_versions,
                                                   self._param_versions()) if v0 != v1]
            if changed:
                raise ReuseInvariantError(
                    f"reuse_training_logprobs: {changed[0]} (and {len(changed) - 1} more) was modified in place "
                    "since the rollout engine got these weights (a hook?), so the training forward is not the "
                    "rollout's policy")
        if not self._open_accumulation:
            from dsrl.actor.stochastic import live_stochastic_modules

            live = live_stochastic_modules(self.module)
            if live:
                raise ReuseInvariantError(
                    "reuse_training_logprobs: the training forward is random (train mode with "
                    f"{', '.join(live[:5])}{' ...' if len(live) > 5 else ''}), so it differs from the old-policy pass")

    def weights_pushed(self) -> None:
        """The rollout engine(s) now hold these weights (dsrl.rollout.weight_sync calls it)."""
        self.steps_since_push = 0
        self._pushed_versions = self._param_versions()

    def _param_versions(self) -> list:
        """Each parameter's in-place version counter (and its ZeRO-3 partition's): an in-place edit of a
        weight bumps it; reading, the forward and the backward do not."""
        out = []
        for p in self.module.parameters():
            part = getattr(p, "ds_tensor", None)
            out.append((p._version, part._version if part is not None else None))
        return out

    def _close_accumulation_window(self) -> None:
        """Make the accumulated local gradients step-ready without another backward: the
        boundary work DeepSpeed would have done in the last backward had it been marked
        is_last (ZeRO-0/1: all-reduce / reduce of the local sums; ZeRO-2/3: finalize the
        partitions already reduced per backward). Collective: every rank must call it."""
        if not self._open_accumulation:
            return
        eng = self.engine
        eng.set_gradient_accumulation_boundary(True)
        if eng.zero_optimization_partition_gradients():
            eng.optimizer.finalize_gradient_accumulation_boundary()
        elif eng.enable_backward_allreduce:  # off for ZeRO-0 on one rank (dsrl.actor.optim)
            eng.allreduce_gradients()
        self._open_accumulation = False

    def gradient_snapshot(self):
        """What `restore_gradients` needs to put the accumulated gradient back as it is now (a
        Tinker request that fails part-way must leave none of its gradient behind). Nothing to
        copy when no backward ran since the last step; ZeRO-0 only (one process: the service's
        full-parameter clients), where the gradient is ``param.grad`` or, in bf16,
        BF16_Optimizer's fp32 accumulators."""
        if not self._open_accumulation:
            return None
        if self.zero_stage != 0:
            raise NotImplementedError(f"{self.role}: gradient snapshots need ZeRO-0, this engine runs ZeRO-{self.zero_stage}")
        opt = self.engine.optimizer
        with torch.no_grad():
            if hasattr(opt, "fp32_groups_gradients_flat"):  # BF16_Optimizer
                return ("bf16", [g.clone() for g in opt.fp32_groups_gradients_flat],
                        [list(flags) for flags in opt.fp32_groups_has_gradients], self._nonfinite_loss)
            return ("grad", [(p, None if p.grad is None else p.grad.clone()) for p in self.module.parameters()],
                    None, self._nonfinite_loss)

    def restore_gradients(self, snapshot) -> None:
        """Put back the gradient of `gradient_snapshot` (None: none accumulated, so none now)."""
        from dsrl.actor.nonfinite import discard_gradients

        if snapshot is None:
            discard_gradients(self.engine)
            self._open_accumulation = False
            self._nonfinite_loss = False
            return
        kind, grads, flags, nonfinite = snapshot
        opt = self.engine.optimizer
        with torch.no_grad():
            if kind == "bf16":
                for held, saved in zip(opt.fp32_groups_gradients_flat, grads):
                    held.copy_(saved)
                for held_flags, saved_flags in zip(opt.fp32_groups_has_gradients, flags):
                    held_flags[:] = saved_flags
                opt.clear_lp_grads(set_to_none=True)
            else:
                for p, g in grads:
                    p.grad = g
        self._open_accumulation = True
        self._nonfinite_loss = nonfinite

    def optimizer_step(self) -> float:
        """DeepSpeedModel.optimizer_step, after closing an open accumulation window; counts the
        steps applied since the last weight push."""
        self._close_accumulation_window()
        norm = super().optimizer_step()
        if not self.last_step_skipped:
            self.steps_since_push += 1
        return norm

    def set_optimizer_hparams(self, *, lr=None, betas=None, eps=None, weight_decay=None, grad_clip=None) -> None:
        """Per-request optimizer settings (Tinker `optim_step`)."""
        opt = self.engine.optimizer
        groups = getattr(opt, "param_groups", None) or opt.optimizer.param_groups
        for g in groups:
            if lr is not None:
                g["lr"] = float(lr)
            if betas is not None:
                g["betas"] = tuple(float(b) for b in betas)
            if eps is not None:
                g["eps"] = float(eps)
            if weight_decay is not None:
                g["weight_decay"] = float(weight_decay)
        if grad_clip is not None:
            self.engine._config.gradient_clipping = float(grad_clip)
            if hasattr(opt, "clip_grad"):
                opt.clip_grad = float(grad_clip)

    # ------------------------------------------------------------------ weights
    def export_named_tensors(self, *, copy: bool = True, device: Optional[str] = "cpu"):
        """HF-named full weights, one tensor at a time (tied lm_head omitted; buffers other than
        rotary caches after the parameters). Under ZeRO-3 the parameters are gathered one layer
        group at a time (embeddings, each decoder layer, the rest: `_layer_groups`), never the
        whole model, and each is yielded as a copy taken inside the gather (the gathered storage
        is released when the group's context exits), so `copy=False` cannot
        apply there. Below ZeRO-3, `copy=False` yields the live parameters without copying (the
        weight sync packs them into its buffers at once). `device=None` keeps each tensor on its
        parameter's device (CUDA IPC). Collective under ZeRO-3: every rank must iterate it to the end."""
        from dsrl.actor.lora import hf_name, merge_group, scaling

        tied = bool(getattr(self.hf_config, "tie_word_embeddings", False))
        named = [(n, p) for n, p in self.module.named_parameters() if not (tied and hf_name(n) == "lm_head.weight")]
        seen = set()

        def out(t: torch.Tensor, force_copy: bool) -> torch.Tensor:
            t = t.detach()
            if device is not None and t.device != torch.device(device):
                return t.to(device).contiguous()
            return t.clone(memory_format=torch.contiguous_format) if (copy or force_copy) else t.contiguous()

        for group in _layer_groups(named):
            if self.zero_stage == 3:
                import deepspeed

                with deepspeed.zero.GatheredParameters([p for _, p in group], modifier_rank=None):
                    tensors = [(n, out(p, True)) for n, p in group]
            else:
                tensors = [(n, out(p, False)) for n, p in group]
            if self.lora is not None:  # HF names, each adapter merged into its base weight
                tensors = merge_group(tensors, scaling(self.module))
            for n, t in tensors:
                seen.add(n)
                yield n, t
            del tensors
        for name, buf in self.module.named_buffers():
            name = hf_name(name)
            if "rotary" in name or "inv_freq" in name or name in seen:
                continue
            seen.add(name)
            yield name, out(buf, False)

    def state_dict_for_export(self) -> dict:
        """HF-named full weights as CPU tensors (tied lm_head omitted); see export_named_tensors."""
        return dict(self.export_named_tensors(copy=True, device="cpu"))

    def save_hf(self, out_dir: str, tokenizer=None) -> None:
        """Write a transformers-loadable folder (dsrl.hf_folder) from rank 0."""
        from dsrl.hf_folder import write_hf_folder

        state = self.state_dict_for_export()
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if rank == 0:
            write_hf_folder(out_dir, state, self.hf_config, tokenizer=tokenizer,
                            generation_config=getattr(self.module, "generation_config", None))
        if self.lora is not None:  # the weights above are merged; the adapter alone beside them
            self.save_adapter(os.path.join(out_dir, LORA_ADAPTER_DIR))
        if torch.distributed.is_initialized():
            torch.distributed.barrier()

    def save_adapter(self, folder: str) -> None:
        """The LoRA adapter as a PEFT folder (PeftModel.from_pretrained / vLLM load it), from rank 0.
        Collective under ZeRO-3."""
        from dsrl.actor.lora import adapter_config_dict, adapter_state, write_adapter

        state = adapter_state(self)
        if (torch.distributed.get_rank() if torch.distributed.is_initialized() else 0) == 0:
            write_adapter(folder, state, adapter_config_dict(self.module))


def _layer_groups(named: list) -> list:
    """Consecutive (name, param) runs that belong to one layer: names with a numeric component
    ("model.layers.3.mlp.up_proj.weight") group by the prefix up to it ("model.layers.3"); the
    others by their module ("model.embed_tokens", "model.norm", "lm_head"). In parameter order."""
    import re

    groups, key = [], None
    for name, p in named:
        m = re.match(r"^(.*?\.\d+)\.", name)
        k = m.group(1) if m else name.rpartition(".")[0]
        if not groups or k != key:
            groups.append([])
            key = k
        groups[-1].append((name, p))
    return groups
