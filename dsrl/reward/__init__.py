"""Rule-based verifiers: `fn(completion_text, prompt) -> float`, looked up by name.

    fn = verifier_for_source(source)        # the source's default verifier
    rewards = score(fn, completions, prompts)

Importing this package registers the built-in verifiers (dsrl.reward.verifiers is imported
here, so dsrl.reward.registry imports no verifier module).
"""
from dsrl.reward.registry import (VERIFIERS, Verifier, as_verifier, get_verifier, register_verifier, score,
                                  verifier_for_source, verifier_names)
from dsrl.reward.verifiers import arith_exact, find_numbers, gsm8k_last_number, normalize_number
from dsrl.reward.reasoning_gym import reasoning_gym_score

__all__ = ["VERIFIERS", "Verifier", "as_verifier", "get_verifier", "register_verifier", "score",
           "verifier_for_source", "verifier_names", "arith_exact", "gsm8k_last_number",
           "find_numbers", "normalize_number", "reasoning_gym_score"]
