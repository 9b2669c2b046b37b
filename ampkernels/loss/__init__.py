"""Losses fused with the layer that feeds them: :func:`linear_cross_entropy` (a language-model head and its
cross-entropy without the [tokens, vocab] logits in memory) and its module, :class:`LinearCrossEntropy`;
:func:`head_float8` keeps a converted head's products in FP8 there."""

from ampkernels.loss.cross_entropy import LinearCrossEntropy, head_float8, linear_cross_entropy

__all__ = ["LinearCrossEntropy", "head_float8", "linear_cross_entropy"]
