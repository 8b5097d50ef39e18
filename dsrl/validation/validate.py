"""Semantic validation of a composed config, run once in main before anything heavy loads.
Every error names the offending key; all problems are reported together.

Plug-in names (objective, estimator, TIS function, prompt source, verifier) are checked against
the live registries, so a plug-in registered by user code before validation, or named by dotted
path, is accepted; dotted paths are imported here. No model or transformers import happens."""
from __future__ import annotations

import os
from typing import Any, List, Optional

from dsrl.config.schema import Config
from dsrl.errors import ConfigError
from dsrl.validation.reuse import steps_per_rollout, validate_reuse

_CHOICES = {
    "algo.reuse_logprobs": ("off", "on", "auto", "adaptive"),
    "algo.kl_loss_type": ("k1", "k2", "k3", "low_var_kl"),
    "algo.loss_agg_mode": ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm",
                           "sum"),
    "model.dtype": ("auto", "float32", "bfloat16"),
    "rollout.dtype": ("auto", "float32", "bfloat16"),
    "rollout.backend": ("vllm", "hf"),
    "rollout.placement": ("colocated", "ray"),
    "logger.wandb_mode": ("auto", "online", "offline"),
    "trainer.resume": ("auto", "off"),
    "trainer.checkpoint_storage": ("shared", "node_local"),
    "data.on_bad_row": ("error", "skip"),
    "actor.shared_prompt": ("auto", "on", "off"),
    "algo.async_schedule": ("auto", "overlap", "clock", "deterministic"),
    "algo.stale_groups": ("drop", "keep", "admission"),
    "critic.shared_prompt": (None, "auto", "on", "off"),  # null: actor.shared_prompt
}
# Numeric ranges: key -> (test, what the value must be). Every float must also be finite.
_SEED_RANGE = (lambda v: 0 <= v < 2**31, ">= 0 and < 2**31")
_RANGES = {
    "algo.reuse_probe_fraction": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "algo.reuse_max_mismatch": (lambda v: v is None or v >= 0, ">= 0 or null (by rollout.dtype)"),
    "actor.eps": (lambda v: v > 0, "> 0"),
    "actor.weight_decay": (lambda v: v >= 0, ">= 0"),
    "actor.grad_clip": (lambda v: v >= 0, ">= 0 (0 disables clipping)"),
    "actor.stage3_param_persistence_threshold": (lambda v: v >= 0, ">= 0"),
    "actor.num_threads": (lambda v: v >= 0, ">= 0 (0 = auto)"),
    "actor.max_tokens_per_microbatch": (lambda v: v >= 0, ">= 0 (0 = count-based microbatches)"),
    "actor.betas": (lambda v: len(v) == 2 and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in v),
                    "two numbers in [0, 1)"),
    "rollout.kv_cache_gib": (lambda v: v >= 1, ">= 1"),
    "rollout.gpu_memory_utilization": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "rollout.seed": _SEED_RANGE,
    "trainer.seed": _SEED_RANGE,
    "data.seed": _SEED_RANGE,
    "algo.eps_clip": (lambda v: v > 0, "> 0"),
    "algo.eps_clip_high": (lambda v: v is None or v > 0, "> 0 or null"),
    "algo.tis_clip": (lambda v: v > 0, "> 0"),
    "algo.tis_clip_low": (lambda v: v >= 0, ">= 0"),
    "algo.kl_coef": (lambda v: v >= 0, ">= 0"),
    "algo.kl_loss_coef": (lambda v: v >= 0, ">= 0"),
    "algo.opd_kl_coef": (lambda v: v >= 0, ">= 0"),
    "algo.gamma": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "algo.gae_lambda": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "algo.value_clip": (lambda v: v is None or v > 0, "> 0 or null (unclipped)"),
    "algo.value_loss_coef": (lambda v: v > 0, "> 0"),
    "critic.zero_stage": (lambda v: v is None or v in (0, 1, 2, 3), "0, 1, 2, 3 or null (actor.zero_stage)"),
    "critic.lr": (lambda v: v > 0, "> 0"),
    "critic.weight_decay": (lambda v: v >= 0, ">= 0"),
    "critic.grad_clip": (lambda v: v >= 0, ">= 0 (0 disables clipping)"),
    "critic.micro_batch_size": (lambda v: v is None or v >= 1, ">= 1 or null (actor.micro_batch_size)"),
    "critic.max_tokens_per_microbatch": (
        lambda v: v is None or v >= 0, ">= 0 (0 = count-based microbatches) or null (actor.max_tokens_per_microbatch)"),
    "algo.max_sampling_rounds": (lambda v: v >= 1, ">= 1"),
    "algo.off_policy_steps": (lambda v: isinstance(v, int) and v >= 0, ">= 0 (0 = synchronous)"),
    "rollout.chunk_tokens": (lambda v: v >= 1, ">= 1"),
    "rollout.engine_cores": (lambda v: v == "" or all(p.isdigit() or (p.count("-") == 1 and all(
        x.isdigit() for x in p.split("-"))) for p in str(v).split(",")), '"" or core ids like "1", "2-3", "0,2"'),
    "logger.plot_every": (lambda v: v >= 1, ">= 1"),
    "data.num_eval": (lambda v: v >= 0, ">= 0"),
    "data.eval_fraction": (lambda v: v is None or 0 < v < 1, "in (0, 1) or null"),
    "data.max_prompt_tokens": (lambda v: v is None or v >= 1, ">= 1 or null"),
    "reward.timeout_s": (lambda v: v > 0, "> 0"),
    "reward.retries": (lambda v: v >= 0, ">= 0"),
    "reward.concurrency": (lambda v: v >= 1, ">= 1"),
    "rollout.max_restarts": (lambda v: v >= 0, ">= 0"),
    "rollout.timeout_s": (lambda v: v > 0, "> 0"),
    "rollout.num_engines": (lambda v: v >= 1, ">= 1"),
    "rollout.tensor_parallel_size": (lambda v: v >= 1, ">= 1"),
    "rollout.cpus_per_engine": (lambda v: v >= 1, ">= 1"),
    "rollout.sync_bucket_mb": (lambda v: v > 0, "> 0 (MiB per weight-sync bucket)"),
    "rollout.sync_tolerance": (lambda v: v is None or v > 0, "> 0 or null (by the engine's dtype)"),
    "trainer.max_skipped_steps": (lambda v: v >= 1, ">= 1"),
    "trainer.save_every": (lambda v: v >= 0, ">= 0 (0 = only on a stop signal)"),
    "trainer.keep_checkpoints": (lambda v: v >= 0, ">= 0 (0 = keep all)"),
    "trainer.dist_timeout_s": (lambda v: v > 0, "> 0"),
}
# Checked only when algo.tis_function=mis (the options of the built-in MIS correction).
_MIS_CHOICES = {
    "algo.mis_level": ("token", "sequence", "geometric"),
    "algo.mis_mode": ("truncate", "clip", "mask"),
}


