"""The state snapshot behind ``capture_step(restore=True)``, on the CPU: steps taken after a snapshot and undone by
``restore()`` leave no trace. The steps that follow equal those of a fresh copy that never took them (losses,
parameters, buffers, optimizer state, scaler state, bit for bit), and the state created in between keeps its
tensors (a CUDA graph captured over them keeps their addresses). Also: which objects ``capture_step`` finds from a
step function."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import ampkernels
from ampkernels import FusedGradScaler
from ampkernels.cuda_graph import StateSnapshot, _find_state, snapshot_state


def _model(seed=0, dropout=0.0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16),
        torch.nn.BatchNorm1d(16),
        torch.nn.GELU(),
        torch.nn.Dropout(dropout),
        torch.nn.Linear(16, 3),
    )


def _batches(n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)) for _ in range(n)]


def _optimizer(kind, model):
    params = model.parameters()
    if kind == "FusedAdamW":
        return ampkernels.FusedAdamW(params, lr=torch.tensor(1e-2), weight_decay=0.1)
    if kind == "FusedAdamW-master":
        return ampkernels.FusedAdamW(params, lr=1e-2, master_weights=True)
    if kind == "FusedSGD":
        return ampkernels.FusedSGD(params, lr=1e-2, momentum=0.9)
    if kind == "torch-AdamW":
        return torch.optim.AdamW(params, lr=1e-2, foreach=False)
    raise AssertionError(kind)


def _make_step(model, opt, scaler):
    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.clip_grad_norm_(opt, max_norm=1.0)
        scaler.step(opt)
        scaler.update()
        return loss.detach()

    return step


def _state_tensors(opt):
    return {(id(p), k): v for p, s in opt.state.items() for k, v in s.items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("kind", ["FusedAdamW", "FusedAdamW-master", "FusedSGD", "torch-AdamW"])
def test_steps_undone_by_restore_leave_no_trace(kind):
    """Three steps on one batch, then restore: the run that follows equals a fresh run, bit for bit, and the
    lazily created state (moments, step counts, master weights, the scale) keeps its tensors."""
    batches = _batches(6)
    dtype = torch.bfloat16 if kind == "FusedAdamW-master" else torch.float32

    def build():
        model = _model().to(dtype)
        opt = _optimizer(kind, model)
        scaler = FusedGradScaler("cpu", init_scale=2.0**8, growth_interval=2, telemetry=True)
        return model, opt, scaler

    model, opt, scaler = build()
    fresh_model, fresh_opt, fresh_scaler = build()
    snap = snapshot_state(model, opt, scaler)
    step = _make_step(model, opt, scaler)
    x0, y0 = (t.to(dtype) for t in batches[0])
    for _ in range(3):
        step(x0, y0)
    created = _state_tensors(opt)
    scale_tensor = scaler._scale
    assert created and scaler._counters is not None
    snap.restore()

    assert _state_tensors(opt).keys() == created.keys()
    assert all(_state_tensors(opt)[k] is v for k, v in created.items()), "restore replaced a state tensor"
    assert scaler._scale is scale_tensor and scaler.get_scale() == 2.0**8
    assert int(scaler._growth_tracker) == 0
    assert scaler.telemetry()["updates"] == 0 and scaler.telemetry()["skipped_steps"] == 0
    assert all(p.grad is None for p in model.parameters())
    for name, buf in model.named_buffers():
        assert torch.equal(buf, dict(fresh_model.named_buffers())[name]), name

    fresh_step = _make_step(fresh_model, fresh_opt, fresh_scaler)
    for x, y in batches[1:]:
        x, y = x.to(dtype), y.to(dtype)
        assert torch.equal(step(x, y), fresh_step(x, y))
        assert scaler.get_scale() == fresh_scaler.get_scale()
    for a, b in zip(model.state_dict().values(), fresh_model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    ours, theirs = opt.state_dict(), fresh_opt.state_dict()
    for sa, sb in zip(ours["state"].values(), theirs["state"].values(), strict=True):
        assert sa.keys() == sb.keys()
        for key in sa:
            assert torch.equal(torch.as_tensor(sa[key]), torch.as_tensor(sb[key])), key
    assert scaler.telemetry() == fresh_scaler.telemetry()


def test_restore_puts_back_existing_state_and_group_tensors():
    """An optimizer and scaler that have stepped: restore writes their saved values into the same tensors, also a
    0-d learning rate changed in between, and the per-optimizer stage."""
    model = _model()
    lr = torch.tensor(1e-2)
    opt = ampkernels.FusedAdamW(model.parameters(), lr=lr)
    scaler = FusedGradScaler("cpu", init_scale=2.0**8)
    step = _make_step(model, opt, scaler)
    (x, y), (x1, y1) = _batches(2)
    step(x, y)
    saved_state = copy.deepcopy(opt.state_dict())
    saved_params = [p.detach().clone() for p in model.parameters()]
    saved_grads = [p.grad.clone() for p in model.parameters()]
    grads = [p.grad for p in model.parameters()]
    snap = StateSnapshot([model], [opt], [scaler])
    step(x1, y1)
    lr.fill_(5.0)
    scaler._per_optimizer_states[id(opt)]["stage"] = "poisoned"
    snap.restore()
    assert opt.param_groups[0]["lr"] is lr and float(lr) == pytest.approx(1e-2)
    assert all(torch.equal(p, s) for p, s in zip(model.parameters(), saved_params, strict=True))
    assert all(p.grad is g for p, g in zip(model.parameters(), grads, strict=True))
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), saved_grads, strict=True))
    assert id(opt) not in scaler._per_optimizer_states
    restored = opt.state_dict()
    for key, entry in saved_state["state"].items():
        for name, value in entry.items():
            assert torch.equal(torch.as_tensor(restored["state"][key][name]), torch.as_tensor(value)), name


def test_restore_without_rebinding_writes_into_the_current_gradients():
    """After a capture the gradients are the graph's buffers: restore(rebind_gradients=False) keeps them and writes
    the saved values (zeros where there was no gradient)."""
    model = torch.nn.Linear(3, 2)
    model.weight.grad = torch.randn(2, 3)
    saved = model.weight.grad.clone()
    snap = snapshot_state(models=model)
    buffers = [torch.full((2, 3), 7.0), torch.full((2,), 7.0)]
    model.weight.grad, model.bias.grad = buffers
    snap.restore(rebind_gradients=False)
    assert model.weight.grad is buffers[0] and torch.equal(buffers[0], saved)
    assert model.bias.grad is buffers[1] and torch.equal(buffers[1], torch.zeros(2))
    snap.restore()
    assert model.bias.grad is None and torch.equal(model.weight.grad, saved)


def test_restore_rewinds_the_random_number_generator():
    model = _model(dropout=0.5)
    fresh = copy.deepcopy(model)
    opt, fresh_opt = _optimizer("FusedAdamW", model), _optimizer("FusedAdamW", fresh)
    scaler, fresh_scaler = FusedGradScaler("cpu"), FusedGradScaler("cpu")
    torch.manual_seed(123)
    snap = snapshot_state(model, opt, scaler)
    step = _make_step(model, opt, scaler)
    batches = _batches(4)
    for _ in range(2):
        step(*batches[0])
    snap.restore()
    ours = [step(x, y) for x, y in batches[1:]]
    torch.manual_seed(123)
    fresh_step = _make_step(fresh, fresh_opt, fresh_scaler)
    assert all(torch.equal(a, fresh_step(x, y)) for a, (x, y) in zip(ours, batches[1:], strict=True))


def test_snapshot_rejects_what_it_cannot_save():
    with pytest.raises(TypeError, match=r"optimizers\[0\] is a Linear, not a Optimizer"):
        snapshot_state(optimizers=[torch.nn.Linear(2, 2)])
    with pytest.raises(TypeError, match=r"scalers\[1\]"):
        snapshot_state(scalers=[FusedGradScaler("cpu"), "scaler"])


class _Trainer:
    def __init__(self):
        self.model = _model()
        self.opt = _optimizer("FusedSGD", self.model)
        self.scaler = FusedGradScaler("cpu")

    def step(self, x, y):
        return _make_step(self.model, self.opt, self.scaler)(x, y)


def test_find_state_follows_closures_methods_and_partials():
    model = _model()
    opt = _optimizer("FusedAdamW", model)
    scaler = FusedGradScaler("cpu")
    inner = _make_step(model, opt, scaler)

    def outer(x, y):  # a closure over a closure
        return inner(x, y)

    for fn in (inner, outer, functools.partial(lambda s, x, y: s(x, y), inner)):
        models, opts, scalers = _find_state(fn)
        assert models == [model] and opts == [opt] and scalers == [scaler]
    trainer = _Trainer()
    models, opts, scalers = _find_state(trainer.step)
    assert models == [trainer.model] and opts == [trainer.opt] and scalers == [trainer.scaler]
    state = {"model": model, "opts": [opt]}
    models, opts, scalers = _find_state(lambda x: state["opts"][0].step() or state["model"](x))
    assert models == [model] and opts == [opt] and scalers == []
    assert _find_state(lambda x: x * 2) == ([], [], [])


def test_disabled_scaler_and_models_without_optimizer_are_handled():
    model = _model()
    scaler = FusedGradScaler("cpu", enabled=False)
    snap = snapshot_state(models=[model], scalers=[scaler])
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm1d):
            m.running_mean.add_(1.0)
            m.num_batches_tracked.add_(3)
    snap.restore()
    fresh = _model()
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_restore_does_not_count_as_a_write_to_the_parameters():
    """A bumped version counter means "loaded from outside" to an optimizer with master weights, which would then
    resync the master from the rounded parameter (and, in a capture, record that copy into the graph)."""
    model = _model().to(torch.bfloat16)
    opt = _optimizer("FusedAdamW-master", model)
    snap = snapshot_state(model, opt)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    versions = [p._version for p in model.parameters()]
    snap.restore()
    assert [p._version for p in model.parameters()] == versions


def _wide_model():
    """The first weight (128 x 64) is large enough for quantized moments."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 4))


