"""The FP8 weight casts a Float8Linear keeps across micro-batches: cast once while the weight is unchanged, cast
again after every kind of change (in place, rebound, through .data with forget_weight_casts, an optimizer step,
load_state_dict, a delayed-scaling update), results bitwise those of casting every time, eager and graphed."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import ampkernels
from ampkernels.float8 import Float8Linear, convert_to_float8, forget_weight_casts, weight_casts
from ampkernels.float8 import linear as float8_linear

RECIPES = ("tensorwise", "rowwise", "delayed")


@pytest.fixture
def counted(monkeypatch):
    """Counts the casts of layer weights (tensors registered in ``weights``) by every cast function Float8Linear
    calls."""
    weights: list[torch.Tensor] = []
    counts = {"weight": 0}

    def counting(fn):
        def cast(x, *args, **kwargs):
            if any(x is w for w in weights):
                counts["weight"] += 1
            return fn(x, *args, **kwargs)

        return cast

    monkeypatch.setattr(float8_linear, "to_float8_pair", counting(float8_linear.to_float8_pair))
    monkeypatch.setattr(float8_linear, "to_float8", counting(float8_linear.to_float8))
    return weights, counts


def _layer(recipe, device="cpu"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32))
    convert_to_float8(model, recipe, min_features=0)
    return model.to(device)


def _micro_batches(model, n=3, device="cpu", seed=1):
    gen = torch.Generator().manual_seed(seed)
    outs = []
    for _ in range(n):
        x = torch.randn(32, 64, generator=gen).to(device).requires_grad_()
        out = model(x)
        out.square().sum().backward()
        outs.append((out.detach(), x.grad))
    return outs


@pytest.mark.parametrize("recipe", RECIPES)
def test_micro_batches_cast_the_weight_once_and_match_casting_every_time(recipe, counted, monkeypatch):
    weights, counts = counted
    model = _layer(recipe)
    weights.append(model[0].weight)
    cached = _micro_batches(model)
    casts_per_batch = 2 if recipe == "rowwise" else 1  # rowwise: the backward's transposed cast too
    # delayed: each training forward's scale update rewrites the scales, so each micro-batch casts again
    expected = casts_per_batch * (3 if recipe == "delayed" else 1)
    assert counts["weight"] == expected
    grads = model[0].weight.grad.clone()
    monkeypatch.setattr(weight_casts, "ENABLED", False)
    model = _layer(recipe)
    weights.append(model[0].weight)
    fresh = _micro_batches(model)
    assert counts["weight"] == expected + 3 * casts_per_batch
    for (out, gx), (out_f, gx_f) in zip(cached, fresh):
        assert torch.equal(out, out_f) and torch.equal(gx, gx_f)
    assert torch.equal(grads, model[0].weight.grad)


def _changes():
    def in_place(model):
        with torch.no_grad():
            model[0].weight.mul_(0.5)

    def rebound(model):
        model[0].weight.data = model[0].weight.detach() * 0.5

    def through_data(model):
        model[0].weight.data.mul_(0.5)  # not seen by the version counter
        forget_weight_casts()

    def torch_optimizer(model):
        torch.optim.SGD(model.parameters(), lr=0.5).step()

    def fused_optimizer(model):
        ampkernels.FusedAdamW(model.parameters(), lr=0.5).step()

    def loaded(model):
        state = {k: v * 0.5 if k.endswith("weight") else v for k, v in model.state_dict().items()}
        model.load_state_dict(state)

    return [in_place, rebound, through_data, torch_optimizer, fused_optimizer, loaded]


@pytest.mark.parametrize("change", _changes(), ids=lambda f: f.__name__)
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_changed_weight_is_cast_again(recipe, change, counted):
    weights, counts = counted
    model = _layer(recipe)
    _micro_batches(model, n=1)  # gradients for the optimizers; the weight's casts cached
    change(model)
    weights.append(model[0].weight)
    x = torch.randn(32, 64)
    out = model(x)
    assert counts["weight"] == 1
    reference_layer = copy.deepcopy(model)  # a copy starts with no cached casts
    assert torch.equal(out, reference_layer(x))


def test_copies_and_pickles_start_empty():
    model = _layer("tensorwise")
    _micro_batches(model, n=1)
    assert model[0].float8_weight_casts.entries
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert not twin[0].float8_weight_casts.entries
        x = torch.randn(32, 64)
        assert torch.equal(twin(x), model(x))


def test_no_cache_for_inference_weights_or_under_torch_compile():
    with torch.inference_mode():  # an inference tensor has no version counter to tell a change by
        frozen = Float8Linear(64, 32)
        frozen(torch.randn(32, 64))
    assert frozen.weight.is_inference() and not frozen.float8_weight_casts.entries
    layer = Float8Linear(64, 32)
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    x = torch.randn(32, 64)
    out = compiled(x)
    assert not layer.float8_weight_casts.entries  # the traced forward cached nothing
    torch.testing.assert_close(out, layer(x))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_graphed_accumulation_replays_the_eager_run(recipe):
    """Four micro-batches and an optimizer step in one captured step: the weights are cast in the first micro-batch
    of each replay (a cast cached eagerly or in another capture is never read) and every replay matches eager."""

    def build():
        torch.manual_seed(0)
        model = convert_to_float8(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32)).cuda(), recipe,
                                  min_features=0)  # fmt: skip
        return model, ampkernels.FusedAdamW(model.parameters(), lr=1e-2)

    def step_fn(model, opt):
        def step(xs):
            opt.zero_grad(set_to_none=True)
            total = 0.0
            for x in xs.unbind(0):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(x).float().square().mean()
                loss.backward()
                total = total + loss.detach()
            opt.step()
            return total

        return step

    gen = torch.Generator().manual_seed(3)
    batches = [torch.randn(4, 64, 64, generator=gen).cuda() for _ in range(4)]
    eager_model, eager_opt = build()
    eager = step_fn(eager_model, eager_opt)
    expected = [float(eager(xs)) for xs in batches]
    model, opt = build()
    graphed = ampkernels.capture_step(step_fn(model, opt), batches[0], models=model, optimizers=opt)
    assert [float(graphed(xs)) for xs in batches] == pytest.approx(expected, rel=1e-5)
    for p, q in zip(eager_model.parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
