"""Whole-step time of the default job (SmolLM2, 8 prompts x 8 samples, 16 new tokens, the machine's
auto dtype) with every speed-up on against the same job with all of them off, interleaved in one
process, and TRL's GRPOTrainer doing the same work in a process of its own, its steps interleaved
with dsrl's (A B T, T B A rounds) so that all of them see the same machine load.

One trainer, one actor, two rollout engines: each step runs in one mode, the modes alternating
ABBA; the engine not used by a step gets the new weights after it, untimed. Speed-ups:
- actor.shared_prompt=auto (each group's prompt forwarded once) vs off;
- actor.max_tokens_per_microbatch=<budget> (token-budget microbatches) vs 0 (8 samples each);
- algo.reuse_logprobs=auto (no standalone old-policy pass) vs off;
- algo.skip_zero_variance_groups=true (all-equal-reward groups skip the forward) vs false;
- rollout.sync_probe_every=10 (the weight-sync probe on every 10th push; the train step checks the
  pushes between on its sampled tokens) vs 1 (the probe after every push);
- the vLLM-CPU engine defaults of dsrl.rollout.vllm_worker vs the settings used before the engine settings were tuned
  (bench/bench_rollout.py OLD_ENV / OLD_KWARGS).
TRL runs in its own virtual environment (bench.trl_python, default /work/trl-venv/bin/python:
`python -m venv /work/trl-venv && /work/trl-venv/bin/pip install torch==2.13.0 trl==1.16.0
transformers==5.19.0 datasets`); absent: "TRL not installed: skipped"; bench.trl=0 leaves it out.

    make bench-step [ARGS="bench.steps=6 bench.budget=2048 model.dtype=float32 rollout.dtype=float32"]
    make bench-step ARGS="bench.adaptive=4"   # 4 optimizer steps per rollout: reuse_logprobs=adaptive vs off
    make bench-step ARGS="bench.exp=gsm8k_reasoning bench.modes=every,on bench.steps=2"   # 256 tokens
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")
sys.path.insert(0, HERE)
DEFAULTS = ["+exp=grpo_reuse", "trainer.eval_before=false", "trainer.eval_after=false", "trainer.save_final=false",
            "trainer.save_every=0", "logger.progress=false", "logger.plot=false", "logger.tensorboard=false",
            "trainer.total_steps=1000000"]
PHASES = ("rollout", "old_logprobs", "train", "weight_sync")
# "all on": the weight-sync probe on every 10th push, the train step checking the pushes between
# on its own samples (rollout.sync_probe_every); "all off": the probe after every push.
PROBE_EVERY = 10


@contextlib.contextmanager
def old_rollout_settings():
    """Build a vLLM worker with the engine settings dsrl used before the engine settings were tuned: vLLM's own
    multiprocessing, its environment and LLM kwargs of then."""
    import bench_rollout
    from dsrl.rollout import vllm_engine, vllm_worker

    saved = vllm_engine.engine_env, vllm_engine.cpu_llm_kwargs, vllm_worker.resolve_host

    def old_env(kv_cache_gib, local_rank, local_world, *, multiprocess):
        last = (os.cpu_count() or 1) - 1
        today = saved[0](kv_cache_gib, local_rank, local_world, multiprocess=True)  # RPC serialization too
        return {**today, **{k: v.format(last=last) for k, v in bench_rollout.OLD_ENV.items()}}

    def old_kwargs():
        return {"enable_chunked_prefill": bench_rollout.OLD_KWARGS["enable_chunked_prefill"]}
    vllm_engine.engine_env, vllm_engine.cpu_llm_kwargs = old_env, old_kwargs
    vllm_worker.resolve_host = lambda host: "vllm"  # in this process, where the patches apply
    try:
        yield
    finally:
        vllm_engine.engine_env, vllm_engine.cpu_llm_kwargs, vllm_worker.resolve_host = saved


@dataclasses.dataclass
class Mode:
    name: str
    trainer: object  # a whole dsrl Trainer (its own actor, engine, prompt stream from the same seed)
    rows: list = dataclasses.field(default_factory=list)
    step: int = 0


EXP = ["grpo_reuse"]  # the preset every mode is built from (bench.exp=gsm8k_reasoning: 256 tokens)


def build_trainer(overrides, *, old_engine=False):
    from hydra import compose, initialize_config_dir

    from dsrl.main import build

    job = [f"+exp={EXP[0]}" if d == "+exp=grpo_reuse" else d for d in DEFAULTS]
    with initialize_config_dir(config_dir=os.path.abspath(os.path.join(ROOT, "conf")), version_base=None):
        node = compose(config_name="config", overrides=job + list(overrides))
    with old_rollout_settings() if old_engine else contextlib.nullcontext():
        return build(node, tempfile.mkdtemp(prefix="bench_step_"))


# Each mode is a dsrl Trainer of its own, built from the same job and seed.
ALL_ON = ["actor.shared_prompt=auto", "algo.reuse_logprobs=auto", "algo.skip_zero_variance_groups=true",
          f"rollout.sync_probe_every={PROBE_EVERY}"]
MODES = {
    "on": ("all on", ALL_ON),
    # every speed-up on but the zero-variance skip: every sample trained, as TRL does
    "every": ("all on, every sample trained", ALL_ON + ["algo.skip_zero_variance_groups=false"]),
    "off": ("all off", ["actor.max_tokens_per_microbatch=0", "actor.shared_prompt=off", "algo.reuse_logprobs=off",
                        "algo.skip_zero_variance_groups=false", "rollout.sync_probe_every=1"]),
}


def build_modes(overrides, budget, keys=("on", "off")):
    """The chosen modes: every speed-up on, the same with every sample trained, all of them off
    (with the engine settings from before the engine settings were tuned)."""
    out = {}
    for key in keys:
        name, settings = MODES[key]
        if key != "off":
            settings = [f"actor.max_tokens_per_microbatch={budget}"] + settings
        out[key] = Mode(name, build_trainer(settings + list(overrides), old_engine=key == "off"))
    return out


def build_adaptive_modes(overrides, budget, k):
    """algo.num_steps_per_rollout=k: reuse_logprobs=adaptive (rollout log-probs + probe) against the
    full old-policy pass (off), every other speed-up on in both."""
    common = [f"actor.max_tokens_per_microbatch={budget}", "actor.shared_prompt=auto",
              "algo.skip_zero_variance_groups=true", f"algo.num_steps_per_rollout={k}",
              f"algo.global_batch_size={64 // k}"]
    return {"on": Mode("adaptive", build_trainer(common + ["algo.reuse_logprobs=adaptive"] + list(overrides))),
            "off": Mode("full pass", build_trainer(common + ["algo.reuse_logprobs=off"] + list(overrides)))}


def run_dsrl(overrides, steps, budget, adaptive=0, trl=None, keys=("on", "off")):
    """Rounds of one step per mode (A B C, C B A, ...); with `trl` (a TRLLockstep started on the
    first round), one TRL step per round too, among dsrl's, so all of them see the same load."""
    modes = build_adaptive_modes(overrides, budget, adaptive) if adaptive else build_modes(overrides, budget, keys)
    cfg = next(iter(modes.values())).trainer.cfg
    order = list(modes) + (["trl"] if trl is not None else [])
    trl_rows = []
    try:
        if trl is not None:
            trl.start(cfg, steps + 1)
        for k in range(steps + 1):  # round 0 warms every mode up
            for key in (order if k % 2 == 0 else order[::-1]):
                if key == "trl":
                    t = trl.step()
                    if k:
                        trl_rows.append(t)
                    print(f"TRL step {'(warm-up) ' if not k else ''}step={t:.2f}s", flush=True)
                    continue
                mode = modes[key]
                mode.step += 1
                m = mode.trainer.step(mode.step)
                row = {p: m.get(f"timing/{p}", 0.0) for p in PHASES}
                row["step"] = m["timing/step"]
                if k:
                    mode.rows.append(row)
                print(f"step {mode.step:2d} {mode.name:<9} {'(warm-up) ' if not k else ''}"
                      + " ".join(f"{p}={row[p]:.2f}s" for p in ("step", *PHASES))
                      + f" reward={m.get('reward/mean', 0):.3f} length={m.get('rollout/response_length', 0):.0f}",
                      flush=True)
    finally:
        for mode in modes.values():
            with contextlib.suppress(Exception):
                mode.trainer.worker.close()
        if trl is not None:
            trl.close()
    dtype, tokens = cfg.model.dtype, cfg.rollout.max_new_tokens
    for mode in modes.values():
        mode.trainer = None
    gc.collect()
    med = {key: {p: statistics.median(r[p] for r in mode.rows) for p in ("step", *PHASES)}
           for key, mode in modes.items()}
    job = f"algo.num_steps_per_rollout={adaptive}" if adaptive else f"{cfg.name} job"
    print(f"\n== whole step, {job} ({dtype}, {tokens} new tokens), medians of {steps} steps per mode, "
          "interleaved ==")
    for key, mode in modes.items():
        print(f"{mode.name:<9} step {med[key]['step']:.2f}s  ("
              + ", ".join(f"{p} {med[key][p]:.2f}s" for p in PHASES) + ")")
    for key in (k for k in ("on", "every") if k in med and "off" in med):
        print(f"ratio step time, {modes[key].name} / {modes['off'].name}: {med[key]['step'] / med['off']['step']:.3f}")
    if trl_rows:
        trl_step = statistics.median(trl_rows)
        print(f"\n== dsrl vs TRL {trl.version} GRPOTrainer, same work ({dtype}, "
              f"{cfg.algo.rollout_batch_size}x{cfg.algo.n_samples_per_prompt} samples, {tokens} tokens), "
              "steps interleaved ==")
        print(f"TRL step {trl_step:.2f}s (median of {len(trl_rows)}: {' '.join(f'{t:.1f}' for t in trl_rows)})")
        for key, mode in modes.items():
            print(f"ratio dsrl ({mode.name}) / TRL at {tokens} tokens: {med[key]['step'] / trl_step:.3f}"
                  + ("  (goal: <= 0.25)" if key == "every" else ""))
    return med, dtype