def _get(cfg: Config, dotted: str):
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


# rollout.sync_probe_every=null where the train step can check each sync on its samples: the probe
# runs on the first sync and every this many after (dsrl.rollout.weight_sync module doc: cost, sensitivity).
# 32: the probe (two forwards of 8x32 tokens, 2.3 s for SmolLM2 fp32 on 2 cores, 3.8x the engine's own
# weight reload) then adds 0.12x of that reload per push; with 16 the sync + check read 1.34x (make bench-sync).
AUTO_PROBE_EVERY = 32


def _sample_check_blockers(cfg: Config) -> List[str]:
    """Why the train step's check of its sampled tokens is not a sync check in this config (none:
    trainer and engine log-probs are the same policy's; WeightSync.check_samples)."""
    why = []
    if cfg.rollout.top_p < 1:
        why.append(f"rollout.top_p={cfg.rollout.top_p} (the engine's log-probs are over the nucleus)")
    if cfg.algo.off_policy_steps:
        why.append(f"algo.off_policy_steps={cfg.algo.off_policy_steps} (the samples come from older weights)")
    k = steps_per_rollout(cfg)
    if k != 1:
        why.append(f"{k} optimizer steps per rollout (later steps train newer weights than the samples')")
    return why


def probe_every(cfg: Config) -> int:
    """The probe schedule (rollout.sync_probe_every; null: AUTO_PROBE_EVERY where the train step can
    check the syncs between on its samples, else 1 = every sync)."""
    every = cfg.rollout.sync_probe_every
    if every is not None:
        return int(every)
    return 1 if _sample_check_blockers(cfg) else AUTO_PROBE_EVERY


