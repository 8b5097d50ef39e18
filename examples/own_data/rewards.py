"""Reward functions for the own-data guide (docs/guides/own-data.md).

dsrl calls a reward function once per completion. Two forms are accepted, told apart by the
function's signature when the run starts:

    fn(completion_text, prompt) -> float
        prompt is a dsrl.data.types.Prompt: prompt.messages (the chat messages sent to the model),
        prompt.answer (the row's answer, as a string) and prompt.meta (a dict; for the file
        sources data=jsonl|parquet|hf, prompt.meta["record"] is the whole row).

    fn(completion, answer, **row) -> float
        the row's fields by name (completion, answer, question, messages, meta, and meta's keys).
"""
import re


def exact_number(completion_text, prompt):
    """1.0 when the last number in the completion equals the row's answer, else 0.0."""
    numbers = re.findall(r"-?\d+", completion_text.replace(",", ""))
    return 1.0 if numbers and numbers[-1] == prompt.answer.strip() else 0.0


def short_and_right(completion, answer, **row):
    """The same check, taking the row's fields by name; a small bonus for answering briefly."""
    numbers = re.findall(r"-?\d+", completion.replace(",", ""))
    right = bool(numbers) and numbers[-1] == str(answer).strip()
    return (1.0 if right else 0.0) + (0.1 if right and len(completion) < 20 else 0.0)
