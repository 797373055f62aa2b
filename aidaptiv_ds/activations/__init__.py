"""Activations: what a training step keeps of them, and where.

The block's ``activations.policy``: ``keep``, ``recompute`` (every transformer block checkpointed), ``nvme``
(the checkpoints' inputs stored in the swap space and read back ahead of the backward) or ``auto`` (a plan per
block from what the first forward measures); and the loss in chunks so full logits never exist at once.
``policy`` applies them to a model, ``plan`` decides ``auto`` (no torch), ``store`` holds the stored tensors,
``chunked_loss`` computes the loss.
"""