def _check_probe_schedule(cfg: Config, errors: List[str]) -> None:
    """rollout.sync_probe_every > 1 leaves the syncs between probes to the train step's check of
    the sampled tokens, which is only a sync check where trainer and engine log-probs are the same
    policy's (dsrl.rollout.weight_sync.WeightSync.check_samples)."""
    every = cfg.rollout.sync_probe_every
    if every is None:
        return  # auto (probe_every): never a schedule the config cannot check
    if every < 1:
        errors.append(f"rollout.sync_probe_every={every} must be >= 1 (1 = probe after every sync; null = auto)")
        return
    if every == 1:
        return
    why = _sample_check_blockers(cfg)
    if why:
        errors.append(f"rollout.sync_probe_every={every} needs the train step to check each sync on its samples, "
                      f"which is not a sync check with {'; '.join(why)}: set rollout.sync_probe_every=1")


def async_mode(cfg: Config) -> str:
    """How generation runs beside training: sync (k = 0), overlap, clock or deterministic."""
    a = cfg.algo
    if a.off_policy_steps == 0:
        return "sync"
    if a.async_schedule == "auto":
        return "overlap" if a.off_policy_steps == 1 else "clock"
    return a.async_schedule


def _check_async(cfg: Config, errors: List[str]) -> None:
    """algo.async_schedule clock | deterministic: chunked single-turn generation (module docstring of
    dsrl.rollout.async_buffer); what it does not combine with is named here."""
    a, mode = cfg.algo, async_mode(cfg)
    if a.async_schedule == "overlap" and a.off_policy_steps not in (0, 1):
        errors.append(f"algo.async_schedule=overlap generates one whole rollout ahead: it needs "
                      f"algo.off_policy_steps=1, not {a.off_policy_steps} (clock or deterministic allow any k)")
    if mode not in ("clock", "deterministic"):
        return
    why = [(key, on) for key, on in (
        ("algo.dynamic_sampling=true", a.dynamic_sampling),
        ("rollout.env (multi-turn episodes)", bool(cfg.rollout.env)),
        ("rollout.agent_endpoint=true", cfg.rollout.agent_endpoint),
        ("rollout.placement=ray", cfg.rollout.placement == "ray"),
        (f"{steps_per_rollout(cfg)} optimizer steps per rollout", steps_per_rollout(cfg) != 1)) if on]
    for key, _ in why:
        errors.append(f"algo.async_schedule={mode} (algo.off_policy_steps={a.off_policy_steps}) generates "
                      f"single-turn groups in chunks on this rank's engine, one batch per optimizer step: it "
                      f"cannot be combined with {key}")


