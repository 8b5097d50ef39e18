"""Built-in addition task: "Compute 3 + 5. Respond with the result only."

Difficulty knobs: `digits` per operand (1 -> operands 0-9; d >= 2 -> operands with exactly d
digits, 10^(d-1) .. 10^d - 1) and `num_operands`.

Held-out split: a problem is identified by its sorted operand tuple (3 + 5 and 5 + 3 are the same
problem and fall on the same side). A fixed, seed-independent hash sends a fraction
`eval_fraction` of problems to the held-out side; the training stream never draws those. For
small spaces (e.g. 1-digit: 55 problems, 100 ordered prompts) the split is exact over the
enumerated space; for large ones it is by hash threshold. The held-out pool of a small space
can be smaller than the requested eval size (1-digit sums: 28 prompts): `eval_set(n)` then
returns the whole pool followed by training problems asked with a phrasing the training stream
never uses (`eval_template`, meta split "eval-rephrased"), so the n prompts are all unseen
strings; the pool prompts come first and stay identical whatever n is.
"""
from __future__ import annotations

import hashlib
import itertools
import random
from typing import Optional

from dsrl.data.registry import RngLike, as_random, register_source
from dsrl.data.types import Prompt

# Enumerate the ordered operand space when it has at most this many tuples.
_ENUMERATE_LIMIT = 200_000
_SALT = b"dsrl-arith-split-v1"
_HASH_SCALE = 2**64


def _problem_hash(key: tuple) -> float:
    h = hashlib.blake2b(_SALT + ",".join(map(str, key)).encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") / _HASH_SCALE


@register_source("arith")
class ArithSource:
    default_verifier = "arith"
    # Measured with SmolLM2-135M-Instruct greedy over all 100 one-digit pairs: 85% (vs 63% for
    # "What is {expr}? Answer with just the number.", whose answers drift into chatter).
    template = "Compute {expr}. Respond with the result only."
    # Eval-only phrasing (75% greedy with the same model), used past the held-out problem pool.
    eval_template = "What is {expr}? Reply with only the final number, nothing else."

    def __init__(self, digits: int = 1, num_operands: int = 2, eval_fraction: Optional[float] = None):
        eval_fraction = 0.3 if eval_fraction is None else eval_fraction  # null data.eval_fraction: 0.3
        if digits < 1:
            raise ValueError(f"data.digits must be >= 1, got {digits}")
        if num_operands < 2:
            raise ValueError(f"data.num_operands must be >= 2, got {num_operands}")
        if not 0.0 < eval_fraction < 1.0:
            raise ValueError(f"data.eval_fraction must be in (0, 1), got {eval_fraction}")
        self.digits = int(digits)
        self.num_operands = int(num_operands)
        self.eval_fraction = float(eval_fraction)
        self.lo = 0 if digits == 1 else 10 ** (digits - 1)
        self.hi = 10 ** digits - 1
        size = (self.hi - self.lo + 1) ** self.num_operands
        self.enumerated = size <= _ENUMERATE_LIMIT
        self._train_tuples: Optional[list] = None
        self._eval_tuples: Optional[list] = None
        self._heldout_keys: Optional[frozenset] = None
        if self.enumerated:
            self._split_enumerated()

    @classmethod
    def check_config(cls, d) -> list:
        """This task's own `data` keys, each error naming its key (run by validate.py)."""
        errors = []
        if d.digits < 1:
            errors.append(f"data.digits={d.digits} must be >= 1")
        if d.num_operands < 2:
            errors.append(f"data.num_operands={d.num_operands} must be >= 2 (a sum of at least two numbers)")
        return errors

    # ---------------------------------------------------------------- split
    def _split_enumerated(self) -> None:
        rng_vals = range(self.lo, self.hi + 1)
        keys = list(itertools.combinations_with_replacement(rng_vals, self.num_operands))
        keys.sort(key=_problem_hash)
        n_held = max(1, round(self.eval_fraction * len(keys)))
        if n_held >= len(keys):
            n_held = len(keys) - 1
        held = frozenset(keys[:n_held])
        self._heldout_keys = held
        train, evals = [], []
        for t in itertools.product(rng_vals, repeat=self.num_operands):
            (evals if tuple(sorted(t)) in held else train).append(t)
        self._train_tuples = train
        # Deterministic eval order: one ordering of every held-out problem first (so a short
        # eval set covers distinct problems), then the other orderings; problems by hash.
        rank = {}
        for t in sorted(evals):
            k = tuple(sorted(t))
            rank[t] = rank.get(("n",) + k, 0)
            rank[("n",) + k] = rank[t] + 1
        evals.sort(key=lambda t: (rank[t], _problem_hash(tuple(sorted(t))), t))
        self._eval_tuples = evals

    def is_heldout(self, operands) -> bool:
        key = tuple(sorted(int(x) for x in operands))
        if self._heldout_keys is not None:
            return key in self._heldout_keys
        return _problem_hash(key) < self.eval_fraction

    # ---------------------------------------------------------------- prompts
    def make_prompt(self, operands, split: str) -> Prompt:
        ops = tuple(int(x) for x in operands)
        expr = " + ".join(str(x) for x in ops)
        template = self.eval_template if split == "eval-rephrased" else self.template
        return Prompt(
            messages=({"role": "user", "content": template.format(expr=expr)},),
            answer=str(sum(ops)),
            meta={"task": "arith", "id": "arith:" + "+".join(map(str, ops)),
                  "operands": list(ops), "digits": self.digits, "split": split},
        )

    def _draw_tuple(self, rng: random.Random) -> tuple:
        return tuple(rng.randint(self.lo, self.hi) for _ in range(self.num_operands))

    def sample_train(self, n: int, rng: RngLike) -> list[Prompt]:
        rng = as_random(rng)
        out = []
        if self.enumerated:
            pool = self._train_tuples
            for _ in range(n):
                out.append(self.make_prompt(pool[rng.randrange(len(pool))], "train"))
            return out
        while len(out) < n:
            t = self._draw_tuple(rng)
            if not self.is_heldout(t):
                out.append(self.make_prompt(t, "train"))
        return out

    def eval_set(self, n: int) -> list[Prompt]:
        if self.enumerated:
            out = [self.make_prompt(t, "eval") for t in self._eval_tuples[:n]]
            if len(out) < n:  # small space: unseen phrasings of training problems fill the rest
                extra = sorted(self._train_tuples, key=lambda t: (_problem_hash(t), t))
                out += [self.make_prompt(t, "eval-rephrased") for t in extra[: n - len(out)]]
            return out
        # Large space: a fixed-seed scan keeps the held-out tuples, without repeats.
        rng = random.Random(int.from_bytes(_SALT, "big") % (2**32) + self.digits * 1000
                            + self.num_operands)
        seen, out = set(), []
        while len(out) < n:
            t = self._draw_tuple(rng)
            if t in seen or not self.is_heldout(t):
                continue
            seen.add(t)
            out.append(self.make_prompt(t, "eval"))
        return out

    def eval_pool_size(self) -> Optional[int]:
        """Number of distinct held-out prompts (None = effectively unbounded)."""
        return len(self._eval_tuples) if self.enumerated else None

    def __repr__(self) -> str:
        return (f"ArithSource(digits={self.digits}, num_operands={self.num_operands}, "
                f"eval_fraction={self.eval_fraction})")
