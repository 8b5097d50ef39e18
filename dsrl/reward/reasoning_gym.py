"""The `reasoning_gym` verifier: a reasoning-gym task's own scorer on the completion's answer.

The answer is the text of the completion's last `<answer>...</answer>` tag (reasoning-gym's
`extract_answer`). A completion without one falls back to its final statement: its last non-empty
line; and where the task's reference answer is one word (a number, a word), the last word of that
line with surrounding punctuation and markdown (`.,;:!?*_"'` and backticks) stripped, so "3 + 5 = 8"
and "The answer is 8." give "8" (a small model states answers that way: whole completions scored as
answers reward the bare number, and the model then drops the working it computes with). Tasks
whose answers span several words need the tag (ask for it in data.instruction).

The task's scorer (`score_answer(answer, entry)`, entry = {question, answer, metadata} of the
prompt's item) gives a value in [0, 1]; many scorers give partial credit (an answer that contains
the right one scores len(right) / len(answer)): `reward.strict=true` turns every score below 1 into 0.
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


_PUNCT = ".,;:!?*_\"'`"


def extract_answer(completion_text: str, reference: str = "") -> str:
    """The last `<answer>` tag's text, else the completion's final statement (module doc)."""
    from reasoning_gym.utils import extract_answer as tag_text

    text = completion_text or ""
    tagged = tag_text(text)
    if tagged is not None:
        return tagged
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        return ""
    last = lines[-1]
    if len(str(reference).split()) == 1:
        return last.split()[-1].strip(_PUNCT)
    return last


@register_verifier("reasoning_gym")
def reasoning_gym_score(completion_text: str, prompt: Any) -> float:
    """The prompt's task scorer (prompt.meta: task, question, metadata) on the extracted answer."""
    meta = prompt.meta
    if "task" not in meta or "question" not in meta:
        raise ValueError("the reasoning_gym verifier scores prompts of data=reasoning_gym (meta task, question, "
                         f"metadata); this prompt's meta has {sorted(meta)}")
    entry = {"question": meta["question"], "answer": prompt.answer, "metadata": meta.get("metadata", {})}
    return float(task_scorer(meta["task"])(extract_answer(completion_text, prompt.answer), entry))