def validate(cfg: Config) -> None:
    errors: List[str] = []
    for key, choices in _CHOICES.items():
        v = _get(cfg, key)
        if v not in choices:
            errors.append(f"{key}={v!r} is not one of {list(choices)}")
    a = cfg.algo
    positive = ("algo.n_samples_per_prompt", "algo.rollout_batch_size", "algo.global_batch_size",
                "actor.micro_batch_size", "actor.forward_micro_batch_size", "rollout.max_new_tokens",
                "trainer.total_steps")  # data.digits / data.num_operands: ArithSource.check_config
    for key in positive:
        if _get(cfg, key) < 1:
            errors.append(f"{key}={_get(cfg, key)} must be >= 1")
    if cfg.actor.zero_stage not in (0, 1, 2, 3):
        errors.append(f"actor.zero_stage={cfg.actor.zero_stage} must be 0, 1, 2 or 3")
    if cfg.actor.lr <= 0:
        errors.append(f"actor.lr={cfg.actor.lr} must be > 0")
    if cfg.rollout.temperature <= 0:
        errors.append(f"rollout.temperature={cfg.rollout.temperature} must be > 0 (training log-probs divide by it)")
    if not 0 < cfg.rollout.top_p <= 1:
        errors.append(f"rollout.top_p={cfg.rollout.top_p} must be in (0, 1]")
    _check_probe_schedule(cfg, errors)
    for key in ("model.attention_dropout", "model.hidden_dropout"):
        if not 0 <= _get(cfg, key) < 1:
            errors.append(f"{key}={_get(cfg, key)} must be in [0, 1)")
    world = _launcher_world_size(errors)
    if all(_get(cfg, k) >= 1 for k in ("algo.n_samples_per_prompt", "algo.rollout_batch_size",
                                       "algo.global_batch_size")):
        _check_batch_split(cfg, world, errors)
    if a.eps_clip_c is not None and a.eps_clip_c <= 1.0:
        errors.append(f"algo.eps_clip_c={a.eps_clip_c} must be > 1 (dual-clip)")
    if a.off_policy_steps >= 1 and not (a.use_rollout_logprobs or a.use_tis):
        errors.append(f"algo.off_policy_steps={a.off_policy_steps} needs algo.use_rollout_logprobs=true or "
                      "algo.use_tis=true: the samples come from weights older than the trained ones, and only the "
                      "rollout log-probs (as the old policy) or TIS (decoupled PPO: the trainer's pass as the "
                      "proximal policy, the rollout's as the behaviour policy) correct for that")
    _check_async(cfg, errors)
    if a.use_tis and a.use_rollout_logprobs:
        errors.append("algo.use_tis and algo.use_rollout_logprobs are mutually exclusive "
                      "(TIS reweights trainer-vs-rollout mismatch; with rollout log-probs as the old policy there is none)")
    if a.kl_coef != 0 and a.use_kl_loss and a.kl_loss_coef != 0:
        errors.append("algo.kl_coef and algo.kl_loss_coef cannot both be non-zero (KL in reward and in loss)")
    if a.use_kl_loss and a.kl_loss_coef == 0:
        errors.append("algo.use_kl_loss=true needs algo.kl_loss_coef != 0")
    if a.use_opd and not cfg.model.teacher_path:
        errors.append("algo.use_opd=true needs model.teacher_path (the teacher scored forward-only)")
    if a.keep_old_actor:
        errors.append("algo.keep_old_actor: a frozen old-actor copy is not implemented by the trainer")
    if cfg.rollout.top_p < 1:
        for key, on in (("algo.use_rollout_logprobs", a.use_rollout_logprobs), ("algo.use_tis", a.use_tis)):
            if on:
                errors.append(f"rollout.top_p={cfg.rollout.top_p} < 1 cannot be combined with {key}=true: vLLM's "
                              "sampling log-probs are over the renormalized nucleus, the trainer's over the full "
                              "vocabulary (set rollout.top_p=1)")
    _check_numbers(cfg, errors)
    _check_lengths(cfg, errors)
    _check_placement(cfg, errors)
    if cfg.rollout.backend == "hf" and cfg.rollout.placement != "colocated":
        errors.append(f"rollout.backend=hf runs in the trainer's process: it needs rollout.placement=colocated, "
                      f"not {cfg.rollout.placement!r}")
    _check_loss_plugins(cfg, errors)
    _check_critic(cfg, errors)
    _check_data_plugins(cfg, errors)
    from dsrl.agent.config_checks import check_agent_config  # rollout.env*: multi-turn episodes

    errors += check_agent_config(cfg)
    from dsrl.actor.lora import config_errors as lora_config_errors  # actor.lora.*: ranges and targets

    errors += lora_config_errors(cfg.actor.lora)
    try:
        validate_reuse(cfg)
    except ConfigError as e:
        errors.append(str(e))
    if errors:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(errors))


