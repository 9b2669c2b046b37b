"""``fuse_modules``: put a model built from stock modules on the fused producers of :mod:`ampkernels.float8`
(RMSNorm, SiLU·up, RoPE) where the module's computation is provably the same, in place, with a report of what changed.

A module is changed by giving it a subclass of its own class whose ``forward`` calls the fused kernel: parameters,
buffers, hooks, ``state_dict`` keys, ``isinstance`` and ``repr`` stay as they were, so checkpoints, optimizers built
before the call and FSDP2 wrapping keep working. What is proved, per pattern:

* ``torch.nn.RMSNorm`` with a weight over the last dimension: ``F.rms_norm`` multiplies by the weight before it
  rounds to the input's dtype, the fused norm after, so the fused kernel runs only on float32 inputs and weights (the
  residual stream of a model trained under autocast), where the two orders are the same; other inputs take stock's
  code.
* Hugging Face RMSNorms (Llama, Mistral, Qwen2, Qwen3 and any class whose ``forward`` is Llama's, character for
  character): ``weight * (x.float() * rsqrt(mean(x.float()²) + eps)).to(x.dtype)``, which is
  :func:`ampkernels.float8.rms_norm`'s definition for every dtype.
* Hugging Face gated MLPs (``LlamaMLP`` and any class whose ``forward`` is its, with a SiLU ``act_fn``):
  ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` with :func:`ampkernels.float8.silu_mul` (SiLU·up in float32,
  rounded once where stock rounds twice).
* Hugging Face attentions whose ``forward`` is Llama's but for its docstring, in a model whose rotary modules are all
  Llama's (tables ``cat(angles, angles)``, any RoPE scaling folded into them), in training mode: the same code with
  ``apply_rotary_pos_emb`` on :func:`ampkernels.float8.rotary_embedding`, given the first half of the tables, where
  the tables are one [1, T, D] pair for the batch (as Llama's model makes them); other tables run stock's function.
  Under autocast stock's result is float32 (the float32 tables promote it) and the attention casts it to bf16 at
  once; the fused kernel computes in float32 and rounds to q's dtype itself.
* With ``loss=True``, Hugging Face ``*ForCausalLM`` models whose ``forward`` is Llama's but for its docstring: the
  loss of a training forward with labels on :func:`ampkernels.linear_cross_entropy`
  (:mod:`ampkernels.loss.causal_lm`), the same cross-entropy of the same 16-bit logits without forming them.

Left, and reported: RMSNorms with another formula (Gemma's ``1 + weight``) or without a weight, MLPs with another
activation, attentions with another forward (Mistral's sliding window, Qwen3's q/k norms) or whose tables come from a
rotary module that is not Llama's.
"""

from __future__ import annotations

import functools
import inspect
import types
from dataclasses import dataclass, field

import torch
from torch import nn

from ampkernels._source import code_without_docstring
from ampkernels.float8.fused import rms_norm, rotary_embedding, silu_mul
from ampkernels.loss.causal_lm import fused_forward as _hf_causal_lm_forward


@dataclass
class FuseReport:
    """What :func:`fuse_modules` changed (``swapped``: name, class) and what it left (``left``: name, class, why)."""

    swapped: list[tuple[str, str]] = field(default_factory=list)
    left: list[tuple[str, str, str]] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"fuse_modules: {len(self.swapped)} module(s) on the fused kernels, {len(self.left)} left"]
        lines += [f"  fused: {name} ({cls})" for name, cls in self.swapped]
        lines += [f"  left:  {name} ({cls}): {why}" for name, cls, why in self.left]
        return "\n".join(lines)


def _torch_rms_norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    weight = self.weight
    if x.dtype == torch.float32 and weight is not None and weight.dtype == torch.float32:
        eps = self.eps if self.eps is not None else torch.finfo(torch.float32).eps
        return rms_norm(x, weight, eps)
    return nn.RMSNorm.forward(self, x)  # the multiply-then-round order of F.rms_norm: stock's code


def _hf_rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _hf_gated_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


def _fused_rope(stock):
    """``apply_rotary_pos_emb(q, k, cos, sin)`` of Hugging Face on :func:`rotary_embedding` where the tables are one
    [1, T, D] pair shared by the batch (Llama's rotary module makes them so), ``stock`` otherwise. The result has q's
    dtype: under autocast stock's is float32 (the float32 tables promote it), which the attention casts to q's dtype
    at once, so the values it reads are the same."""

    last: list = [None, None, None]  # (cos, sin, tables): one pair of tables serves every layer of a forward

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if (
            args
            or kwargs
            or q.ndim != 4
            or k.ndim != 4
            or cos.ndim != 3
            or cos.shape[0] != 1
            or sin.shape != cos.shape
            or cos.shape[1:] != q.shape[2:]
            or k.shape[2:] != q.shape[2:]
        ):
            return stock(q, k, cos, sin, *args, **kwargs)
        if last[0] is cos and last[1] is sin:
            tables = last[2]
        else:
            half = q.shape[-1] // 2
            # (Llama's tables are cat(angles, angles): the first half holds every angle)
            tables = (cos[0, :, :half].float().contiguous(), sin[0, :, :half].float().contiguous())
            last[:] = cos, sin, tables
        return rotary_embedding(q, tables=tables), rotary_embedding(k, tables=tables)

    return apply_rotary_pos_emb


