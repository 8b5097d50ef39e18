"""A server-side custom loss for the tests, registered by dotted path (serve.custom_losses)."""
from __future__ import annotations


def weighted_square(inputs):
    """C = Σ_datums Σ_tokens w * lp^2 on the forward's own log-probs (one pass)."""
    w = inputs.batch["loss_weights"]  # client key "weights"
    return (inputs.mask * w * inputs.log_probs ** 2).sum()


weighted_square.required_inputs = ("weights",)