def _launcher_world_size(errors: List[str]) -> int:
    """The number of ranks the launcher will start (WORLD_SIZE, set by the deepspeed launcher
    and torchrun; 1 when unset)."""
    raw = os.environ.get("WORLD_SIZE", "").strip()
    if not raw:
        return 1
    try:
        world = int(raw)
    except ValueError:
        world = 0
    if world < 1:
        errors.append(f"environment variable WORLD_SIZE={raw!r} must be an integer >= 1")
        return 1
    return world


def _check_batch_split(cfg: Config, world: int, errors: List[str]) -> None:
    """Prompts split evenly over the ranks, and each rank's samples split evenly over the
    optimizer steps of one rollout: nothing is left untrained."""
    a = cfg.algo
    samples = a.rollout_batch_size * a.n_samples_per_prompt
    if a.rollout_batch_size % world:
        errors.append(f"algo.rollout_batch_size={a.rollout_batch_size} must be divisible by the launcher's "
                      f"world size WORLD_SIZE={world} (each rank draws rollout_batch_size / WORLD_SIZE prompts)")
        return
    k = a.num_steps_per_rollout
    if k is None:
        if samples % a.global_batch_size:
            errors.append(f"algo.global_batch_size={a.global_batch_size} must divide rollout_batch_size * "
                          f"n_samples_per_prompt = {samples}")
            return
        steps, step_key = samples // a.global_batch_size, "algo.global_batch_size"
    elif k < 1:
        errors.append(f"algo.num_steps_per_rollout={k} must be >= 1 or null")
        return
    elif samples % k:
        errors.append(f"algo.num_steps_per_rollout={k} does not divide algo.rollout_batch_size * "
                      f"algo.n_samples_per_prompt = {a.rollout_batch_size} * {a.n_samples_per_prompt} = {samples}: "
                      f"{samples} % {k} = {samples % k} sample(s) per rollout would be left untrained")
        return
    elif a.global_batch_size * k != samples:
        errors.append(f"algo.global_batch_size={a.global_batch_size} is inconsistent with "
                      f"algo.num_steps_per_rollout={k}: {k} steps of {a.global_batch_size} samples != "
                      f"rollout_batch_size * n_samples_per_prompt = {samples} (set global_batch_size={samples // k})")
        return
    else:
        steps, step_key = k, "algo.num_steps_per_rollout"
    per_rank = samples // world
    if per_rank % steps:
        errors.append(f"{step_key}: {steps} optimizer steps per rollout do not divide the {per_rank} samples of "
                      f"each rank (algo.rollout_batch_size={a.rollout_batch_size} * algo.n_samples_per_prompt="
                      f"{a.n_samples_per_prompt} over WORLD_SIZE={world}): {per_rank % steps} sample(s) per rank would "
                      "be left untrained")


def _resolve(lookup, name: str, errors: List[str]) -> Optional[Any]:
    """`lookup(name)`, or None with its message (which names the key) appended to errors."""
    from dsrl.registry import PluginError

    try:
        return lookup(name)
    except PluginError as e:
        errors.append(str(e))
        return None


def _check_loss_plugins(cfg: Config, errors: List[str]) -> None:
    from dsrl.loss.corrections import CORRECTIONS
    from dsrl.loss.registry import ADVANTAGE_ESTIMATORS, get_advantage_estimator, get_objective, uses_kl_in_reward

    a = cfg.algo
    estimator = _resolve(get_advantage_estimator, a.advantage_estimator, errors)
    if estimator is not None and a.kl_coef != 0 and not uses_kl_in_reward(estimator):
        users = sorted(n for n, fn in ADVANTAGE_ESTIMATORS.items() if uses_kl_in_reward(fn))
        errors.append(f"algo.kl_coef={a.kl_coef} is ignored by algo.advantage_estimator={a.advantage_estimator!r} "
                      f"(it does not fold KL into the reward; the reference pass would run for nothing): use "
                      f"algo.use_kl_loss=true with algo.kl_loss_coef instead, or an estimator that uses it: {users}")
    spec = _resolve(get_objective, a.policy_loss, errors)
    if spec is not None:
        _check_objective(cfg, spec, errors)
    if a.tis_function is not None:
        _resolve(lambda name: CORRECTIONS.resolve(name, "algo.tis_function"), a.tis_function, errors)
    if a.tis_function == "mis":
        for key, choices in _MIS_CHOICES.items():
            v = _get(cfg, key)
            if v not in choices:
                errors.append(f"{key}={v!r} is not one of {list(choices)} (algo.tis_function=mis)")


