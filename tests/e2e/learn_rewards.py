"""A reward that the tiny random Llama can learn within a few steps, for learning tests: its
vocabulary of 49,152 tokens is unstructured (random embeddings), so a task such as arithmetic is out
of reach, but about two thirds of its sampled tokens decode with a leading space and a policy
gradient that favours those tokens raises the reward from ~0.67 to 1.0 (measured: docs/benchmarks.md,
the asynchronous rollouts)."""


def spaces(completion_text: str, prompt) -> float:
    """The number of spaces in the completion, capped at 8, over 8."""
    return min(completion_text.count(" "), 8) / 8
