"""A synthetic next-token task with a known loss floor, and a deterministic training loop over it.

The data is a random walk on a fixed sparse Markov chain over ``vocab`` tokens: every token has
``successors`` distinct likely next tokens (drawn once, from the seed) and moves to its j-th successor with the
probability ``probs[j]``, the same vector for every token (default 0.5, 0.25, 0.15, 0.1). Each target is the token
after its input, so the best any model can do is to predict that distribution, and since every row of the chain has
the same entropy, the expected cross-entropy of that optimal predictor is ``H(probs)`` whatever the position or the
walk's start: :meth:`MarkovTask.entropy_floor` (1.208 nats by default, against ln(vocab) for a uniform guess, 4.85
at vocab 128). A model has to learn a ``vocab x successors`` table, which a tiny Llama does to within a few hundredths
of a nat of the floor in a few hundred Adam steps, so low-precision state that loses accuracy shows as a gap.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from ampkernels import linear_cross_entropy
from ampkernels.loss import head_float8

DEFAULT_PROBS = (0.5, 0.25, 0.15, 0.1)


@dataclass(frozen=True)
class MarkovTask:
    """A sparse Markov chain: ``successors`` (int64 ``[vocab, k]``, distinct per row) and ``probs`` (float64
    ``[k]``, summing to 1; the chance of moving to each column), on the CPU."""

    successors: torch.Tensor
    probs: torch.Tensor

    @property
    def vocab(self) -> int:
        return self.successors.shape[0]

    def entropy_floor(self) -> float:
        """The lowest expected next-token cross-entropy (nats): the entropy of ``probs``, every row's entropy."""
        p = self.probs[self.probs > 0]
        return float(-(p * p.log()).sum())

    def optimal_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """The mean cross-entropy (nats) of the chain's own next-token distribution on ``(inputs, targets)`` (int64
        ``[batch, seq]`` from :meth:`batch`): what a perfect model would score on exactly these tokens. Raises if
        a target is not a successor of its input."""
        inputs, targets = inputs.cpu(), targets.cpu()
        match = self.successors[inputs] == targets[..., None]  # [batch, seq, k], one True per row
        if not bool(match.any(-1).all()):
            raise ValueError("optimal_loss: a target is not a successor of its input (not this task's tokens)")
        return float(-self.probs.log()[match.int().argmax(-1)].mean())

    def batch(
        self, batch: int, seq: int, generator: torch.Generator, device: torch.device | str = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch`` walks of ``seq + 1`` tokens, each from a uniform start token, drawn on the CPU from
        ``generator`` (a CPU generator: the same tokens on every device) -> (inputs, targets), int64 ``[batch,
        seq]`` on ``device``, with ``targets[:, t]`` the token after ``inputs[:, t]``."""
        start = torch.randint(self.vocab, (batch,), generator=generator)
        u = torch.rand(batch, seq, generator=generator, dtype=torch.float64)
        cdf = self.probs.cumsum(0)
        # u < 1 and cdf[-1] = 1 up to rounding: clamp so that rounding never picks a column past the last.
        column = torch.searchsorted(cdf, u).clamp_max(len(self.probs) - 1)
        tokens = torch.empty(batch, seq + 1, dtype=torch.int64)
        tokens[:, 0] = start
        for t in range(seq):
            tokens[:, t + 1] = self.successors[tokens[:, t], column[:, t]]
        tokens = tokens.to(device)
        return tokens[:, :-1], tokens[:, 1:]


def make_task(vocab: int, seed: int, successors: int = 4, probs: Sequence[float] | None = None) -> MarkovTask:
    """The chain over ``vocab`` tokens with ``successors`` random distinct successors per token (drawn from
    ``seed``) taken with ``probs`` (default :data:`DEFAULT_PROBS`; ``successors`` entries summing to 1)."""
    probs = DEFAULT_PROBS if probs is None else tuple(probs)
    if len(probs) != successors:
        raise ValueError(f"make_task: probs has {len(probs)} entries, successors is {successors}")
    if not math.isclose(sum(probs), 1.0, abs_tol=1e-9) or min(probs) < 0:
        raise ValueError(f"make_task: probs must be >= 0 and sum to 1, got {probs}")
    if not 0 < successors <= vocab:
        raise ValueError(f"make_task: successors ({successors}) must be in [1, vocab ({vocab})]")
    gen = torch.Generator().manual_seed(seed)
    table = torch.stack([torch.randperm(vocab, generator=gen)[:successors] for _ in range(vocab)])
    return MarkovTask(table, torch.tensor(probs, dtype=torch.float64))


def warmup_cosine(steps: int, warmup: int, final: float = 0.1) -> Callable[[int], float]:
    """The learning-rate factor of step ``i`` (0-based): linear from 1/warmup to 1 over ``warmup`` steps, then a
    cosine from 1 down to ``final`` at the last of ``steps``."""

    def factor(i: int) -> float:
        if i < warmup:
            return (i + 1) / warmup
        progress = (i - warmup) / max(1, steps - 1 - warmup)
        return final + (1 - final) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    task: MarkovTask,
    steps: int,
    batch: int,
    seq: int,
    device: torch.device | str,
    seed: int,
    scaler=None,
    autocast_dtype: torch.dtype | None = None,
    schedule: Callable[[int], float] | None = None,
    fused_loss: bool = False,
) -> list[float]:
    """``steps`` optimizer steps of next-token cross-entropy on fresh batches of ``task``; returns each step's loss
    (float, before that step's update).

    Args:
        model: tokens int64 ``[batch, seq]`` -> logits ``[batch, seq, vocab]``, already on ``device``.
        optimizer: over ``model``'s parameters; each group's ``lr`` at the call is the base of ``schedule``.
        task: the data (:func:`make_task`); batches are drawn from a CPU generator seeded with ``seed``, so the
            same ``seed`` gives the same tokens on every device and for every optimizer.
        scaler: optional ``torch.amp.GradScaler`` or ``ampkernels.FusedGradScaler``: the loss is scaled, and
            ``scaler.step`` / ``scaler.update`` replace ``optimizer.step``.
        autocast_dtype: optional; the forward runs under ``torch.autocast(device.type, autocast_dtype)``.
        schedule: optional ``step -> factor`` on the base learning rates (e.g. :func:`warmup_cosine`).
        fused_loss: the head and its loss as ``ampkernels.linear_cross_entropy`` on ``model.hidden_states`` and
            ``model.head.weight`` (a :class:`benchmarks.models.LlamaStack`): no logits formed; a converted
            (tensorwise Float8Linear) head runs in FP8 there.

    The loss is computed in float32 from the logits. Deterministic given the seeds and the model's initial weights
    wherever the kernels are (CPU, and the GPU kernels ampkernels runs).
    """
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    base = [_clone(group["lr"]) for group in optimizer.param_groups]
    losses = []
    model.train()
    for i in range(steps):
        if schedule is not None:
            for group, lr in zip(optimizer.param_groups, base):
                _set_lr(group, lr * schedule(i))
        inputs, targets = task.batch(batch, seq, gen, device)
        cast = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None else None
        with cast or contextlib.nullcontext():
            if fused_loss:
                hidden = model.hidden_states(inputs).flatten(0, 1)
                head = model.head
                loss = linear_cross_entropy(hidden, head.weight, targets.flatten(), float8=head_float8(head))
            else:
                loss = F.cross_entropy(model(inputs).float().flatten(0, 1), targets.flatten())
        optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        losses.append(float(loss.detach()))
    for group, lr in zip(optimizer.param_groups, base):
        _set_lr(group, lr)
    return losses


def _clone(lr):
    return lr.clone() if isinstance(lr, torch.Tensor) else lr


def _set_lr(group: dict, lr) -> None:
    """A tensor learning rate is written in place (a captured step keeps reading the same tensor)."""
    if isinstance(group["lr"], torch.Tensor):
        group["lr"].copy_(lr)
    else:
        group["lr"] = lr