def _check_critic(cfg: Config, errors: List[str]) -> None:
    """An estimator that reads values (gae) trains a critic: its value loss must resolve, the RL
    loop must drive it, and the policy objective must read the advantages it pays for. Other
    estimators build no critic, so a changed critic.* key would be silently ignored: an error."""
    import dataclasses

    from dsrl.config.schema import CriticConfig
    from dsrl.loss.registry import get_advantage_estimator, get_objective
    from dsrl.loss.value import get_value_loss
    from dsrl.registry import PluginError

    a, c = cfg.algo, cfg.critic
    try:
        estimator = get_advantage_estimator(a.advantage_estimator)
    except PluginError:
        return  # named by _check_loss_plugins
    if not getattr(estimator, "needs_values", False):
        changed = [f"critic.{f.name}" for f in dataclasses.fields(CriticConfig)
                   if getattr(c, f.name) != getattr(CriticConfig(), f.name)]
        if changed:
            errors.append(f"{', '.join(changed)} set, but algo.advantage_estimator={a.advantage_estimator!r} reads no "
                          "values, so no critic is built (a critic needs algo.advantage_estimator=gae)")
        return
    where = f"algo.advantage_estimator={a.advantage_estimator}"
    if getattr(estimator, "rl_loop_error", None):
        errors.append(f"{where} cannot run in the RL loop yet: {estimator.rl_loop_error}")
    _resolve(lambda name: get_value_loss(name, "critic.loss"), c.loss, errors)
    try:
        spec = get_objective(a.policy_loss)
    except PluginError:
        return
    if "advantages" not in spec.required_inputs:
        errors.append(f"{where} trains a critic for advantages, but algo.policy_loss={a.policy_loss} reads no "
                      "advantages (use ppo, gspo or cispo)")


def _check_objective(cfg: Config, spec: Any, errors: List[str]) -> None:
    a = cfg.algo
    if spec.rl_loop_error:
        errors.append(f"algo.policy_loss={a.policy_loss} cannot run in the RL loop: {spec.rl_loop_error}")
    if spec.aggregation is not None and a.loss_agg_mode != spec.aggregation:
        errors.append(f"algo.policy_loss={a.policy_loss} reduces with {spec.aggregation!r} itself: it needs "
                      f"algo.loss_agg_mode={spec.aggregation} (got {a.loss_agg_mode!r})")
    given = dict(a.loss_fn_config or {})
    if spec.config_defaults is None:
        if given:
            errors.append(f"algo.loss_fn_config={given}: algo.policy_loss={a.policy_loss} declares no config of "
                          "its own (its options are algo.* keys); leave algo.loss_fn_config empty")
        return
    for key in sorted(set(given) - set(spec.config_defaults)):
        errors.append(f"algo.loss_fn_config.{key}: unknown key for algo.policy_loss={a.policy_loss} "
                      f"(accepted: {sorted(spec.config_defaults) or 'none'})")