_REBOUND: dict[type, types.FunctionType] = {}


def _with_fused_rope(cls: type) -> types.FunctionType:
    """``cls.forward``'s own code with ``apply_rotary_pos_emb`` bound to :func:`_fused_rope`, without its decorators
    (Llama's has one, which renames a ``past_key_values`` argument: :func:`_hf_attention_forward` leaves such calls to
    the stock forward)."""
    fn = _REBOUND.get(cls)
    if fn is None:
        inner = inspect.unwrap(cls.forward)
        names = dict(inner.__globals__)
        names["apply_rotary_pos_emb"] = _fused_rope(names["apply_rotary_pos_emb"])
        fn = types.FunctionType(inner.__code__, names, inner.__name__, inner.__defaults__, inner.__closure__)
        fn.__kwdefaults__ = inner.__kwdefaults__
        _REBOUND[cls] = fn
    return fn


def _hf_attention_forward(self, *args, **kwargs):
    stock = self._ampkernels_fused
    # Training only: generating, the cache keeps stock's dtype for the keys (float32 under autocast), as it would.
    if not self.training or "past_key_values" in kwargs:
        return stock.forward(self, *args, **kwargs)
    return _with_fused_rope(stock)(self, *args, **kwargs)


_FORWARDS = {
    "torch_rms_norm": _torch_rms_norm_forward,
    "hf_rms_norm": _hf_rms_norm_forward,
    "hf_gated_mlp": _hf_gated_mlp_forward,
    "hf_causal_lm_loss": _hf_causal_lm_forward,
    "hf_attention_rope": _hf_attention_forward,
}
_FUSED_CLASSES: dict[tuple[type, str], type] = {}
_PREFIX = "_Fused__"
_DOT = "_DOT_"  # a dot of the base class's module or qualname, in the fused class's name


def _fused_class(cls: type, kind: str) -> type:
    """``cls`` with the fused forward ``kind`` (one subclass per class, reused). It is named in this module after its
    base and kind, and :func:`__getattr__` rebuilds it from that name, so ``torch.save`` of a whole model loads in
    another process."""
    fused = _FUSED_CLASSES.get((cls, kind))
    if fused is None:
        qualname = f"{_PREFIX}{kind}__{cls.__module__}__{cls.__qualname__}".replace(".", _DOT)
        fused = type(cls.__name__, (cls,), {"forward": _with_stock_signature(_FORWARDS[kind], cls.forward)})
        fused._ampkernels_fused = cls
        fused.__module__, fused.__qualname__ = __name__, qualname
        _FUSED_CLASSES[(cls, kind)] = fused
    return fused


def _with_stock_signature(forward, stock):
    """A copy of ``forward`` under ``stock``'s name, docstring and signature (``__wrapped__``; a copy, not a wrapper,
    so the call costs no extra frame): frameworks read the signature (Trainer keeps the dataset columns that
    ``forward`` names, and passes loss arguments only to a forward that takes ``**kwargs``)."""
    fused = types.FunctionType(
        forward.__code__, forward.__globals__, forward.__name__, forward.__defaults__, forward.__closure__
    )
    fused.__kwdefaults__ = forward.__kwdefaults__
    return functools.update_wrapper(fused, stock)


def __getattr__(name: str) -> type:
    """The fused class a pickle names (``_Fused__<kind>__<module>__<class>``, their dots as ``_DOT_``)."""
    if not name.startswith(_PREFIX):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    kind, _, rest = name[len(_PREFIX) :].replace(_DOT, ".").partition("__")
    module_path, _, qualname = rest.rpartition("__")
    import importlib

    cls = importlib.import_module(module_path)
    for part in qualname.split("."):
        cls = getattr(cls, part)
    return _fused_class(cls, kind)


def _source(fn) -> str | None:
    try:
        return inspect.getsource(fn).strip()
    except (OSError, TypeError):
        return None


