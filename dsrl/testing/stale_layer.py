"""One decoder layer left stale by a weight push, as the two weight-sync checks read it, on a real
rollout engine: the vLLM stale-layer test (tests/rollout/test_weight_sync_stale.py, CPU) and the
GPU smoke's vLLM level (tests/gpu/vllm_smoke.py, bf16 on CUDA) run the same sequence:

1. the trainer's weights move by `rel_all` of each tensor's spread (MOVES) and are pushed in full: the
   probe (`rollout/sync_logprob_diff`) and the train step's check of the default batch's samples
   (`WeightSync.check_samples`) read the correct sync;
2. decoder layer `layer` moves by `rel_layer` and a push leaves that layer's tensors out (a name
   filter gone wrong): both checks must fail naming the engine;
3. a full push repairs it: both pass again.

Each reading is returned with the error each check raised (None where it passed), so a test can
assert on the messages and the smoke can print PASS/FAIL lines with the figures."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

STALE_LAYER = 15  # the decoder layer left out (of SmolLM2's 30; a model with fewer: its last)
# (rel_all, rel_layer) by dtype: how far the trained policy moved (every tensor) and how far the
# stale layer moved since, in units of each tensor's spread. bf16: SmolLM2, a 20%-stale layer reads
# ~0.14 against the 0.12 tolerance; fp32: the tiny Llama, 5% reads ~0.008 against 1e-3.
MOVES = {"float32": (0.05, 0.05), "bfloat16": (0.01, 0.2)}


def push_leaving_out(sync, actor, layer: int, step: int) -> dict:
    """A push whose export skips every tensor of decoder layer `layer`: the engine keeps that
    layer's previous weights."""
    real = actor.export_named_tensors
    prefix = f"model.layers.{layer}."

    def export(**kw):
        return ((n, t) for n, t in real(**kw) if not n.startswith(prefix))

    actor.export_named_tensors = export
    try:
        return sync.push(step)
    finally:
        del actor.export_named_tensors


def sample_check(actor, worker, prompts, step: int) -> tuple:
    """What the train step's check reads on a batch the engine samples now (8 per prompt,
    temperature 1, top_p 1, 16 tokens): the sum of |trainer - engine| log-prob over the sampled
    tokens and their count (the training forward's rollout/abs_diff_sum and rollout/tokens)."""
    from dsrl.rollout.weight_sync import trainer_probe_logprobs

    outs = worker.generate(prompts, n=8, temperature=1.0, top_p=1.0, max_tokens=16,
                           seeds=[1000 * step + i for i in range(len(prompts))])
    total, count = 0.0, 0
    for prompt, completions in zip(prompts, outs):
        for c in completions:
            if not c.token_ids:
                continue
            mine = trainer_probe_logprobs(actor, [list(prompt) + list(c.token_ids)])[0, len(prompt) - 1:]
            total += float((mine - torch.tensor(c.logprobs, dtype=torch.float32)).abs().sum())
            count += len(c.token_ids)
    return total, count


@dataclasses.dataclass
class StaleLayerReading:
    """Mean |trainer - engine| log-probs (probe over its greedy tokens, samples over the sampled
    tokens) after the correct sync, with the layer stale, and after the repairing push; the error
    each check raised at each stage (None: it passed)."""
    dtype: str
    layer: int
    tolerance: float
    good_probe: float
    good_samples: float
    stale_probe: float
    stale_samples: float
    repaired_probe: float
    repaired_samples: float
    old_probe: float  # the random-token probe (tolerance 0.5 in bf16, 1e-3 in fp32) on the stale engine
    sample_tokens: tuple  # (good, stale, repaired)
    good_probe_error: Optional[str] = None
    good_samples_error: Optional[str] = None
    stale_probe_error: Optional[str] = None
    stale_samples_error: Optional[str] = None
    repaired_probe_error: Optional[str] = None
    repaired_samples_error: Optional[str] = None

    def failures(self) -> list:
        """What a correct check must not do: fail a correct or repaired sync, pass the stale one,
        or sit closer than 2x to the tolerance after a correct sync."""
        out = [f"{k}: {v}" for k, v in (("correct sync, probe", self.good_probe_error),
                                        ("correct sync, samples", self.good_samples_error),
                                        ("repaired, probe", self.repaired_probe_error),
                                        ("repaired, samples", self.repaired_samples_error)) if v]
        out += [f"{k} passed the stale layer ({v:.4g} <= {self.tolerance:g})"
                for k, v, e in (("probe", self.stale_probe, self.stale_probe_error),
                                ("samples", self.stale_samples, self.stale_samples_error)) if e is None]
        out += [f"{k} {v:.4g} above half the tolerance {self.tolerance:g}"
                for k, v in (("correct sync, probe", self.good_probe), ("repaired, probe", self.repaired_probe))
                if v > self.tolerance / 2]
        return out

    def summary(self) -> str:
        return (f"{self.dtype} layer {self.layer} stale (tolerance {self.tolerance:g}): probe {self.good_probe:.4f} -> "
                f"{self.stale_probe:.4f} -> {self.repaired_probe:.4f}; samples {self.good_samples:.4f} -> "
                f"{self.stale_samples:.4f} -> {self.repaired_samples:.4f} ({'/'.join(map(str, self.sample_tokens))} "
                f"tokens); old random-token probe on the stale engine {self.old_probe:.4f}")


