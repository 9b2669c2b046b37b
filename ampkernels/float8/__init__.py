"""FP8 training pieces: the fused casts (:mod:`ampkernels.float8.casts`)."""

from ampkernels.float8.casts import to_float8, to_float8_pair

__all__ = ["to_float8", "to_float8_pair"]
