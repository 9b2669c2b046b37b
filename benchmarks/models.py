"""A Llama-style decoder stack for the benchmarks and the low-precision training tests.

:class:`LlamaStack` is the architecture of Llama 2/3 without its extras: token embedding; per block a pre-norm
causal self-attention (RMSNorm, q/k/v/o projections without bias, rotary position embeddings, optional grouped-query
attention, ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``) and a pre-norm SwiGLU MLP
(``down(silu(gate(x)) * up(x))``); a final RMSNorm and an untied lm head. No dropout, no KV cache.

``LLAMA_STACK`` is the size the benchmarks train (batch 8 x 2048 tokens); :func:`tiny_llama` builds a CPU-test size.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

#: The benchmarks' Llama-style stack (trained at batch 8 x 2048 tokens): 8 blocks of width 2048, about 0.67 B
#: parameters (0.54 B in the blocks, 2 x 65.5 M in the embedding and the untied head).
LLAMA_STACK = dict(vocab=32000, dim=2048, layers=8, heads=16, ffn=8192)

#: :func:`tiny_llama`'s defaults: every weight matrix has >= 4096 elements (the optimizers quantize only those).
TINY_LLAMA = dict(vocab=128, dim=64, layers=2, heads=4, ffn=256)

ROPE_BASE = 10000.0


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x**2, -1) + eps) * weight`` over the last dimension, normalized in float32 and cast back to
    ``x``'s dtype before the (learned, ``[dim]``) weight is applied, as Llama does."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


def rotary(x: torch.Tensor, base: float = ROPE_BASE) -> torch.Tensor:
    """Rotary position embedding of ``x`` ([B, heads, T, head_dim], head_dim even): the pairs (x[..., i],
    x[..., i + head_dim/2]) at position t are rotated by the angle t * base ** (-2i / head_dim) (the "half-split"
    layout of Llama's Hugging Face port). Angles are computed in float32; the result has ``x``'s dtype."""
    t, half = x.shape[-2], x.shape[-1] // 2
    inv_freq = base ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = torch.arange(t, device=x.device, dtype=torch.float32)[:, None] * inv_freq  # [T, half]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary embeddings; ``kv_heads < heads`` is grouped-query attention
    (every ``heads // kv_heads`` query heads share one key/value head). [B, T, dim] -> [B, T, dim]."""

    def __init__(self, dim: int, heads: int, kv_heads: int, fused: bool = False) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.fused = fused
        self.rope = rotary
        if fused:
            from ampkernels.float8 import rotary_embedding

            self.rope = rotary_embedding
        self.q = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.k = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        gqa = self.kv_heads != self.heads
        out = F.scaled_dot_product_attention(
            self.rope(q, ROPE_BASE), self.rope(k, ROPE_BASE), v, is_causal=True, enable_gqa=gqa
        )
        return self.o(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``: [B, T, dim] -> [B, T, dim] through a hidden width ``ffn``."""

    def __init__(self, dim: int, ffn: int, fused: bool = False) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, ffn, bias=False)
        self.up = nn.Linear(dim, ffn, bias=False)
        self.down = nn.Linear(ffn, dim, bias=False)
        self.fused = fused
        self.silu_mul = _silu_mul
        if fused:
            from ampkernels.float8 import silu_mul

            self.silu_mul = silu_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.silu_mul(self.gate(x), self.up(x)))


def _norm(dim: int, fused: bool) -> nn.Module:
    if fused:
        from ampkernels.float8 import RMSNorm as FusedRMSNorm

        return FusedRMSNorm(dim)
    return RMSNorm(dim)


class Block(nn.Module):
    """One pre-norm decoder block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``. [B, T, dim] -> [B, T, dim]."""

    def __init__(self, dim: int, heads: int, kv_heads: int, ffn: int, fused: bool = False) -> None:
        super().__init__()
        self.attn_norm = _norm(dim, fused)
        self.attn = Attention(dim, heads, kv_heads, fused)
        self.mlp_norm = _norm(dim, fused)
        self.mlp = SwiGLU(dim, ffn, fused)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class LlamaStack(nn.Module):
    """A Llama-style decoder: tokens (int64 ``[B, T]``) -> next-token logits (``[B, T, vocab]``, the parameters'
    dtype).

    Args:
        vocab: vocabulary size (embedding rows and lm-head outputs).
        dim: model width; a multiple of ``heads``, and ``dim // heads`` even (rotary embeddings rotate pairs).
        layers: number of decoder blocks.
        heads: query heads.
        ffn: hidden width of the SwiGLU MLP.
        kv_heads: key/value heads (grouped-query attention); default ``heads``. Must divide ``heads``.
        fused: the RMSNorms, the rotary embeddings and SwiGLU's ``silu(gate) * up`` on ampkernels' fused kernels
            (``ampkernels.float8.RMSNorm`` / ``rotary_embedding`` / ``silu_mul``: the same math and parameters, one
            kernel each way, rounded once); the ``state_dict`` is the same either way.

    Initialization (seeded by torch's default generator): every Linear and the embedding normal(0, 0.02), the
    projections that write into the residual stream (attention ``o``, MLP ``down``) scaled by 1/sqrt(2 * layers)
    as in GPT-2; RMSNorm weights 1.
    """

    def __init__(
        self,
        vocab: int,
        dim: int,
        layers: int,
        heads: int,
        ffn: int,
        kv_heads: int | None = None,
        fused: bool = False,
    ) -> None:
        super().__init__()
        kv_heads = heads if kv_heads is None else kv_heads
        if dim % heads or (dim // heads) % 2:
            raise ValueError(f"LlamaStack: dim ({dim}) must be a multiple of heads ({heads}) with an even quotient")
        if heads % kv_heads:
            raise ValueError(f"LlamaStack: kv_heads ({kv_heads}) must divide heads ({heads})")
        self.config = dict(vocab=vocab, dim=dim, layers=layers, heads=heads, ffn=ffn, kv_heads=kv_heads)
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads, ffn, fused) for _ in range(layers))
        self.norm = _norm(dim, fused)
        self.head = nn.Linear(dim, vocab, bias=False)
        self._init_weights(layers)

    @torch.no_grad()
    def _init_weights(self, layers: int) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, 0.02)
        for block in self.blocks:
            block.attn.o.weight.div_(math.sqrt(2 * layers))
            block.mlp.down.weight.div_(math.sqrt(2 * layers))

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B, T] -> [B, T, dim]: what the head reads (the final norm's output), for a loss fused with the head."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.hidden_states(tokens))


def tiny_llama(**overrides: Any) -> LlamaStack:
    """A :class:`LlamaStack` of :data:`TINY_LLAMA`'s size (vocab 128, dim 64, 2 layers, 4 heads, ffn 256: 0.15 M
    parameters) with any argument overridden, for CPU tests."""
    return LlamaStack(**{**TINY_LLAMA, **overrides})