def trl_prompts(cfg, n_prompts):
    """The job's prompts (its data source and system prompt, the same stream seed) as chat messages."""
    import random

    from dsrl.data.chat import build_messages
    from dsrl.data.registry import make_source

    prompts = make_source(cfg.data.name).sample_train(n_prompts, random.Random(cfg.data.seed))
    return [{"messages": build_messages(p, cfg.data.system_prompt), "answer": str(p.answer)} for p in prompts]


class TRLLockstep:
    """TRL's GRPOTrainer in its own virtual environment (bench/trl_grpo_step.py), one optimizer
    step per `step()` call: the process waits on stdin between steps."""

    def __init__(self, python):
        self.python, self.proc, self.version = python, None, "?"

    def start(self, cfg, steps):
        """TRL on the job's work: its model, dtype, data and verifier (arith: the first number,
        gsm8k: the last one), group size, prompts per step, new tokens, lr and temperature."""
        from dsrl.setup_assets import default_cache_dir, resolve_model_path

        out = tempfile.mkdtemp(prefix="bench_trl_")
        a = cfg.algo
        spec = {"model": resolve_model_path(cfg.model.path, str(default_cache_dir())), "dtype": cfg.model.dtype,
                "steps": steps, "n_samples": a.n_samples_per_prompt, "prompts_per_step": a.rollout_batch_size,
                "micro_batch_size": cfg.actor.micro_batch_size, "max_tokens": cfg.rollout.max_new_tokens,
                "temperature": cfg.rollout.temperature, "lr": cfg.actor.lr, "reward": cfg.data.name,
                "threads": os.cpu_count() or 2, "lockstep": True,
                "prompts": trl_prompts(cfg, a.rollout_batch_size * steps), "output_dir": out}
        if spec["reward"] not in ("arith", "gsm8k"):
            raise SystemExit(f"bench_step: TRL's side has rewards for data.name=arith and gsm8k, not {spec['reward']}")
        path = os.path.join(out, "spec.json")
        with open(path, "w") as f:
            json.dump(spec, f)
        # Without dsrl's torch.distributed variables: TRL would bind this process's (still held) store port.
        env = {k: v for k, v in os.environ.items()
               if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
        self.log = open(os.path.join(out, "stderr.log"), "w")
        self.proc = subprocess.Popen([self.python, os.path.join(HERE, "trl_grpo_step.py"), path], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)
        self.version = subprocess.run([self.python, "-c", "import trl; print(trl.__version__)"], capture_output=True,
                                      text=True, env=env).stdout.strip() or "?"

    def step(self) -> float:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith('{"step_seconds": ') and not line.startswith('{"step_seconds": ['):
                return float(json.loads(line)["step_seconds"])
        raise RuntimeError(f"TRL exited (rc {self.proc.wait()}); its stderr: {self.log.name}")

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(Exception):
                self.proc.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=60)
            if self.proc.poll() is None:
                self.proc.kill()


