"""What the fused optimizers do with inputs torch's would mishandle or that would corrupt a fused step: invalid
learning rates (numbers and tensors), a param group rejected by add_param_group, one parameter listed twice,
parameters left on the meta device, malformed state_dicts, and parameters loaded in place while master weights are
on."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from ampkernels import FusedAdam, FusedAdamW, FusedSGD, dispatch

CLASSES = [FusedAdamW, FusedSGD]


def _params(device, n=2, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(5 + i, generator=gen).to(device, dtype)) for i in range(n)]


def _backends(device):
    return [b for b in dispatch.BACKENDS["adam"] if dispatch.why_not("adam", b, device) is None]


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("lr", [-1e-3, math.nan, -math.inf])
def test_invalid_learning_rate_is_rejected_as_a_number_and_as_a_tensor(device, cls, lr):
    for value in (lr, torch.tensor(lr), torch.tensor(lr, device=device)):
        with pytest.raises(ValueError, match="Invalid learning rate"):
            cls(_params(device), lr=value)
        opt = cls(_params(device), lr=1e-3)
        with pytest.raises(ValueError, match="Invalid learning rate"):
            opt.add_param_group({"params": _params(device, seed=1), "lr": value})
        assert len(opt.param_groups) == 1


@pytest.mark.parametrize("cls", CLASSES)
def test_learning_rate_replaced_by_a_bad_host_value_fails_the_step(device, cls):
    """A scheduler (or user) that writes a negative float or CPU tensor into the group: the step checks host values
    for free and raises before writing anything."""
    ps = _params(device)
    opt = cls(ps, lr=1e-3)
    for p in ps:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in ps]
    for bad in (-0.1, torch.tensor(math.nan)):
        opt.param_groups[0]["lr"] = bad
        with pytest.raises(ValueError, match="Invalid learning rate"):
            opt.step()
        assert all(torch.equal(p, b) for p, b in zip(ps, before, strict=True))


def test_tensor_learning_rate_must_be_one_floating_element(device):
    with pytest.raises(ValueError, match="1-element"):
        FusedAdamW(_params(device), lr=torch.tensor([1e-3, 1e-3]))
    opt = FusedAdamW(_params(device))
    with pytest.raises(ValueError, match="floating point"):
        opt.add_param_group({"params": _params(device, seed=1), "lr": torch.tensor(1)})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("cls", CLASSES)
def test_rejected_param_group_leaves_the_optimizer_unchanged(device, cls):
    ps = _params(device)
    opt = cls(ps, lr=1e-2)
    bad = [torch.nn.Parameter(torch.randn(3, device=device)), torch.zeros(3, dtype=torch.int64, device=device)]
    with pytest.raises(TypeError, match="parameter 1 of param group 1 has dtype torch.int64"):
        opt.add_param_group({"params": bad})
    assert len(opt.param_groups) == 1
    # The good parameter of the rejected group can still be added, and the optimizer still steps.
    opt.add_param_group({"params": bad[:1]})
    for p in (*ps, bad[0]):
        p.grad = torch.ones_like(p)
    opt.step()
    assert len(opt.param_groups) == 2


@pytest.mark.parametrize("cls", CLASSES)
def test_a_parameter_listed_twice_is_an_error_at_the_first_step(device, cls):
    p, q = _params(device)
    with pytest.warns(UserWarning, match="duplicate parameters"):  # torch's warning at construction
        opt = cls([p, q, p], lr=1e-2)
    p.grad, q.grad = torch.ones_like(p), torch.ones_like(q)
    before = p.detach().clone()
    with pytest.raises(ValueError, match="parameters 0 and 2 of param group 0 are the same tensor"):
        opt.step()
    assert torch.equal(p, before)


@pytest.mark.parametrize("cls", CLASSES)
def test_an_optimizer_built_on_meta_parameters_says_so_at_its_step(device, cls):
    """Built before the model was materialized: to_empty gives the model new parameters, so the optimizer's stay on
    the meta device (torch's own optimizers then step nothing, silently). The step names the cause."""
    with torch.device("meta"):
        model = torch.nn.Linear(8, 4)
    opt = cls(model.parameters(), lr=1e-2)
    model.to_empty(device=device)
    model(torch.randn(2, 8, device=device)).sum().backward()
    with pytest.raises(RuntimeError, match="parameter 0 of param group 0 is on the meta device.*after that"):
        opt.step()


def _trained(device, cls=FusedAdamW):
    ps = _params(device)
    opt = cls(ps, lr=1e-2)
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    return ps, opt


@pytest.mark.parametrize(
    ("mutate", "error", "match"),
    [
        (lambda sd: sd.pop("state"), KeyError, "missing key 'state'"),
        (lambda sd: sd.update(param_groups={}), TypeError, "'param_groups' must be a list"),
        (lambda sd: sd["param_groups"].append(copy.deepcopy(sd["param_groups"][0])), ValueError, "2 param groups"),
        (lambda sd: sd["param_groups"][0]["params"].pop(), ValueError, r"param_groups\[0\] has 1 params"),
        (lambda sd: sd["param_groups"][0].update(lr=-1.0), ValueError, "Invalid learning rate"),
        (lambda sd: sd["state"][0].update(step="3"), TypeError, r"state\[0\]\['step'\] .* number or a 1-element"),
        (lambda sd: sd["state"][1].update(exp_avg=torch.zeros(2)), ValueError, r"state\[1\]\['exp_avg'\] .*shape"),
        (lambda sd: sd["state"][0].update(exp_avg_sq=[0.0] * 5), TypeError, r"'exp_avg_sq'.*floating-point tensor"),
        (lambda sd: sd["state"].update({0: 5}), TypeError, r"state\[0\] must be a dict"),
        # Adam's step would start a missing moment from zeros (m / eps for the second) or the bias corrections
        # from step 0.
        (lambda sd: sd["state"][1].pop("exp_avg_sq"), KeyError, r"state\[1\] \(parameter 1 .* but no 'exp_avg_sq'"),
        (lambda sd: sd["state"][0].pop("step"), KeyError, r"state\[0\] \(parameter 0 .* but no 'step'"),
    ],
    ids=["no-state", "groups-not-list", "group-count", "param-count", "bad-lr", "bad-step", "bad-shape",
         "not-tensor", "entry-not-dict", "no-second-moment", "no-step"],
)  # fmt: skip
def test_bad_state_dict_raises_naming_the_entry_and_loads_nothing(device, mutate, error, match):
    ps, opt = _trained(device)
    sd = copy.deepcopy(opt.state_dict())
    mutate(sd)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(error, match=match):
        opt.load_state_dict(sd)
    after = opt.state_dict()
    for key, entry in before["state"].items():
        for name, value in entry.items():
            assert torch.equal(torch.as_tensor(after["state"][key][name]), torch.as_tensor(value))


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("how", ["load_state_dict", "no_grad_copy", "resync_after_data_copy"])
def test_parameters_loaded_in_place_win_over_stale_master_weights(device, cls, how):
    """master_weights=True keeps a float32 copy that the kernels step. A parameter written from outside after that
    copy exists (a checkpoint loaded into the model) must be the truth for the next step: the step equals a fresh
    optimizer's step on the loaded values, not a step from the stale master."""
    dtype = torch.bfloat16
    options = dict(momentum=0.9) if cls is FusedSGD else {}
    for backend in _backends(device):
        model = torch.nn.Linear(8, 4).to(device, dtype)
        opt = cls(model.parameters(), lr=1e-2, master_weights=True, backend=backend, **options)
        for _ in range(2):
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            opt.step()
        loaded = torch.nn.Linear(8, 4).to(device, dtype)
        if how == "load_state_dict":
            model.load_state_dict(loaded.state_dict())
        elif how == "no_grad_copy":
            with torch.no_grad():
                for p, q in zip(model.parameters(), loaded.parameters(), strict=True):
                    p.copy_(q)
        else:  # .data writes bypass the version counter: resync_master_weights() is the documented remedy
            for p, q in zip(model.parameters(), loaded.parameters(), strict=True):
                p.data.copy_(q)
            opt.resync_master_weights()
        for p, q in zip(model.parameters(), loaded.parameters(), strict=True):
            assert torch.equal(p, q)
            if how == "resync_after_data_copy":
                assert torch.equal(opt.state[p]["master_param"], q.float())
        # The reference: an optimizer with the same moments and step counts whose master is the loaded value.
        grads = [torch.randn_like(p) for p in model.parameters()]
        twin = copy.deepcopy(opt.state_dict())
        fresh_model = copy.deepcopy(loaded)
        fresh = cls(fresh_model.parameters(), lr=1e-2, master_weights=True, backend=backend, **options)
        fresh.load_state_dict(twin)
        for p, q, g in zip(model.parameters(), fresh_model.parameters(), grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
            fresh.state[q]["master_param"].copy_(q)
        opt.step()
        fresh.step()
        for p, q in zip(model.parameters(), fresh_model.parameters(), strict=True):
            assert torch.equal(p, q), backend


def test_steps_of_the_optimizer_itself_do_not_count_as_loads(device):
    """The master holds more precision than the parameter: a step must not resync it from the rounded parameter."""
    for backend in _backends(device):
        p = torch.nn.Parameter(torch.randn(64, device=device).to(torch.bfloat16))
        opt = FusedAdam([p], lr=1e-3, master_weights=True, backend=backend)
        for _ in range(3):
            p.grad = torch.randn_like(p)
            opt.step()
        master = opt.state[p]["master_param"]
        assert not torch.equal(master, p.float()), f"{backend}: the master was overwritten by the rounded parameter"
