"""The per-chunk step of linear_cross_entropy (Triton's kernel) against ``reference.cross_entropy_chunk``: the losses
and the logits' gradient written over the logits, on rows longer than a block, ignored rows, per-token weights,
label smoothing, z-loss and logits at -inf."""

import pytest
import torch

from ampkernels import dispatch, reference

OP = "linear_cross_entropy"


def _kernel(device):
    reason = dispatch.why_not(OP, "triton", device)
    if reason is not None:
        pytest.skip(reason)
    return dispatch.triton_module(OP)


def _chunk(device, dtype, rows=13, vocab=4500, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(rows, vocab, generator=gen)).to(dtype)
    target = torch.randint(0, vocab, (rows,), generator=gen)
    target[::5] = -100
    target[1] = vocab - 1  # the last class, in the ragged last block
    weight = torch.rand(2 * rows, generator=gen)[::2] + 0.5  # strided, as a slice of the backward's grad_losses
    return logits.to(device), target.to(device), weight.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("smoothing, z_loss", [(0.0, 0.0), (0.1, 0.0), (0.0, 1e-3), (0.2, 1e-2)])
def test_losses_and_gradient_match_the_reference(device, dtype, smoothing, z_loss):
    kernel = _kernel(device)
    logits, target, weight = _chunk(device, dtype)
    options = dict(ignore_index=-100, label_smoothing=smoothing, z_loss=z_loss)
    expected_losses, expected_grad = reference.cross_entropy_chunk(logits, target, weight, **options)
    losses = torch.full_like(expected_losses, float("nan"))
    grad = logits.clone()
    kernel.cross_entropy_chunk_(grad, target, weight, losses, -100, smoothing, z_loss)
    torch.testing.assert_close(losses, expected_losses, rtol=1e-5, atol=1e-5)
    assert (losses[target == -100] == 0).all()
    # the gradient rounded once to the logits' dtype: within one rounding of the reference's rounding
    torch.testing.assert_close(grad, expected_grad.to(dtype), rtol=2 * torch.finfo(dtype).eps, atol=1e-6)
    assert (grad[target == -100] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_losses_only_leave_the_logits_unchanged(device, dtype):
    kernel = _kernel(device)
    logits, target, _ = _chunk(device, dtype, rows=9, vocab=300)
    before = logits.clone()
    losses = torch.empty(9, device=device)
    kernel.cross_entropy_chunk_(logits, target, None, losses, -100, 0.1, 1e-3)
    expected, _ = reference.cross_entropy_chunk(before, target, None, label_smoothing=0.1, z_loss=1e-3)
    assert torch.equal(logits, before)
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-5)


def test_logits_at_minus_infinity(device):
    """A block of -inf logits before the first finite one (a masked vocabulary) leaves the log-sum-exp finite."""
    kernel = _kernel(device)
    logits, target, weight = _chunk(device, torch.float32, rows=4, vocab=9000)
    logits[:, :4500] = float("-inf")
    target[:] = torch.tensor([4500, 8999, 6000, -100])
    expected_losses, expected_grad = reference.cross_entropy_chunk(logits, target, weight)
    losses = torch.empty(4, device=device)
    kernel.cross_entropy_chunk_(logits, target, weight, losses, -100, 0.0, 0.0)
    assert torch.isfinite(losses).all()
    torch.testing.assert_close(losses, expected_losses, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, expected_grad, rtol=1e-5, atol=1e-7)


def test_a_target_out_of_range_gives_nan_not_another_logit(device):
    """Where no host check ran (a CUDA graph capture), a class index outside [0, V) must not read past its row."""
    kernel = _kernel(device)
    logits, target, weight = _chunk(device, torch.float32, rows=4, vocab=300)
    target[:] = torch.tensor([3, 300, -7, -100])
    losses = torch.empty(4, device=device)
    kernel.cross_entropy_chunk_(logits, target, weight, losses, -100, 0.0, 0.0)
    assert losses.isnan().tolist() == [False, True, True, False]
    assert logits.isnan().all(1).tolist() == [False, True, True, False] and (logits[3] == 0).all()
