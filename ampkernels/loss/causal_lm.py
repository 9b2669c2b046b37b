"""The fused loss inside Hugging Face causal-LM models: their ``forward(..., labels=...)`` without the logits.

A ``*ForCausalLM`` model of Hugging Face computes ``logits = lm_head(hidden)`` for every token, then
``ForCausalLMLoss``: the logits copied to float32, the labels shifted by one (padded with ``ignore_index``), a mean
cross-entropy (or a sum divided by ``num_items_in_batch``, which Trainer passes under gradient accumulation).
:func:`causal_lm_loss` is that loss on :func:`~ampkernels.linear_cross_entropy`, and :func:`fused_forward` is the
model's ``forward`` with it: training with labels, it calls the decoder (``model.model``) with every other argument
as the stock forward passes them and returns the same output class with ``loss`` set and ``logits=None``; in any
other case (eval mode, no labels, ``logits_to_keep``) it is the stock forward.

:func:`ampkernels.float8.fuse_modules` with ``loss=True`` installs it on models whose ``forward`` is Llama's (the same
code once its docstring is set aside: Llama, Mistral, Qwen2/3 and others written from it), which is what proves the
decoder call above is the stock one.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ampkernels.loss.cross_entropy import head_float8, linear_cross_entropy

__all__ = ["causal_lm_loss", "fused_forward"]

# The keyword arguments Hugging Face's loss takes from the forward's **kwargs (transformers.loss.ForCausalLMLoss).
LOSS_KWARGS = ("num_items_in_batch", "ignore_index", "shift_labels")


def causal_lm_loss(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    labels: torch.Tensor | None,
    *,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """Hugging Face's ``ForCausalLMLoss(head(hidden), labels, ...)`` without the logits.

    Args:
        hidden: [B, T, H], the decoder's last hidden state.
        head: the ``nn.Linear`` LM head (its ``weight`` [V, H] and ``bias``). A tensorwise
            :class:`~ampkernels.float8.Float8Linear` head runs its products in FP8 as it would
            (``linear_cross_entropy(..., float8=head.recipe)``); a rowwise or delayed one in the autocast dtype.
        labels: [B, T] token ids; token t is scored against ``labels[:, t + 1]`` (the last against none). Ignored when
            ``shift_labels`` is given.
        num_items_in_batch: when given, the loss is the sum over the tokens divided by it (Trainer's count of the
            labelled tokens over all micro-batches of an optimizer step); otherwise the mean over the counted tokens.
        ignore_index: labels that count for nothing.
        shift_labels: [B, T], the targets already aligned with ``hidden``.
    """
    if shift_labels is None:
        if labels is None:
            raise ValueError("causal_lm_loss: argument 'labels' is None and no 'shift_labels' is given")
        # Token t predicts label t + 1; the last token has none (HF pads with ignore_index, then shifts).
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = linear_cross_entropy(
        hidden,
        head.weight,
        shift_labels.to(hidden.device),
        bias=head.bias,
        ignore_index=ignore_index,
        reduction=reduction,
        float8=head_float8(head),
    )
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def _output(outputs: Any, loss: torch.Tensor) -> Any:
    """``CausalLMOutputWithPast`` with ``loss``, no logits, and the decoder output's other fields."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    names = CausalLMOutputWithPast.__dataclass_fields__
    fields = {name: getattr(outputs, name, None) for name in names if name not in ("loss", "logits")}
    return CausalLMOutputWithPast(loss=loss, logits=None, **fields)


_SIGNATURES: dict[Any, inspect.Signature] = {}  # (per stock forward: reading one costs tens of µs)


def fused_forward(self, *args: Any, **kwargs: Any) -> Any:
    """A Llama-form causal LM's ``forward`` with :func:`causal_lm_loss` when it trains with labels (module
    docstring); the stock forward otherwise. Installed as the forward of a subclass whose base is the model's class
    (``_ampkernels_fused``)."""
    stock = self._ampkernels_fused.forward
    signature = _SIGNATURES.get(stock)
    if signature is None:
        signature = _SIGNATURES[stock] = inspect.signature(stock)
    try:
        arguments = signature.bind(self, *args, **kwargs).arguments
    except TypeError:
        return stock(self, *args, **kwargs)  # (a deprecated keyword the stock decorators rename: theirs to handle)
    arguments = dict(arguments)
    arguments.pop("self")
    extra = dict(arguments.pop("kwargs", {}))
    labels = arguments.pop("labels", None)
    keep = arguments.pop("logits_to_keep", 0)
    if labels is None or not self.training or not (isinstance(keep, int) and keep == 0):
        return stock(self, *args, **kwargs)
    return_dict = extra.pop("return_dict", None)
    loss_kwargs = {name: extra[name] for name in LOSS_KWARGS if name in extra}
    # Every argument but the labels, the loss's and logits_to_keep goes to the decoder, as the stock forward passes it
    # (its code is Llama's: fuse_modules installs this forward on no other).
    outputs = self.model(**arguments, **extra)
    loss = causal_lm_loss(outputs.last_hidden_state, self.lm_head, labels, **loss_kwargs)
    output = _output(outputs, loss)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    return output if return_dict else output.to_tuple()
