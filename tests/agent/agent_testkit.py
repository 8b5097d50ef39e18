"""Test helpers for dsrl.agent: a scripted environment, a scripted stand-in for the rollout
worker (unit tests of the runner only; the token-identity test uses the real VLLMWorker), and a
call-counting wrapper around any worker."""
from __future__ import annotations

from dsrl.agent.env import StepResult
from dsrl.rollout.vllm_engine import Completion

EPISODE_SEED_STRIDE = 1000  # ScriptedWorker reads (episode, turn) from the request seed


class ScriptedEnv:
    """Answers turn t with "obs {t}" (a user message); done after `done_after` turns with reward
    `final_reward`; each step's reward is `step_reward`. Raises at turn `raise_at` if set."""

    def __init__(self, done_after: int = 3, final_reward: float = 1.0, step_reward: float = 0.0,
                 raise_at: int = -1, system: str = "You are a tester."):
        self.done_after, self.final_reward, self.step_reward = done_after, final_reward, step_reward
        self.raise_at, self.system = raise_at, system
        self.actions = []

    def reset(self, prompt=None, seed=None):
        self.actions = []
        text = prompt if isinstance(prompt, str) else "Start the game."
        return [{"role": "system", "content": self.system}, {"role": "user", "content": text}]

    def step(self, action):
        self.actions.append(action)
        t = len(self.actions)
        if t == self.raise_at:
            raise RuntimeError("scripted failure")
        if t >= self.done_after:
            return StepResult("", self.final_reward, True, {"turn": t})
        return StepResult(f"obs {t}", self.step_reward, False, {"turn": t})


class ScriptedWorker:
    """generate() like VLLMWorker's: the completion of (episode e, turn t) is `texts(e, t)`
    tokenized, followed by the end-of-turn token when `eos(e, t)`, cut at max_tokens; log-prob
    of token k is -(k + 1) / 100 - e (distinct, to check alignment). (e, t) come from the
    request seed e * stride + t."""

    def __init__(self, tokenizer, texts, eos=lambda e, t: True, stride: int = EPISODE_SEED_STRIDE):
        self.tok, self.texts, self.eos, self.stride = tokenizer, texts, eos, stride
        self.calls = []  # (number of prompts, max_tokens) per call
        self.sampled = {}  # (e, t) -> token ids returned

    def generate(self, prompt_ids, *, n, temperature, top_p, max_tokens, show_progress=False, seeds=None, stop=None):
        """max_tokens and stop (strings) may be per prompt, like VLLMWorker's; a stop string ends
        the completion at the token that completes it (that token kept), finish "stop"."""
        assert n == 1 and seeds is not None
        self.calls.append((len(prompt_ids), max_tokens))
        caps = [max_tokens] * len(seeds) if isinstance(max_tokens, int) else list(max_tokens)
        out = []
        for i, s in enumerate(seeds):
            e, t = divmod(int(s), self.stride)
            ids = self.tok(self.texts(e, t), add_special_tokens=False)["input_ids"]
            ids = list(ids) + ([self.tok.eos_token_id] if self.eos(e, t) else [])
            cap, stopped = caps[i], False
            for k in range(len(ids)) if stop and stop[i] else ():
                if any(x in self.tok.decode(ids[:k + 1]) for x in stop[i]):
                    ids, stopped = ids[:k + 1], True
                    break
            finish = "stop" if len(ids) <= cap and (stopped or self.eos(e, t)) else "length"
            ids = ids[:cap]
            self.sampled[(e, t)] = ids
            lps = [-(k + 1) / 100 - e for k in range(len(ids))]
            out.append([Completion(ids, lps, finish, self.tok.decode(ids, skip_special_tokens=True))])
        return out


class CountingWorker:
    """Wraps a worker; records the number of prompts of each generate call and what came back."""

    def __init__(self, worker):
        self.worker = worker
        self.calls = []
        self.returned = []

    def generate(self, prompt_ids, **kwargs):
        self.calls.append(len(prompt_ids))
        out = self.worker.generate(prompt_ids, **kwargs)
        self.returned.append([[list(c.token_ids) for c in g] for g in out])
        return out