@dataclass(frozen=True)
class _Llama:
    """Hugging Face Llama's code that a module is compared with (None without transformers): the RMSNorm's and MLP's
    ``forward`` sources; the attention's, rotary module's and causal LM's ``forward`` syntax trees (docstrings
    aside)."""

    norm: str | None = None
    mlp: str | None = None
    attention: str | None = None
    rotary: str | None = None
    causal_lm: str | None = None

    @staticmethod
    def load() -> _Llama:
        try:
            from transformers.models.llama import modeling_llama as m
        except ImportError:
            return _Llama()
        return _Llama(
            _source(m.LlamaRMSNorm.forward),
            _source(m.LlamaMLP.forward),
            code_without_docstring(m.LlamaAttention.forward),
            code_without_docstring(m.LlamaRotaryEmbedding.forward),
            code_without_docstring(m.LlamaForCausalLM.forward),
        )

    def is_causal_lm(self, cls: type) -> bool:
        """Whether ``cls.forward`` is ``LlamaForCausalLM.forward`` but for its docstring."""
        return self.causal_lm is not None and code_without_docstring(cls.forward) == self.causal_lm

    def rotary_reason(self, model: nn.Module) -> str | None:
        """Why the attentions of ``model`` cannot take the fused RoPE (None: they can): its rotary modules must all
        be Llama's, whose tables are ``cat(angles, angles)``."""
        rotary = [m for m in model.modules() if "Rotary" in type(m).__name__]
        if not rotary:
            return "the model has no rotary module: where its tables come from is not known"
        for module in rotary:
            if self.rotary is None or code_without_docstring(type(module).forward) != self.rotary:
                name = type(module).__name__
                return f"its rotary module ({name}) is not Llama's: its tables are not provably cat(angles, angles)"
        return None


def _is_silu(module) -> bool:
    if isinstance(module, nn.SiLU):
        return True
    try:
        from transformers.activations import SiLUActivation
    except ImportError:
        return False
    return type(module) is SiLUActivation


def _judge(module: nn.Module, llama: _Llama, rope_reason: str | None, loss: bool) -> tuple[str | None, str | None]:
    """(the fused forward's kind for ``module``, None) or (None, why it is left); (None, None): not a pattern at all."""
    cls = type(module)
    name = cls.__name__
    if getattr(cls, "_ampkernels_fused", None) is not None:
        return None, None  # fused already
    if loss and name.endswith("ForCausalLM"):
        head = getattr(module, "lm_head", None)
        if not isinstance(head, nn.Linear):
            return None, "its lm_head is not an nn.Linear"
        if not llama.is_causal_lm(cls):
            return None, "its forward is not Llama's causal-LM forward (e.g. logit soft-capping): not provably its loss"
        return "hf_causal_lm_loss", None
    if isinstance(module, nn.RMSNorm):
        if module.weight is None:
            return None, "no weight (elementwise_affine=False)"
        if len(module.normalized_shape) != 1:
            return None, f"normalizes over {len(module.normalized_shape)} dimensions; the fused norm over the last"
        return "torch_rms_norm", None
    if name.endswith("RMSNorm"):
        if llama.norm is not None and _source(cls.forward) == llama.norm:
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.Tensor) and weight.ndim == 1:
                return "hf_rms_norm", None
            return None, "its weight is not one vector"
        return None, "its forward is not Llama's RMSNorm (e.g. Gemma's 1 + weight): not provably the fused norm"
    if name.endswith("MLP") and all(hasattr(module, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        if llama.mlp is None or _source(cls.forward) != llama.mlp:
            return None, "its forward is not Llama's gated MLP"
        if not _is_silu(module.act_fn):
            return None, f"its activation is {type(module.act_fn).__name__}, the fused kernel is SiLU·up"
        return "hf_gated_mlp", None
    if name.endswith("Attention") and hasattr(module, "q_proj"):
        if llama.attention is None or code_without_docstring(cls.forward) != llama.attention:
            return None, "its forward is not Llama's attention: its RoPE is not provably apply_rotary_pos_emb's"
        if rope_reason is not None:
            return None, rope_reason
        return "hf_attention_rope", None
    if "Rotary" in name and rope_reason is not None:
        return None, f"the attentions keep stock's RoPE: {rope_reason}"
    return None, None


def fuse_modules(model: nn.Module, *, loss: bool = False) -> FuseReport:
    """Puts ``model``'s stock RMSNorms and gated MLPs on ampkernels' fused kernels in place (module docstring: which,
    and why each is the same computation) and returns what it changed and what it left. Call it before or after
    :func:`~ampkernels.float8.convert_to_float8` (the fused kernels record the amax that the following Float8Linear's
    cast reuses); calling it twice changes nothing more.

    ``loss=True`` also gives Hugging Face causal LMs whose forward is Llama's the fused linear + cross-entropy
    (:mod:`ampkernels.loss.causal_lm`): training with labels, their forward returns the loss and ``logits=None``, and
    the [tokens, vocab] logits are never formed. Off by default because of that ``None``."""
    if not isinstance(loss, bool):
        raise TypeError(f"fuse_modules: argument 'loss' must be a bool, got {type(loss).__name__}")
    llama = _Llama.load()
    rope_reason = llama.rotary_reason(model)
    report = FuseReport()
    seen: set[int] = set()
    for name, module in model.named_modules():
        if id(module) in seen:
            continue
        seen.add(id(module))
        kind, why = _judge(module, llama, rope_reason, loss)
        label = name or "(the model)"
        if kind is not None:
            module.__class__ = _fused_class(type(module), kind)
            report.swapped.append((label, type(module).__name__))
        elif why is not None:
            report.left.append((label, type(module).__name__, why))
    return report
