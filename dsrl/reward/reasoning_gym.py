"""The `reasoning_gym` verifier: a reasoning-gym task's own scorer on the completion's answer.

The answer is the text of the completion's last `<answer>...</answer>` tag (reasoning-gym's
`extract_answer`); a completion without one is taken whole, surrounding whitespace stripped (the
prompts of data=reasoning_gym ask for the final answer alone). The task's scorer
(`score_answer(answer, entry)`, entry = {question, answer, metadata} of the prompt's item) gives a
value in [0, 1]; many scorers give partial credit (an answer that contains the right one scores
len(right) / len(answer)): `reward.strict=true` turns every score below 1 into 0.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

from dsrl.reward.registry import register_verifier


@functools.lru_cache(maxsize=None)
def task_scorer(task: str) -> Callable[[Optional[str], dict], float]:
    """The scorer of reasoning-gym task `task` (built once: ~35 ms each)."""
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)


def extract_answer(completion_text: str) -> str:
    """The last `<answer>` tag's text, else the whole completion (stripped)."""
    from reasoning_gym.utils import extract_answer as tag_text

    tagged = tag_text(completion_text or "")
    return tagged if tagged is not None else (completion_text or "").strip()


@register_verifier("reasoning_gym")
def reasoning_gym_score(completion_text: str, prompt: Any) -> float:
    """The prompt's task scorer (prompt.meta: task, question, metadata) on the extracted answer."""
    meta = prompt.meta
    if "task" not in meta or "question" not in meta:
        raise ValueError("the reasoning_gym verifier scores prompts of data=reasoning_gym (meta task, question, "
                         f"metadata); this prompt's meta has {sorted(meta)}")
    entry = {"question": meta["question"], "answer": prompt.answer, "metadata": meta.get("metadata", {})}
    return float(task_scorer(meta["task"])(extract_answer(completion_text), entry))
