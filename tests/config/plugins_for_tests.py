"""User plug-ins named by dotted path in the config tests (`plugins_for_tests.<name>` with this
folder on sys.path). Importing this module registers nothing, so importing it twice (under two
module names) is harmless; tests that need a registered name register and remove it themselves."""
from __future__ import annotations

import torch

from dsrl.data.registry import as_random
from dsrl.data.types import Prompt, user_prompt
from dsrl.loss.types import LossOutput


def reinforce_objective(inputs):
    """Plain REINFORCE: aggregate of -A * log p (no ratio, so no old-policy log-probs)."""
    adv = inputs.batch["advantages"]
    loss = inputs.reduce(-adv * inputs.log_probs)
    return LossOutput(loss=loss, metrics={"loss": loss.detach()})


# Spec fields declared on the function; undeclared ones keep the conservative defaults.
reinforce_objective.needs_old_log_probs = False
reinforce_objective.skip_zero_advantage_exact = True
reinforce_objective.required_inputs = ("advantages",)


def bare_objective(inputs):
    """An objective that declares nothing: the registry must assume the conservative spec."""
    return LossOutput(loss=inputs.reduce(-inputs.log_probs))


def best_of_group(rewards, mask, group_ids, config, kl=None):
    """Advantage 1 for the best sample of each group of n_samples_per_prompt, 0 otherwise."""
    k = int(config["n_samples_per_prompt"])
    groups = rewards.view(-1, k)
    best = (groups == groups.max(dim=1, keepdim=True).values).to(rewards.dtype).view(-1)
    adv = best[:, None] * mask.to(rewards.dtype)
    return adv, adv.clone()


def reward_minus_kl(rewards, mask, group_ids, config, kl=None):
    """A_t = r - kl_coef * kl_t on trainable tokens: folds KL into the reward."""
    m = mask.to(rewards.dtype)
    adv = (rewards[:, None] - float(config["kl_coef"]) * kl.to(rewards.dtype)) * m
    return adv, adv.clone()


reward_minus_kl.uses_kl_in_reward = True


def halve_correction(pg_loss, train_log_probs, rollout_log_probs, mask, config):
    """A TIS function that halves the per-token loss and keeps every token."""
    return pg_loss * 0.5, mask, {"tis": torch.full_like(pg_loss, 0.5)}


def length_verifier(completion_text, prompt):
    """1.0 when the completion's length equals the reference answer as an integer."""
    return float(len(completion_text.strip()) == int(prompt.answer))


class LetterCountSource:
    """Prompts 'how many letters in <word>?'; the answer is the length. Default verifier: a
    dotted path, so the reward side resolves it like any other plug-in."""

    default_verifier = "plugins_for_tests.length_verifier"
    words = ("cat", "horse", "ox", "zebra", "giraffe", "yak", "mouse", "lion")

    def __init__(self, seed: int = 0, max_len: int = 100):
        self.seed, self.max_len = seed, max_len

    def _prompt(self, word: str) -> Prompt:
        return user_prompt(f"How many letters are in '{word}'?", str(len(word)), task="letters")

    def sample_train(self, n, rng):
        r = as_random(rng)
        return [self._prompt(r.choice(self.words[:6])) for _ in range(n)]

    def eval_set(self, n):
        return [self._prompt(w) for w in self.words[6:][:n]]


class SourceWithoutVerifier(LetterCountSource):
    default_verifier = None


class NotASource:
    """Has no sample_train / eval_set."""


NOT_CALLABLE = 3
