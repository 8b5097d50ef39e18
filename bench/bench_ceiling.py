"""How far the default job's phases are from what this machine can do, measured in one run.

- Ceiling: the matrix multiplies a phase runs, replayed alone. One untimed pass of the phase is
  recorded under a torch dispatch mode (every aten mm / addmm / bmm / baddbmm with its shapes,
  operand layout and dtype, backward included); each distinct shape is then timed on its own
  (fresh tensors, same dtype and layout, the trainer's threads) and the ceiling time is
  sum(count x time) over the shapes. `train phase: 0.NN of the ceiling` is that ceiling time over
  the phase's measured time (median of bench.rounds), i.e. achieved matmul FLOP/s over the
  machine's matmul FLOP/s at those very shapes. Matmul FLOPs are 2*M*K*N (attention's bmm
  included, eager attention); torch's FlopCounterMode total is printed beside them.
- The reference table: bf16 and fp32 TFLOP/s at the model's layer shapes (q/o, k/v, MLP up and
  down, LM head) at the step's microbatch token count.
- Train phase: the policy update of the default job (timing/train: packing, forward/backward of
  every microbatch, the optimizer step). Scoring: the standalone old-policy forward
  (Trainer.scoring.score), which the default job skips under reuse, measured all the same.
- Rollout: dsrl's rollout stage (prompts, generation, rewards, samples) against the same engine's
  plain `LLM.generate` on the same requests (same prompts, n, seeds, max_tokens), rounds
  interleaved A B B A, generated tokens/s of each; the engine is closed before the trainer is
  measured so it does not compete for the cores.
- bench.profile=1: one more policy update under torch.profiler: the top operators by self CPU
  time, and the time of dsrl's functions and the DeepSpeed calls they make (record_function
  ranges around them; inclusive).

    make bench-ceiling                                   # SmolLM2, default job, 3 rounds
    make bench-ceiling ARGS="bench.profile=1"            # and the profile of one train phase
    python bench/bench_ceiling.py model.path=tiny bench.rounds=1 bench.rollout=0   # quick
"""
from __future__ import annotations

import collections
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULTS = ["+exp=grpo_reuse", "trainer.eval_before=false", "trainer.eval_after=false", "trainer.save_final=false",
            "trainer.save_every=0", "logger.progress=false", "logger.plot=false", "logger.tensorboard=false"]


def _parse(argv):
    opts = {"rounds": 3, "profile": 0, "rollout": 1, "top": 15}
    overrides = []
    for a in argv:
        if a.startswith("bench."):
            k, v = a[len("bench."):].split("=", 1)
            if k not in opts:
                raise SystemExit(f"unknown option bench.{k} (known: {', '.join('bench.' + o for o in opts)})")
            opts[k] = int(v)
        else:
            overrides.append(a)
    return opts, overrides


# ---------------------------------------------------------------------------------------------- matmuls
def _layout(t) -> str:
    """'N' for a row-major matrix (last stride 1), 'T' for a transposed view, 'C' otherwise."""
    if t.stride(-1) == 1:
        return "N"
    if t.stride(-2) == 1:
        return "T"
    return "C"


