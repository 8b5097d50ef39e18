"""Scripted stand-ins for the rollout side of `Trainer.step`/`fit` (worker, prompt source,
verifier), for unit tests of the loop's ordering, overlap and dynamic sampling. The Trainer, its
collector (dsrl.rollout.dynamic), the background rollout (dsrl.rollout.overlap), the seeds and
the reward guard are the product's; the training and weight push are replaced per test.

A prompt's text says its rewards: "I<k>" prompts get rewards 0,1,0,1,... (informative), "U<k>"
prompts all 0 (all-equal). The worker returns each sample's reward as its text; the verifier
turns it back into a number."""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import List, Optional

from dsrl.config.schema import Config
from dsrl.data.types import user_prompt
from dsrl.rollout.vllm_engine import Completion
from dsrl.trainer import Trainer
from dsrl.validation.reuse import decide_reuse
from dsrl.validation.validate import validate


class ScriptedSource:
    """Prompts from a fixed script of kinds ("I" or "U"), one per draw, numbered in draw order;
    each draw also consumes one number of the trainer's prompt RNG (so its state is exercised)."""

    def __init__(self, kinds: str):
        self.kinds, self.drawn = kinds, 0

    def sample_train(self, n, rng):
        out = []
        for _ in range(n):
            kind = self.kinds[self.drawn % len(self.kinds)]
            out.append(user_prompt(f"{kind}{self.drawn}:{rng.randrange(1000)}", "x"))
            self.drawn += 1
        return out

    def eval_set(self, n):
        return [user_prompt(f"E{i}", "x") for i in range(n)]


def prompt_ids(p) -> List[int]:
    return [ord(c) for c in p.messages[0]["content"]]


def prompt_text(ids) -> str:
    return "".join(chr(i) for i in ids)


class ScriptedWorker:
    """Records every call in `events` (shared with the test), with the calling thread's name;
    `generate` can be slowed (`delay_s`) or made to fail on its k-th call (`fail_on_call`)."""

    def __init__(self, events: list, *, delay_s: float = 0.0, fail_on_call: Optional[int] = None):
        self.events, self.delay_s, self.fail_on_call = events, delay_s, fail_on_call
        self.calls = 0
        self.generating = 0  # generate calls in progress
        self.lock = threading.Lock()

    def generate(self, ids, *, n, temperature, top_p, max_tokens, show_progress=False, seeds=None):
        with self.lock:
            self.calls += 1
            call, self.generating = self.calls, self.generating + 1
        texts = [prompt_text(x) for x in ids]
        self.events.append(("generate", threading.current_thread().name, texts, list(seeds)))
        try:
            time.sleep(self.delay_s)
            if call == self.fail_on_call:
                raise RuntimeError(f"scripted failure of generate call {call}")
            groups = []
            for text in texts:
                rewards = [float(j % 2) if text.startswith("I") else 0.0 for j in range(n)]
                groups.append([Completion([7, 8, 9][: 1 + j % 3], [-0.5] * (1 + j % 3), "stop", str(r))
                               for j, r in enumerate(rewards)])
            return groups
        finally:
            with self.lock:
                self.generating -= 1
            self.events.append(("generated", threading.current_thread().name, texts))

    def push_weights(self, state, step):
        self.events.append(("push", step, self.generating))
        return 0.0


def make_cfg(*, groups: int = 2, group_size: int = 4, total_steps: int = 3, **algo) -> Config:
    cfg = Config()
    algo = {"n_samples_per_prompt": group_size, "rollout_batch_size": groups, "global_batch_size": groups * group_size,
            "reuse_logprobs": "off", **algo}
    cfg.algo = dataclasses.replace(cfg.algo, **algo)
    cfg.logger = dataclasses.replace(cfg.logger, tensorboard=False, plot=False, progress=False)
    cfg.trainer = dataclasses.replace(cfg.trainer, total_steps=total_steps, eval_before=False, eval_after=False,
                                      save_final=False, save_every=0)
    validate(cfg)
    return cfg


def make_trainer(cfg: Config, run_dir, events: list, *, kinds: str = "IU", delay_s: float = 0.0,
                 fail_on_call: Optional[int] = None, train_s: float = 0.0, hardware_auto=()) -> Trainer:
    """The real Trainer around the scripted rollout side; `train_on` and the weight push record
    what they got (`trainer.trained`: the samples of each step) instead of running engines."""
    tokenizer = type("Tok", (), {"pad_token_id": 0, "eos_token_id": 0})()
    worker = ScriptedWorker(events, delay_s=delay_s, fail_on_call=fail_on_call)
    trainer = Trainer(cfg, actor=None, ref=None, worker=worker, tokenizer=tokenizer, source=ScriptedSource(kinds),
                      verifier=lambda text, p: float(text), prompt_ids_fn=prompt_ids, decision=decide_reuse(cfg), run_dir=str(run_dir),
                      hardware_auto=hardware_auto)
    trainer.trained = []

    def train_on(samples, step):
        events.append(("train", len(trainer.trained) + 1))
        time.sleep(train_s)
        trainer.trained.append(list(samples))
        events.append(("trained", len(trainer.trained)))
        return {}

    def push(step, **kw):
        trainer.worker.push_weights({}, step)
        return {}

    trainer.train_on = train_on
    trainer.weight_sync.push = push
    return trainer
