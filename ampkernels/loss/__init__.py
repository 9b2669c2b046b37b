"""Losses fused with the layer that feeds them: :func:`linear_cross_entropy` (a language-model head and its
cross-entropy without the [tokens, vocab] logits in memory) and its module, :class:`LinearCrossEntropy`."""

from ampkernels.loss.cross_entropy import LinearCrossEntropy, linear_cross_entropy

__all__ = ["LinearCrossEntropy", "linear_cross_entropy"]
