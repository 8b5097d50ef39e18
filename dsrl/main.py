"""Hydra entry point: compose -> validate (before anything heavy) -> build -> run.

    python -m dsrl.main +exp=grpo_reuse [overrides]
    deepspeed --num_gpus 2 --module dsrl.main +exp=grpo_reuse actor.zero_stage=3   (the launcher has no -m)
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from typing import NamedTuple

import hydra
from omegaconf import DictConfig, OmegaConf

from dsrl.config.schema import register_configs

log = logging.getLogger("dsrl")
register_configs()


def _configure_env(cache_dir: str) -> None:
    from dsrl.setup_assets import use_op_cache
    from dsrl.tracking.console import adopt_library_loggers

    use_op_cache(cache_dir)  # DeepSpeed's JIT op cache, warmed by set-up
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if _has_cuda() else "cpu")
    # Libraries imported by now (DeepSpeed, transformers) print through their own handlers:
    # route them through dsrl's console filter and run.log.
    adopt_library_loggers()


def _resolve_hardware(cfg, cfg_node: DictConfig) -> list:
    """Fill every `auto` machine-dependent setting (dsrl/hardware.py) into `cfg` and into the node
    that becomes config.yaml; say once (rank 0) what was chosen and why."""
    from dsrl import hardware
    from dsrl.distributed.ranks import is_main_rank, world_size

    machine = hardware.probe(local_ranks=hardware.local_world_size(world_size()))
    decisions = hardware.decide(cfg, machine)
    hardware.apply(cfg, decisions)
    hardware.record_resolved(cfg_node, decisions)
    if is_main_rank():
        log.info(hardware.describe(machine))
        for d in decisions:
            (log.warning if d.warning else log.info)(d.line())
    return decisions


class StartupError(RuntimeError):
    """A component (Ray, DeepSpeed, vLLM) failed to start; the message names the cause and the
    keys to look at, the traceback is in run.log."""


@contextlib.contextmanager
def _starting(what: str, keys: str):
    """Turn a start-up failure of `what` into one StartupError line naming its cause and `keys`;
    the whole traceback goes to run.log only. Config errors pass as they are."""
    from dsrl.errors import ConfigError

    try:
        yield
    except ConfigError:
        raise
    except Exception as e:
        log.error("%s failed to start", what, exc_info=True, extra={"console": False})
        cause = (str(e).strip().splitlines() or [""])[0][:300]
        raise StartupError(f"{what} failed to start: {type(e).__name__}: {cause} (look at {keys}; "
                           "the traceback is in run.log)") from e


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def run(cfg_node: DictConfig, run_dir: str) -> dict:
    """Validate, build every component, train. Returns the run summary. SIGTERM/SIGINT stop the
    run after the current step with a checkpoint (a second signal stops it at once); the rollout
    engines are stopped however the run ends (the reaper covers SIGKILL)."""
    from dsrl.distributed.reaper import Reaper
    from dsrl.errors import RunStopped

    reaper = Reaper.start()
    try:
        trainer = build(cfg_node, run_dir)
        together = False  # every rank reached the same end: the last step, or a stop all ranks agreed on
        try:
            with _stop_on_signals(trainer):
                summary = trainer.fit()
            together = True
            return summary
        except RunStopped:
            together = True
            raise
        finally:
            trainer.close()  # the rollout side: the agent endpoint's server (if one runs), the engines
            if together:
                from dsrl.actor.engine import close_distributed  # loaded by build already

                close_distributed()
    finally:
        reaper.close()


# Seconds after a stop signal within which another one is taken as the same request (launchers
# pass a signal on to the ranks that already got it from their process group).
REPEAT_GRACE_S = 5.0


@contextlib.contextmanager
def _stop_on_signals(trainer):
    """First SIGTERM/SIGINT: finish the step, checkpoint, stop (trainer.fit raises RunStopped).
    Second, REPEAT_GRACE_S or more after the first: stop now (SystemExit; the caller's finally
    blocks still stop the engines). A repeat within REPEAT_GRACE_S is the same request: a signal to
    a node's process group reaches the rank and DeepSpeed's launcher, which passes it on again."""
    first = []

    def handler(signum, frame):
        if trainer.stop_signal is None:
            trainer.stop_signal = signum
            first.append(time.monotonic())
            log.warning("%s: stopping after this step with a checkpoint (send it again to stop now)",
                        signal.Signals(signum).name)
            return
        if time.monotonic() - first[0] < REPEAT_GRACE_S:
            return
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def build(cfg_node: DictConfig, run_dir: str):
    """Validate the config (before anything heavy), then build the components into a Trainer."""
    from dsrl.heap import imports_uncollected

    with imports_uncollected():  # the collector skips the imported objects from then on (dsrl/heap.py)
        start = _prepare(cfg_node, run_dir)
    return _build(start, run_dir)


class _Start(NamedTuple):
    """What `_prepare` found and built before any engine."""
    cfg: object
    auto_keys: tuple
    decision: object
    cache: str
    model_path: str
    source: object
    verifier: object
    eval_verifier: object
    resume_point: object
    tokenizer: object


def _prepare(cfg_node: DictConfig, run_dir: str):
    """Everything before the engines: the config validated and resolved, the data, the reward, the
    process group, the resume point, the tokenizer; all checks that need no model."""
    from dsrl.config.schema import to_config
    from dsrl.validation.reuse import decide_reuse, reuse_for_model_config
    from dsrl.validation.validate import validate

    cfg = to_config(cfg_node)
    validate(cfg)  # config errors surface here, before any model loads
    # `auto` dtypes / kernels / threads, before any model loads; which keys were auto goes into
    # checkpoints (a resume on another machine compares the user's `auto`, not what it resolved to).
    auto_keys = tuple(d.key for d in _resolve_hardware(cfg, cfg_node) if d.auto)
    decision = decide_reuse(cfg)

    import torch
    from transformers import AutoTokenizer

    from dsrl.actor.engine import init_distributed
    from dsrl.data.lengths import check_prompt_lengths
    from dsrl.data.registry import build_source
    from dsrl.distributed.ranks import is_main_rank, world_size
    from dsrl.reward.registry import build_eval_verifier, build_verifier
    from dsrl.setup_assets import default_cache_dir, resolve_model_path
    from dsrl.tracking.console import prints_to_log

    cache = str(default_cache_dir())
    _configure_env(cache)
    model_path = resolve_model_path(cfg.model.path, cache)
    decision = reuse_for_model_config(decision, cfg, model_path)  # HF config fields; still no model loaded
    from dsrl.actor.critic import critic_model_path
    from dsrl.actor.shared_prompt import check_shared_prompt_config

    # actor.shared_prompt (and critic.shared_prompt for gae's critic) =on where not exact: ConfigError here
    check_shared_prompt_config(cfg, model_path, critic_model_path(cfg, model_path,
                                                                  lambda p: resolve_model_path(p, cache)))
    from dsrl.actor.lora import check_targets

    check_targets(cfg.actor.lora, model_path)  # actor.lora.target_modules matching no layer: ConfigError here
    source = build_source(cfg.data)
    verifier = build_verifier(cfg.reward, source)  # reward.url (a server), reward.fn, or the source's default
    # The greedy eval's verifier: reward.eval_fn (under reward.strict too), else the training reward.
    eval_verifier = build_eval_verifier(cfg.reward, source)

    with prints_to_log("DeepSpeed", verbose=cfg.logger.verbose):  # its op-loading notices go to run.log
        init_distributed(cfg.trainer.dist_timeout_s)
    from dsrl.distributed import peers

    peers.record()  # which rank runs on which host: a failed collective names the rank it lost
    torch.manual_seed(cfg.trainer.seed)
    torch.set_num_threads(cfg.actor.num_threads)  # resolved by dsrl.hardware
    from dsrl.checkpoint import check_shared_checkpoint_folder

    # Checkpoint folders on node-local disks without trainer.checkpoint_storage=node_local (or a shared
    # folder with it): refused before any model loads.
    check_shared_checkpoint_folder(run_dir, cfg.trainer.checkpoint_storage)
    resume_point = _resume_point(cfg, run_dir, auto_keys)  # a config that breaks exact resume fails here
    if is_main_rank():
        OmegaConf.save(cfg_node, os.path.join(run_dir, "config.yaml"), resolve=True)
        log.info("run dir: %s | ranks: %d | model: %s", run_dir, world_size(), model_path)
        if world_size() > 1:
            log.info("ranks: %s", peers.describe())

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    check_prompt_lengths(source, tokenizer, cfg)  # over-long prompts: named error or skipped, before any engine
    return _Start(cfg, auto_keys, decision, cache, model_path, source, verifier, eval_verifier, resume_point, tokenizer)


def _build(start: _Start, run_dir: str):
    """The rollout engines, then the DeepSpeed engines and the Trainer (restored from the resume point)."""
    from dsrl.rollout.factory import build_rollout

    cfg, model_path = start.cfg, start.model_path
    # vLLM engines before the models (a colocated engine sizes its memory first); the hf backend
    # after the actor, whose module it shares (built in _build_trainer).
    worker = None
    if cfg.rollout.backend != "hf":
        what = "the Ray-placed vLLM engines" if cfg.rollout.placement == "ray" else "the vLLM rollout engine"
        keys = ("rollout.ray_address, rollout.num_engines, rollout.cpus_per_engine" if cfg.rollout.placement == "ray"
                else "rollout.kv_cache_gib, rollout.gpu_memory_utilization, rollout.max_model_len, rollout.dtype")
        with _starting(what, keys):
            worker = build_rollout(cfg, model_path, run_dir)
    try:
        with _starting("the DeepSpeed engines (actor, reference, teacher, critic)",
                       "actor.zero_stage, actor.micro_batch_size, model.dtype, model.path"):
            trainer = _build_trainer(cfg, model_path, start.cache, worker, start.tokenizer, start.source,
                                     start.verifier, start.decision, run_dir, start.auto_keys,
                                     eval_verifier=start.eval_verifier)
        if start.resume_point is not None:
            trainer.restore(start.resume_point)
        return trainer
    except BaseException:
        if worker is not None:
            worker.close()  # the engine processes must not outlive a failed build
        raise


def _build_trainer(cfg, model_path, cache, worker, tokenizer, source, verifier, decision, run_dir, auto_keys=(),
                   eval_verifier=None):
    """The DeepSpeed engines (actor; reference, teacher and critic when needed) and the Trainer."""
    from dsrl.actor.critic import build_critic
    from dsrl.actor.engine import ActorEngine
    from dsrl.data.chat import apply_chat_template
    from dsrl.setup_assets import resolve_model_path
    from dsrl.trainer import Trainer
    from dsrl.validation.reuse import reuse_for_model

    a, ac, m = cfg.algo, cfg.actor, cfg.model
    common = dict(zero_stage=ac.zero_stage, dtype=m.dtype, attn_implementation=m.attn_implementation,
                  attention_dropout=m.attention_dropout, hidden_dropout=m.hidden_dropout,
                  persistence_threshold=ac.stage3_param_persistence_threshold, temperature=cfg.rollout.temperature)
    actor = ActorEngine(model_path, trainable=True, lr=ac.lr, betas=ac.betas, eps=ac.eps,
                        weight_decay=ac.weight_decay, grad_clip=ac.grad_clip, micro_batch_size=ac.micro_batch_size,
                        gradient_checkpointing=ac.gradient_checkpointing, lora=ac.lora,
                        node_local_checkpoints=cfg.trainer.checkpoint_storage == "node_local", **common)
    decision = reuse_for_model(decision, cfg, actor.module)  # the built modules, before training
    if worker is None:  # rollout.backend=hf: generates with the actor's own module where it can
        from dsrl.rollout.factory import build_rollout

        worker = build_rollout(cfg, model_path, run_dir, actor=actor)
    needs_ref = a.kl_coef != 0 or a.use_kl_loss
    ref = ActorEngine(model_path, trainable=False, role="ref", micro_batch_size=ac.forward_micro_batch_size,
                      **common) if needs_ref and actor.lora is None else None
    if needs_ref and actor.lora is not None:  # actor.lora: the reference is the base, i.e. the adapter disabled
        from dsrl.actor.lora import AdapterOffReference

        ref = AdapterOffReference(actor)
    teacher = ActorEngine(resolve_model_path(m.teacher_path, cache), trainable=False, role="teacher",
                          micro_batch_size=ac.forward_micro_batch_size, **common) if a.use_opd else None
    # algo.advantage_estimator=gae: the value model on its own DeepSpeed engine; None otherwise.
    critic = build_critic(cfg, model_path, dtype=m.dtype, attn_implementation=m.attn_implementation,
                          resolve_path=lambda p: resolve_model_path(p, cache))

    def prompt_ids(p):
        return apply_chat_template(tokenizer, p, cfg.data.system_prompt, cfg.data.chat_template)

    return Trainer(cfg, actor=actor, ref=ref, teacher=teacher, worker=worker, tokenizer=tokenizer, source=source,
                   verifier=verifier, prompt_ids_fn=prompt_ids, decision=decision, run_dir=run_dir, critic=critic,
                   hardware_auto=auto_keys, eval_verifier=eval_verifier)


def _resume_point(cfg, run_dir: str, auto_keys=()):
    """The checkpoint folder to continue from (None: start fresh). Checked against the config
    before any model loads: a change that breaks exact resume is a ConfigError naming the keys.
    `auto_keys`: the machine-dependent keys this run left on auto (dsrl.hardware)."""
    from dsrl.checkpoint import check_resume_compatible, find_latest, read_shared_state

    if cfg.trainer.resume == "off":
        return None
    source = cfg.trainer.resume_from or run_dir
    if cfg.trainer.resume_from and not os.path.isdir(source):
        from dsrl.errors import ConfigError

        raise ConfigError(f"trainer.resume_from={source!r}: no such run folder")
    folder = find_latest(source, cfg.trainer.checkpoint_storage)
    if folder is None:
        if cfg.trainer.resume_from:
            log.warning("trainer.resume_from=%s holds no complete checkpoint: starting fresh", source)
        return None
    shared = read_shared_state(folder)
    check_resume_compatible(shared["config"], shared["world_size"], cfg, folder, auto_now=auto_keys,
                            auto_saved=shared.get("hardware_auto"))
    return folder

@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from dsrl.errors import ConfigError, RunStopped  # not from dsrl.trainer: nothing of the loop loads before validation
    from dsrl.tracking.console import setup_console

    run_dir = HydraConfig.get().runtime.output_dir
    log_paths = setup_console(run_dir, verbose=bool(OmegaConf.select(cfg, "logger.verbose", default=False)))
    try:
        summary = run(cfg, run_dir)
    except ConfigError as e:
        print(f"dsrl: {e}", file=sys.stderr)
        sys.exit(2)
    except StartupError as e:
        print(f"dsrl: {e}", file=sys.stderr)
        sys.exit(1)
    except RuntimeError as e:
        from dsrl.distributed.peers import lost_rank_message

        lost = lost_rank_message(e)  # a peer rank went away: one line naming it and its host
        if lost is None:
            raise
        print(f"dsrl: {lost}", file=sys.stderr)
        sys.exit(1)
    except RunStopped as e:
        print(f"dsrl: stopped by {signal.Signals(e.signum).name} after step {e.step}; "
              f"checkpoint: {e.checkpoint} (resume: trainer.resume_from={os.path.dirname(os.path.dirname(e.checkpoint))})",
              file=sys.stderr)
        sys.exit(128 + e.signum)
    from dsrl.distributed.ranks import is_main_rank

    if is_main_rank():
        log.info("summary: %s", summary)
    _teardown_to_log(log_paths["run_log"])


def _teardown_to_log(run_log) -> None:
    """The summary is the console's last line: what the interpreter's teardown writes to stderr
    after it (nanobind's "leaked ... functions / instances / types" report for Triton's bindings,
    ~30 lines, printed as their modules are freed) goes to run.log instead. Only this process's
    stderr from here on: a failure before the summary still reaches the console."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(run_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, sys.stderr.fileno())
    os.close(fd)


def _strip_launcher_args() -> None:
    """DeepSpeed's launcher appends --local_rank=N, which Hydra's parser rejects; the same value
    is in the LOCAL_RANK environment variable the launcher sets."""
    keep = []
    for arg in sys.argv[1:]:
        if arg.startswith("--local_rank"):
            os.environ.setdefault("LOCAL_RANK", arg.split("=", 1)[1] if "=" in arg else "0")
            continue
        keep.append(arg)
    sys.argv[1:] = keep


if __name__ == "__main__":
    _strip_launcher_args()
    main()