class MatmulRecorder:
    """A TorchDispatchMode (built lazily: torch imports late) counting every matrix multiply by
    (op, batch, M, K, N, layouts, dtype)."""

    def __new__(cls):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        aten = torch.ops.aten
        operands = {aten.mm.default: (0, 1), aten.addmm.default: (1, 2), aten.bmm.default: (0, 1),
                    aten.baddbmm.default: (1, 2)}

        class _Recorder(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.counts = collections.Counter()

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                where = operands.get(func)
                if where is not None:
                    a, b = args[where[0]], args[where[1]]
                    batch = a.shape[0] if a.dim() == 3 else 0
                    m, k = a.shape[-2:]
                    n = b.shape[-1]
                    self.counts[(func.__name__.split(".")[0], batch, m, k, n, _layout(a), _layout(b), a.dtype)] += 1
                return func(*args, **(kwargs or {}))

        return _Recorder()


def matmul_flops(key) -> float:
    _, batch, m, k, n = key[:5]
    return 2.0 * max(batch, 1) * m * k * n


def _operand(shape, layout, dtype):
    import torch

    if layout == "T":  # a transposed view of a row-major buffer
        return torch.randn(*shape[:-2], shape[-1], shape[-2], dtype=torch.float32).to(dtype).transpose(-1, -2)
    return torch.randn(*shape, dtype=torch.float32).to(dtype)


def time_matmul(key, min_seconds: float = 0.05) -> float:
    """Seconds of one multiply of this shape, layout and dtype: after a warm-up call, 5 timed
    loops of enough calls to fill `min_seconds` together; the median loop's time per call (a
    loop, not single calls, so one preemption on a shared machine moves one sample only)."""
    import torch

    op, batch, m, k, n, la, lb, dtype = key
    lead = (batch,) if batch else ()
    a, b = _operand((*lead, m, k), la, dtype), _operand((*lead, k, n), lb, dtype)
    f = torch.bmm if batch else torch.mm
    f(a, b)
    t0 = time.perf_counter()
    f(a, b)
    once = max(time.perf_counter() - t0, 1e-7)
    calls = max(1, min(100, int(min_seconds / 5 / once)))
    per_call = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            f(a, b)
        per_call.append((time.perf_counter() - t0) / calls)
    return statistics.median(per_call)


def ceiling(counts) -> tuple:
    """(matmul FLOPs, seconds the multiplies take replayed alone) of a recorded phase."""
    flops = sum(matmul_flops(k) * c for k, c in counts.items())
    seconds = sum(time_matmul(k) * c for k, c in counts.items())
    return flops, seconds


def recorded(fn):
    """Run `fn` once under the recorder and torch's FlopCounterMode: (result, counts, all FLOPs)."""
    from torch.utils.flop_counter import FlopCounterMode

    rec = MatmulRecorder()
    with FlopCounterMode(display=False) as fc, rec:
        out = fn()
    return out, rec.counts, float(fc.get_total_flops())


def layer_table(hf_config, tokens: int, resp_tokens: int, dtypes) -> list:
    """(name, M, K, N, {dtype: TFLOP/s}) at the model's layer shapes."""
    h, inter = hf_config.hidden_size, hf_config.intermediate_size
    head_dim = h // hf_config.num_attention_heads
    kv = head_dim * getattr(hf_config, "num_key_value_heads", hf_config.num_attention_heads)
    shapes = [("attention q/o", tokens, h, h), ("attention k/v", tokens, h, kv), ("MLP gate/up", tokens, h, inter),
              ("MLP down", tokens, inter, h), ("LM head (response positions)", resp_tokens, h, hf_config.vocab_size)]
    rows = []
    for name, m, k, n in shapes:
        rates = {}
        for dt in dtypes:
            key = ("mm", 0, m, k, n, "N", "T", dt)  # nn.Linear: x @ W^T
            rates[dt] = matmul_flops(key) / time_matmul(key, 0.2) / 1e12
        rows.append((name, m, k, n, rates))
    return rows


# ---------------------------------------------------------------------------------------------- phases
def rollout_rates(trainer, rounds: int) -> dict:
    """Generated tokens/s of dsrl's rollout stage and of the engine's plain generate on the same
    requests (A B B A ...)."""
    from vllm import SamplingParams

    from dsrl.rollout.seeds import request_seeds

    cfg, a = trainer.cfg, trainer.cfg.algo
    vllm_worker = trainer.worker.worker  # ResilientWorker -> VLLMWorker (its engine's own run: no dsrl stage)
    rows = {"dsrl": [], "engine": []}

    def stage(step):
        t0 = time.perf_counter()
        out = trainer.rollout._rollout(step, weights_step=0, show_progress=False)
        seconds = time.perf_counter() - t0
        prompts = [s.prompt_ids for s in out.samples[::a.n_samples_per_prompt]]
        return out.length_sum / seconds, prompts, out.length_sum

    def engine(step, prompts):
        seeds = request_seeds(cfg.rollout.seed, step, 0, len(prompts), 0)
        params = [SamplingParams(n=a.n_samples_per_prompt, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                 max_tokens=cfg.rollout.max_new_tokens, logprobs=0, seed=int(s)) for s in seeds]
        t0 = time.perf_counter()
        outs = vllm_worker.run([{"prompt_token_ids": list(p)} for p in prompts], params)
        seconds = time.perf_counter() - t0
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        return tokens / seconds, tokens

    _, prompts, _ = stage(1)  # warm-up
    step_of_prompts = 1
    for r in range(rounds):
        # Even rounds: dsrl's stage, then the engine on its requests; odd rounds: the engine on the
        # last stage's requests first, then the stage (each runner goes first half the time).
        if r % 2 == 0:
            rate, prompts, tokens = stage(r + 2)
            step_of_prompts = r + 2
            e_rate, e_tokens = engine(step_of_prompts, prompts)
        else:
            e_rate, e_tokens = engine(step_of_prompts, prompts)
            rate, prompts, tokens = stage(r + 2)
            step_of_prompts = r + 2
        rows["dsrl"].append(rate)
        rows["engine"].append(e_rate)
        print(f"rollout round {r + 1}: dsrl stage {rate:7.1f} tok/s ({tokens} tokens)   engine generate "
              f"{e_rate:7.1f} tok/s ({e_tokens} tokens)", flush=True)
    return {k: statistics.median(v) for k, v in rows.items()}


def train_once(trainer, samples, step) -> dict:
    """One train phase on the same samples. The engine is closed: the push that follows each step
    in the job is only marked (the reuse guard then accepts the next training forward as the
    rollout's policy, as it does in the job)."""
    trainer.actor.weights_pushed()
    return trainer.train_on(samples, step)


def timed_train(trainer, samples, step) -> float:
    trainer.timer.pop()
    train_once(trainer, samples, step)
    return trainer.timer.pop()["timing/train"]


def timed_score(trainer, samples) -> float:
    t0 = time.perf_counter()
    trainer.scoring.score(trainer.actor, samples, "bench scoring")
    return time.perf_counter() - t0


def _labelled(trainer):
    """(owner, attribute, label) of the calls the profile names: dsrl's functions of the train
    phase and the DeepSpeed calls they make, each wrapped in a torch.profiler record_function."""
    import dsrl.actor.engine as engine_module
    import dsrl.stages.policy as policy_module

    actor, ds = trainer.actor, trainer.actor.engine
    out = [(policy_module, "pack_microbatches", "dsrl.rollout.samples.pack_microbatches"),
           (policy_module, "pad_to_largest_rank", "dsrl.actor.batch.pad_to_largest_rank"),
           (actor, "forward_backward", "dsrl ActorEngine.forward_backward"),
           (actor, "target_logprobs", "dsrl ActorEngine.target_logprobs (model forward + log-probs)"),
           (engine_module, "token_logprobs", "dsrl.actor.logprobs.token_logprobs (log-softmax, forward)"),
           (ds, "forward", "deepspeed engine forward (the HF model)"),
           (ds, "backward", "deepspeed engine backward (autograd + grad hooks)"),
           (actor, "optimizer_step", "dsrl ActorEngine.optimizer_step"),
           (engine_module, "guarded_step", "dsrl.actor.nonfinite.guarded_step (finite check + step)")]
    opt = getattr(ds, "optimizer", None)
    for name in ("backward_prologue", "backward_epilogue", "step"):
        if opt is not None and hasattr(opt, name):
            out.append((opt, name, f"deepspeed {type(opt).__name__}.{name}"))
    return out


def profile_train(trainer, samples, step, top: int) -> None:
    """One policy update under torch.profiler: the top operators by self CPU time, and the
    labelled dsrl / DeepSpeed calls (record_function ranges; inclusive time, nested ranges overlap)."""
    import functools

    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    wrapped = []
    for owner, attr, label in _labelled(trainer):
        fn = getattr(owner, attr)

        def labelled(*args, _fn=fn, _label=label, **kwargs):
            with record_function(_label):
                return _fn(*args, **kwargs)
        setattr(owner, attr, functools.wraps(fn)(labelled))
        wrapped.append((owner, attr, fn))
    try:
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            train_once(trainer, samples, step)
        wall = time.perf_counter() - t0
    finally:
        for owner, attr, fn in reversed(wrapped):
            if isinstance(owner, type(os)):  # a module: put the function back
                setattr(owner, attr, fn)
            else:  # an instance: drop the instance attribute (the class's method shows through)
                delattr(owner, attr)
    events = prof.key_averages()
    labels = {label for _, _, label in _labelled(trainer)}
    ops = [e for e in events if e.key not in labels]
    total = sum(e.self_cpu_time_total for e in ops)
    print(f"\n== profile of one train phase ({wall:.2f} s under the profiler): top {top} operators by self "
          f"CPU time (all operators: {total / 1e6:.2f} s) ==")
    for e in sorted(ops, key=lambda e: -e.self_cpu_time_total)[:top]:
        print(f"{e.self_cpu_time_total / 1e6:7.3f} s  {100 * e.self_cpu_time_total / total:5.1f}%  "
              f"calls {e.count:6d}  {e.key}")
    print(f"\n== the same train phase by dsrl function and the DeepSpeed calls it makes (inclusive CPU time) ==")
    for e in sorted((e for e in events if e.key in labels), key=lambda e: -e.cpu_time_total):
        print(f"{e.cpu_time_total / 1e6:7.3f} s  {100 * e.cpu_time_total / total:5.1f}%  calls {e.count:4d}  {e.key}")


def _tf(flops, seconds) -> str:
    return f"{flops / seconds / 1e12:.3f} TFLOP/s"


def main(argv) -> int:
    opts, overrides = _parse(argv)
    import torch
    from hydra import compose, initialize_config_dir

    from dsrl.main import build

    with initialize_config_dir(config_dir=os.path.abspath(os.path.join(HERE, "..", "conf")), version_base=None):
        node = compose(config_name="config", overrides=DEFAULTS + overrides)
    trainer = build(node, tempfile.mkdtemp(prefix="bench_ceiling_"))
    cfg = trainer.cfg
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[cfg.model.dtype]
    try:
        rates = rollout_rates(trainer, opts["rounds"]) if opts["rollout"] else None
        samples = trainer.rollout._rollout(1, weights_step=0, show_progress=False).samples
    finally:
        trainer.worker.close()
    resp = [len(s.response_ids) for s in samples]
    print(f"data: {len(samples)} samples, response lengths {min(resp)}-{max(resp)}; dtype {cfg.model.dtype}, "
          f"attention {cfg.model.attn_implementation}, trainer threads {torch.get_num_threads()}, "
          f"shared_prompt {cfg.actor.shared_prompt}, max_tokens_per_microbatch {cfg.actor.max_tokens_per_microbatch}",
          flush=True)

    step = 1
    timed_train(trainer, samples, step)  # warm-up (allocator, kernels, DeepSpeed's first step)
    timed_score(trainer, samples)
    step += 1
    _, train_counts, train_all = recorded(lambda: train_once(trainer, samples, step))
    _, score_counts, score_all = recorded(lambda: trainer.scoring.score(trainer.actor, samples, "bench"))
    train_t, score_t = [], []
    for r in range(opts["rounds"]):
        step += 1
        pair = [("train", lambda: timed_train(trainer, samples, step)), ("score", lambda: timed_score(trainer, samples))]
        for name, fn in (pair if r % 2 == 0 else pair[::-1]):
            (train_t if name == "train" else score_t).append(fn())
        print(f"round {r + 1}: train phase {train_t[-1]:.2f} s, scoring forward {score_t[-1]:.2f} s", flush=True)
    train_s, score_s = statistics.median(train_t), statistics.median(score_t)

    hf = trainer.actor.hf_config  # the tokens of a training microbatch: M of the forward's MLP up-projection
    ups = collections.Counter({k[2]: c for k, c in train_counts.items()
                               if k[3] == hf.hidden_size and k[4] == hf.intermediate_size and k[5] == "N"})
    tokens = ups.most_common(1)[0][0] if ups else 1024
    resp_tokens = sum(resp)
    print(f"\n== matrix-multiply ceiling on {torch.get_num_threads()} threads (TFLOP/s at the model's shapes, "
          f"{tokens} tokens per microbatch, LM head on {resp_tokens} response positions) ==")
    table = layer_table(trainer.actor.hf_config, tokens, resp_tokens, (torch.bfloat16, torch.float32))
    print(f"{'shape':30s} {'M x K x N':>22s} {'bf16':>8s} {'fp32':>8s}")
    for name, m, k, n, r in table:
        print(f"{name:30s} {f'{m} x {k} x {n}':>22s} {r[torch.bfloat16]:8.3f} {r[torch.float32]:8.3f}")

    out = {}
    for name, counts, all_flops, seconds in (("train phase", train_counts, train_all, train_s),
                                             ("scoring forward", score_counts, score_all, score_s)):
        flops, ceil_s = ceiling(counts)
        out[name] = ceil_s / seconds
        print(f"\n{name}: {seconds:.3f} s measured; {sum(counts.values())} multiplies in {len(counts)} shapes, "
              f"{flops / 1e12:.3f} TFLOP ({all_flops / 1e12:.3f} TFLOP counted by FlopCounterMode); achieved "
              f"{_tf(flops, seconds)}; the multiplies alone {ceil_s:.3f} s ({_tf(flops, ceil_s)})")
    print(f"\ntrain phase: {out['train phase']:.2f} of the ceiling")
    print(f"scoring forward: {out['scoring forward']:.2f} of the ceiling")
    if rates:
        print(f"rollout: {rates['dsrl'] / rates['engine']:.2f} of the engine's own rate "
              f"({rates['dsrl']:.1f} against {rates['engine']:.1f} generated tokens/s)")
    if opts["profile"]:
        profile_train(trainer, samples, step + 1, opts["top"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