def read_stale_layer(actor, worker, dtype: str, model_path) -> StaleLayerReading:
    """Steps 1-3 of the module's docstring on `actor` (ZeRO-0: its parameters are whole) and
    `worker`, both holding `model_path` in `dtype`, with the default rollout config: layer
    STALE_LAYER, the moves of MOVES[dtype], the default job's prompts."""
    from transformers import AutoTokenizer

    from dsrl.config.schema import RolloutConfig
    from dsrl.rollout.weight_sync import (PROBE_PREFIX, WeightSync, WeightSyncError, probe_tokens,
                                          trainer_probe_logprobs)
    from dsrl.testing import default_job_prompts, perturb_weights

    rel_all, rel_layer = MOVES[dtype]
    layer = min(STALE_LAYER, actor.hf_config.num_hidden_layers - 1)
    prompts = default_job_prompts(AutoTokenizer.from_pretrained(str(model_path)))
    sync = WeightSync(actor, worker, dataclasses.replace(RolloutConfig(), dtype=dtype))
    errors, probes, samples = {}, {}, {}

    def checks(stage, push, step):
        try:
            probes[stage] = push(step)["rollout/sync_logprob_diff"]
        except WeightSyncError as e:
            errors[stage + "_probe"] = str(e)
        total, n = sample_check(actor, worker, prompts, step)
        samples[stage] = (total / max(n, 1), n)
        try:
            sync.check_samples(total, n, step)
        except WeightSyncError as e:
            errors[stage + "_samples"] = str(e)

    perturb_weights(actor.module.parameters(), rel_all, 1)  # a trained policy, synced in full
    checks("good", sync.push, 1)
    perturb_weights(actor.module.model.layers[layer].parameters(), rel_layer, 2)
    checks("stale", lambda step: push_leaving_out(sync, actor, layer, step), 2)

    def mean_diff(tokens, start: int) -> float:
        return float((torch.tensor(worker.probe_logprobs(tokens))[:, start:]
                      - trainer_probe_logprobs(actor, tokens)[:, start:]).abs().mean())

    # The stale push's probe raised: its reading again, over the greedy tokens as WeightSync.check
    # scores them; and the old random-token probe (every token) on the same stale engine.
    probes["stale"] = mean_diff(sync.probe_sequences(), PROBE_PREFIX - 1)
    old = mean_diff(probe_tokens(actor.hf_config.vocab_size, n=4, length=16, seed=20261130), 0)
    checks("repaired", sync.push, 3)
    nan = float("nan")
    return StaleLayerReading(
        dtype=dtype, layer=layer, tolerance=sync.tolerance, good_probe=probes.get("good", nan),
        good_samples=samples["good"][0], stale_probe=probes["stale"], stale_samples=samples["stale"][0],
        repaired_probe=probes.get("repaired", nan), repaired_samples=samples["repaired"][0], old_probe=old,
        sample_tokens=tuple(samples[s][1] for s in ("good", "stale", "repaired")),
        **{k + "_error": v for k, v in errors.items()})