def _wide_batches(n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 64, generator=gen), torch.randn(8, 4, generator=gen)) for _ in range(n)]


def _loaded(kind):
    """A model and a fused optimizer resumed from a torch optimizer's checkpoint: state in another format than the
    fused step keeps (no 'step' for SGD's momentum buffer, float moments for quantized ones, a Python step count)."""
    model = _wide_model()
    if kind == "FusedSGD":
        source, opt = torch.optim.SGD, functools.partial(ampkernels.FusedSGD, lr=0.1, momentum=0.9)
    else:
        bits = {"FusedAdamW-8bit": "8bit", "FusedAdamW-4bit": "4bit", "FusedAdamW-int-step": None}[kind]
        source = functools.partial(torch.optim.AdamW, foreach=False)
        opt = functools.partial(ampkernels.FusedAdamW, exp_avg_dtype=bits, exp_avg_sq_dtype=bits)
    trained = source(model.parameters(), lr=1e-2, **({"momentum": 0.9} if kind == "FusedSGD" else {}))
    for x, y in _wide_batches(2, seed=3):
        trained.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        trained.step()
    saved = copy.deepcopy(trained.state_dict())
    if kind == "FusedAdamW-int-step":
        for entry in saved["state"].values():
            entry["step"] = int(entry["step"])
    twins = []
    for _ in range(2):
        twin = copy.deepcopy(model)
        twin_opt = opt(twin.parameters(), lr=1e-2)
        twin_opt.load_state_dict(copy.deepcopy(saved))
        twins.append((twin, twin_opt))
    return twins