def _check_numbers(cfg: Config, errors: List[str]) -> None:
    """Every float is finite (nan/inf pass every comparison or none), and the ranges above hold."""
    import dataclasses
    import math

    for section in dataclasses.fields(cfg):
        group = getattr(cfg, section.name)
        if not dataclasses.is_dataclass(group):
            continue
        for f in dataclasses.fields(group):
            v = getattr(group, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                errors.append(f"{section.name}.{f.name}={v} must be a finite number")
    for key, (ok, what) in _RANGES.items():
        v = _get(cfg, key)
        try:
            good = ok(v)
        except TypeError:
            good = False
        if not good and not (isinstance(v, float) and not math.isfinite(v)):
            errors.append(f"{key}={v} must be {what}")


def _check_placement(cfg: Config, errors: List[str]) -> None:
    """Ray-placed engines need Ray and an address; tensor parallelism needs CUDA engines, which
    only Ray placement runs."""
    import importlib.util

    r = cfg.rollout
    if r.tensor_parallel_size > 1:
        if r.placement != "ray":
            errors.append(f"rollout.tensor_parallel_size={r.tensor_parallel_size} > 1 needs rollout.placement=ray "
                          f"(a colocated engine uses its rank's one device)")
        import torch

        if not torch.cuda.is_available():
            errors.append(f"rollout.tensor_parallel_size={r.tensor_parallel_size} > 1 needs CUDA (vLLM on CPU "
                          f"runs an engine on one device); set it to 1")
    if r.placement != "ray":
        return
    if importlib.util.find_spec("ray") is None:
        errors.append("rollout.placement=ray needs the `ray` package (pip install ray), not importable here")
    if not str(r.ray_address).strip():
        errors.append("rollout.ray_address is empty: auto | host:port | local")


def _check_lengths(cfg: Config, errors: List[str]) -> None:
    """Prompt and completion fit the rollout engine's context (vLLM refuses longer prompts)."""
    r, limit = cfg.rollout, cfg.data.max_prompt_tokens
    if r.max_new_tokens >= 1 and r.max_model_len <= r.max_new_tokens:
        errors.append(f"rollout.max_model_len={r.max_model_len} must be > rollout.max_new_tokens={r.max_new_tokens} "
                      "(room for the prompt)")
    elif limit is not None and limit >= 1 and limit + r.max_new_tokens > r.max_model_len:
        errors.append(f"data.max_prompt_tokens={limit} + rollout.max_new_tokens={r.max_new_tokens} exceeds "
                      f"rollout.max_model_len={r.max_model_len}: lower data.max_prompt_tokens or raise "
                      "rollout.max_model_len")


def _check_data_plugins(cfg: Config, errors: List[str]) -> None:
    """The prompt source (its own keys too: a file source checks data.path and its fields) and
    the verifier (reward.fn, else the source's default)."""
    from dsrl.data.registry import source_class
    from dsrl.reward.registry import get_verifier, verifier_names

    d, fn = cfg.data, cfg.reward.fn
    cls = _resolve(source_class, d.name, errors)
    check = getattr(cls, "check_config", None) if cls is not None else None
    if callable(check):
        try:
            errors.extend(check(d))
        except Exception as e:  # noqa: BLE001 - a user source's checker must not hide the other errors
            errors.append(f"data.name={d.name!r}: its check_config failed: {type(e).__name__}: {e}")
    url = cfg.reward.url
    if url is not None:
        if fn is not None:
            errors.append(f"reward.url={url!r} and reward.fn={fn!r}: set one of them (the server replaces the function)")
        if not str(url).startswith(("http://", "https://")):
            errors.append(f"reward.url={url!r} must start with http:// or https://")
    elif fn is not None:
        _resolve(lambda name: get_verifier(name, "reward.fn"), fn, errors)
    elif cls is not None:
        default = getattr(cls, "default_verifier", None)
        if not default:
            errors.append(f"reward.fn is required: data.name={d.name!r} names no default_verifier; set reward.fn "
                          f"to a registered verifier {verifier_names()} or a dotted path 'pkg.module.fn'")
        else:
            key = f"reward.fn (null: the default_verifier of data.name={d.name!r})"
            _resolve(lambda name: get_verifier(name, key), default, errors)
    if cfg.reward.eval_fn is not None:
        _resolve(lambda name: get_verifier(name, "reward.eval_fn"), cfg.reward.eval_fn, errors)
