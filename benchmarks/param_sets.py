"""Parameter sets of the benchmarks, written out analytically (no transformers dependency).

The shapes are those of ``named_parameters()`` of the models each function names (tied weights appear once).
``shrink`` divides every width (hidden sizes, vocabularies, positions) but keeps the layer count, so a shrunken set
keeps the tensor count that makes the host work per step; many-small instead keeps its 1024-element tensors and
divides their count.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Shape = tuple[int, ...]


def _narrow(dim: int, shrink: int) -> int:
    return max(1, dim // shrink)


def _layer_norm(width: int) -> list[Shape]:
    return [(width,), (width,)]


def _linear(out_features: int, in_features: int) -> list[Shape]:
    return [(out_features, in_features), (out_features,)]


def bert_base_shapes(shrink: int = 1) -> list[Shape]:
    """``BertForMaskedLM(BertConfig())``: 202 tensors, 109,514,298 params (decoder weight tied to the embeddings)."""
    vocab, hidden, intermediate = (_narrow(d, shrink) for d in (30522, 768, 3072))
    positions, token_types = _narrow(512, shrink), _narrow(2, shrink)
    shapes = [(vocab, hidden), (positions, hidden), (token_types, hidden), *_layer_norm(hidden)]
    for _ in range(12):
        shapes += _linear(hidden, hidden) * 4 + _layer_norm(hidden)  # query, key, value, attention output
        shapes += _linear(intermediate, hidden) + _linear(hidden, intermediate) + _layer_norm(hidden)
    # MLM head: transform dense + LayerNorm, and the output bias (the decoder weight is the word embedding).
    shapes += _linear(hidden, hidden) + _layer_norm(hidden) + [(vocab,)]
    return shapes


def gpt2_medium_shapes(shrink: int = 1) -> list[Shape]:
    """``GPT2LMHeadModel(GPT2Config(n_embd=1024, n_layer=24))``: 292 tensors, 354,823,168 params (lm_head tied).

    GPT-2 stores its projections as Conv1D, weight ``(in, out)``.
    """
    vocab, positions, width = (_narrow(d, shrink) for d in (50257, 1024, 1024))
    shapes = [(vocab, width), (positions, width)]
    for _ in range(24):
        shapes += _layer_norm(width)
        shapes += [(width, 3 * width), (3 * width,), (width, width), (width,)]
        shapes += _layer_norm(width)
        shapes += [(width, 4 * width), (4 * width,), (4 * width, width), (width,)]
    return shapes + _layer_norm(width)


def llama_1b_shapes(shrink: int = 1) -> list[Shape]:
    """Llama-shaped, hidden 2048, intermediate 5632, 22 layers, vocab 32000, full-width k/v, untied head.

    201 tensors, 1,261,529,088 params.
    """
    vocab, hidden, intermediate = (_narrow(d, shrink) for d in (32000, 2048, 5632))
    shapes = [(vocab, hidden)]
    for _ in range(22):
        shapes += [(hidden, hidden)] * 4  # q, k, v, o
        shapes += [(intermediate, hidden), (intermediate, hidden), (hidden, intermediate)]  # gate, up, down
        shapes += [(hidden,), (hidden,)]  # RMSNorm before attention and before the MLP
    return shapes + [(hidden,), (vocab, hidden)]


def llama_3_2_1b_shapes(shrink: int = 1) -> list[Shape]:
    """Llama-3.2-1B's layers (hidden 2048, intermediate 8192, 16 layers, grouped-query attention with 8 k/v heads of
    64, no biases) with a 32000-token vocabulary and an untied head (Llama 3.2 itself: 128256 tokens, tied).

    147 tensors, 1,104,218,112 params.
    """
    vocab, hidden, intermediate, kv = (_narrow(d, shrink) for d in (32000, 2048, 8192, 512))
    shapes = [(vocab, hidden)]
    for _ in range(16):
        shapes += [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden)]  # q, k, v, o
        shapes += [(intermediate, hidden), (intermediate, hidden), (hidden, intermediate)]  # gate, up, down
        shapes += [(hidden,), (hidden,)]  # RMSNorm before attention and before the MLP
    return shapes + [(hidden,), (vocab, hidden)]


def many_small_shapes(shrink: int = 1) -> list[Shape]:
    """10,000 tensors of 1024 elements: the case where per-tensor host work dominates."""
    return [(1024,)] * _narrow(10_000, shrink)


PARAM_SETS: dict[str, Callable[[int], list[Shape]]] = {
    "bert-base": bert_base_shapes,
    "gpt2-medium": gpt2_medium_shapes,
    "llama-1b": llama_1b_shapes,
    "llama-3.2-1b": llama_3_2_1b_shapes,
    "many-small": many_small_shapes,
}

#: Dividing every width by 8 gives sets of 1.3M (many-small) to 20M (Llama-1B) params: seconds each on 2 CPU cores.
CPU_SHRINK = 8

#: Gradients are randn × 65.536: unit-variance values of 1e-3 scaled by the default loss scale 2^16 (never zeros).
GRAD_MAGNITUDE = 65.536


def num_params(shapes: list[Shape]) -> int:
    return sum(torch.Size(shape).numel() for shape in shapes)


def make_params(shapes: list[Shape], device: torch.device | str, seed: int = 0) -> list[torch.nn.Parameter]:
    """One fp32 ``nn.Parameter`` per shape, each with a ``.grad`` of randn × 65.536, drawn on ``device``."""
    generator = torch.Generator(device=device).manual_seed(seed)
    params = []
    for shape in shapes:
        param = torch.nn.Parameter(torch.randn(shape, generator=generator, device=device) * 0.02)
        param.grad = torch.randn(shape, generator=generator, device=device).mul_(GRAD_MAGNITUDE)
        params.append(param)
    return params
