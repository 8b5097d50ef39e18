"""A server-side custom loss for the tests, registered by dotted path (serve.custom_losses)."""
from __future__ import annotations


def weighted_square(inputs):
    """C = Σ_datums Σ_tokens w * lp^2 on the forward's own log-probs (one pass)."""
    w = inputs.batch["loss_weights"]  # client key "weights"
    return (inputs.mask * w * inputs.log_probs ** 2).sum()


weighted_square.required_inputs = ("weights",)


MARKER = -7.0


def fails_on_marker(inputs):
    """weighted_square, except that a microbatch holding a datum with a weight of MARKER raises
    (a custom loss that fails part-way through a request, after earlier microbatches went backward)."""
    w = inputs.batch["loss_weights"]
    if bool((w == MARKER).any()):
        raise ValueError("fails_on_marker: a datum carries the marker weight")
    return (inputs.mask * w * inputs.log_probs ** 2).sum()


fails_on_marker.required_inputs = ("weights",)