def _plain_step(model, opt):
    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def _assert_same_state(opt, fresh_opt):
    ours, theirs = opt.state_dict(), fresh_opt.state_dict()
    for sa, sb in zip(ours["state"].values(), theirs["state"].values(), strict=True):
        assert sa.keys() == sb.keys()
        for key in sa:
            assert type(sa[key]) is type(sb[key]), key
            assert torch.equal(torch.as_tensor(sa[key]), torch.as_tensor(sb[key])), key


@pytest.mark.parametrize("kind", ["FusedSGD", "FusedAdamW-8bit", "FusedAdamW-4bit", "FusedAdamW-int-step"])
def test_restore_puts_back_a_loaded_state_that_the_first_step_converted(kind):
    """An optimizer resumed from torch's checkpoint converts the loaded state at its first step (SGD's buffer gets
    its step count of 1, float moments become codes, a Python step count a tensor). Steps undone by restore must
    leave the state the next step starts from, in the tensors the steps used (a graph captured over them keeps
    their addresses): the run that follows equals that of a twin that never took them, and no state is lost."""
    (model, opt), (fresh, fresh_opt) = _loaded(kind)
    snap = snapshot_state(model, opt)
    step = _plain_step(model, opt)
    x0, y0 = _wide_batches(1)[0]
    for _ in range(3):
        step(x0, y0)
    used = _state_tensors(opt)
    snap.restore()
    assert _state_tensors(opt).keys() == used.keys()
    assert all(_state_tensors(opt)[k] is v for k, v in used.items()), "restore replaced a state tensor"
    fresh_step = _plain_step(fresh, fresh_opt)
    for x, y in _wide_batches(4)[1:]:
        assert torch.equal(step(x, y), fresh_step(x, y))
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q)
    _assert_same_state(opt, fresh_opt)