def main(argv) -> int:
    opts = {"steps": 4, "budget": 2048, "trl": 1, "adaptive": 0}
    trl_python = "/work/trl-venv/bin/python"
    keys = ("on", "off")
    overrides = []
    for a in argv:
        key, _, value = a.partition("=")
        if key == "bench.trl_python":
            trl_python = value
        elif key == "bench.exp":
            EXP[0] = value
        elif key == "bench.modes":
            keys = tuple(value.split(","))
            if not keys or any(k not in MODES for k in keys):
                raise SystemExit(f"bench.modes={value}: a comma-separated subset of {', '.join(MODES)}")
        elif key.startswith("bench."):
            if key[6:] not in opts:
                raise SystemExit(f"unknown option {key} (known: bench.trl_python, bench.modes, bench.exp, "
                                 f"{', '.join('bench.' + k for k in opts)})")
            opts[key[6:]] = int(value)
        else:
            overrides.append(a)
    from bench_rollout import machine_line

    print(f"machine: {machine_line()}", flush=True)
    trl = None
    if opts["trl"] and not opts["adaptive"]:
        if os.path.exists(trl_python):
            trl = TRLLockstep(trl_python)
        else:
            print(f"TRL not installed: skipped ({trl_python} not found)")
    run_dsrl(overrides, opts["steps"], opts["budget"], opts["adaptive"], trl, keys)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