@pytest.mark.parametrize("bits", ["8bit", "4bit"])
def test_restore_leaves_a_fresh_low_bit_state_that_saves_and_loads(bits):
    """What a fresh optimizer with quantized moments creates at its first step, reset by restore, is the state of a
    fresh optimizer that took that step's Python side: its code widths among it. A captured run steps that state
    by replays alone (no Python): a checkpoint of it must load, and resume as the twin does."""
    model = _wide_model()
    opt = ampkernels.FusedAdamW(model.parameters(), lr=1e-2, exp_avg_dtype=bits, exp_avg_sq_dtype=bits)
    snap = snapshot_state(model, opt)
    step = _plain_step(model, opt)
    x0, y0 = _wide_batches(1)[0]
    for _ in range(3):
        step(x0, y0)
    snap.restore()
    width = {"8bit": 8, "4bit": 4}[bits]
    quantized = [s for s in opt.state.values() if s["exp_avg"].dtype == torch.uint8]
    assert quantized and all(s["exp_avg_bits"] == s["exp_avg_sq_bits"] == width for s in quantized)
    twin = copy.deepcopy(model)
    twin_opt = ampkernels.FusedAdamW(twin.parameters(), lr=1e-2, exp_avg_dtype=bits, exp_avg_sq_dtype=bits)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    twin_step = _plain_step(twin, twin_opt)
    for x, y in _wide_batches(3)[1:]:
        assert torch.equal(step(x, y), twin_step(x, y))
    _assert_same_state(opt, twin_opt)


def test_restore_keeps_the_loaded_state_of_a_parameter_the_steps_left_alone():
    """A parameter without a gradient in the undone steps (frozen for them, or trained by another captured step) keeps
    its loaded state as it was (float moments that its first step will quantize), not the converted values."""
    (model, opt), (fresh, fresh_opt) = _loaded("FusedAdamW-8bit")
    frozen = model[0].weight
    loaded = {k: v.clone() for k, v in opt.state[frozen].items() if isinstance(v, torch.Tensor)}
    snap = snapshot_state(model, opt)
    x0, y0 = _wide_batches(1)[0]
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x0), y0).backward()
        frozen.grad = None
        opt.step()
    snap.restore()
    assert opt.state[frozen].keys() == loaded.keys()
    for key, value in loaded.items():
        assert opt.state[frozen][key].dtype == value.dtype and torch.equal(opt.state[frozen][key], value), key
    step, fresh_step = _plain_step(model, opt), _plain_step(fresh, fresh_opt)
    for x, y in _wide_batches(4)[1:]:
        assert torch.equal(step(x, y), fresh_step(x, y))
    _assert_same_state(opt, fresh_opt)
