"""FusedGradScaler's ``state_dict``, ``load_state_dict`` and pickling: interchangeable with the stock scaler's, and
clear errors naming the key for missing, wrong-typed or out-of-range entries.
"""

from __future__ import annotations

import io
import math
import pickle
import re

import pytest
import torch
from grad_scaler_common import (
    STOCK_KEYS,
    Scenario,
    Stock,
    assert_same_trajectory,
    drive,
    key_pattern,
    train,
)

from ampkernels import FusedGradScaler

CONTINUE = Scenario(("adam_foreach",), "mlp", steps=8, inject={2: "middle"})
WARMUP = Scenario(("sgd",), "mlp", steps=7, inject={1: "first", 5: "last"})


def _through_torch_save(sd: dict) -> dict:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("destination_state", ["fresh", "already_used"])
@pytest.mark.parametrize("direction", ["stock_to_ours", "ours_to_stock"])
def test_state_dict_interoperates_with_stock(device, direction, destination_state):
    src_cls, dst_cls = (Stock, FusedGradScaler) if direction == "stock_to_ours" else (FusedGradScaler, Stock)
    source = src_cls(device, init_scale=2.0**9, growth_interval=3)
    train(source, device, WARMUP, seed=1)
    sd = _through_torch_save(source.state_dict())  # checkpoints must load with weights_only=True
    assert sd["_growth_tracker"] != 0 and sd["scale"] != 2.0**9, "warm-up should leave a non-trivial state"

    def loaded(cls):
        scaler = cls(device, init_scale=2.0**3, growth_interval=50, growth_factor=8.0)
        if destination_state == "already_used":
            train(scaler, device, Scenario(("sgd",), "mlp", steps=2, inject={}), seed=2)
        scaler.load_state_dict(sd)
        return scaler

    dst, reference = loaded(dst_cls), loaded(Stock)
    assert {k: dst.state_dict()[k] for k in STOCK_KEYS} == {k: sd[k] for k in STOCK_KEYS}
    assert_same_trajectory(train(dst, device, CONTINUE, seed=3), train(reference, device, CONTINUE, seed=3))


@pytest.mark.parametrize("key", STOCK_KEYS)
def test_load_state_dict_with_missing_key_names_the_key(device, key):
    source = FusedGradScaler(device, init_scale=2.0**9, growth_interval=3)
    train(source, device, Scenario(("sgd",), "mlp", steps=2, inject={}))
    sd = dict(source.state_dict())
    del sd[key]
    with pytest.raises((KeyError, TypeError, ValueError), match=key_pattern(key)):
        FusedGradScaler(device).load_state_dict(sd)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("scale", "big"),
        ("growth_factor", [2.0]),
        ("backoff_factor", "half"),
        ("growth_interval", "3"),
        ("_growth_tracker", None),
    ],
)
def test_load_state_dict_with_wrong_type_names_the_key(device, key, value):
    sd = dict(FusedGradScaler(device, init_scale=2.0**9).state_dict())
    sd[key] = value
    with pytest.raises((KeyError, TypeError, ValueError), match=key_pattern(key)):
        FusedGradScaler(device).load_state_dict(sd)


def test_state_dict_round_trip_keeps_hysteresis_progress(device):
    """One overflow absorbed by hysteresis=2 before the checkpoint: the first overflow after loading backs off."""
    src = FusedGradScaler(device, init_scale=2.0**10, growth_interval=100, hysteresis=2)
    drive(src, device, "o")
    assert src.get_scale() == 2.0**10
    dst = FusedGradScaler(device, init_scale=2.0**10, growth_interval=100, hysteresis=2)
    dst.load_state_dict(_through_torch_save(src.state_dict()))
    assert drive(dst, device, "o")[0] == [2.0**9]


def test_pickle_fresh_scaler_round_trips(device):
    kw = {"init_scale": 2.0**7, "growth_factor": 4.0, "backoff_factor": 0.25, "growth_interval": 5}
    ours = FusedGradScaler(device, **kw, hysteresis=2, min_scale=1.0, max_scale=2.0**20)
    copy = pickle.loads(pickle.dumps(ours))
    assert type(copy) is FusedGradScaler
    assert copy.get_scale() == 2.0**7 and copy.is_enabled()
    assert (copy.get_growth_factor(), copy.get_backoff_factor(), copy.get_growth_interval()) == (4.0, 0.25, 5)
    assert drive(copy, device, "oo") == drive(ours, device, "oo")


def test_pickled_scaler_continues_like_the_original(device):
    ours = FusedGradScaler(device, init_scale=2.0**9, growth_interval=3)
    train(ours, device, WARMUP, seed=1)
    copy = pickle.loads(pickle.dumps(ours))
    assert_same_trajectory(train(copy, device, CONTINUE, seed=3), train(ours, device, CONTINUE, seed=3))


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("scale", 0.0, "finite and > 0"),
        ("scale", math.inf, "finite and > 0"),
        ("growth_interval", 0, ">= 1"),
        ("_growth_tracker", -1, ">= 0"),
        ("growth_factor", math.nan, "finite and > 0"),
        ("backoff_factor", -0.5, "finite and > 0"),
    ],
)
def test_load_state_dict_with_out_of_range_value_names_the_key(device, key, value, message):
    sd = FusedGradScaler(device).state_dict()
    sd[key] = value
    scaler = FusedGradScaler(device, init_scale=4.0)
    with pytest.raises(ValueError, match=key_pattern(key) + ".*" + re.escape(message)):
        scaler.load_state_dict(sd)
    assert scaler.get_scale() == 4.0  # nothing loaded


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("hysteresis", 0),
        ("hysteresis", "2"),
        ("_hysteresis_tracker", -1),
        ("min_scale", -1.0),
        ("max_scale", "inf"),
        ("min_scale", math.inf),
        ("max_scale", 0.5),  # below the checkpoint's min_scale (1.0)
    ],
)
def test_load_state_dict_with_bad_extras_names_the_key(device, key, value):
    sd = FusedGradScaler(device, hysteresis=2, min_scale=1.0, max_scale=2.0**20).state_dict()
    sd[key] = value
    with pytest.raises(ValueError, match=key_pattern(key)):
        FusedGradScaler(device).load_state_dict(sd)


@pytest.mark.parametrize(
    ("source_bounds", "bounds", "scale", "message"),
    [
        (None, {}, 1e-50, "finite and > 0"),  # > 0 as a double, 0.0 in the float32 scale
        (None, {}, 2.0**-130, r"below min_scale \(1.17.*e-38\)"),  # the default floor, 2**-126
        (None, {"min_scale": 4.0}, 1.0, r"below min_scale \(4.0\)"),
        (None, {"max_scale": 2.0**10}, 3000.0, r"above max_scale \(1024.0\)"),
        ({"min_scale": 2.0, "max_scale": 2.0**12}, {}, 1.0, r"below min_scale \(2.0\)"),  # the checkpoint's bounds
    ],
    ids=["float32_underflow", "below_default_floor", "below_min_scale", "above_max_scale", "checkpoint_bounds"],
)
def test_load_state_dict_with_a_scale_outside_the_bounds_names_the_key(device, source_bounds, bounds, scale, message):
    """Stock's checkpoints carry no bounds: the scale must lie within the loading scaler's; ours with bounds carry
    theirs, which the scaler takes over (and which the scale must lie within)."""
    source = Stock(device) if source_bounds is None else FusedGradScaler(device, init_scale=2.0**4, **source_bounds)
    sd = source.state_dict()
    sd["scale"] = scale
    scaler = FusedGradScaler(device, init_scale=8.0, **bounds)
    with pytest.raises(ValueError, match=key_pattern("scale") + ".*" + message):
        scaler.load_state_dict(sd)
    assert scaler.get_scale() == 8.0


def test_load_state_dict_takes_a_scale_within_the_checkpoints_bounds(device):
    sd = FusedGradScaler(device, init_scale=2.0**4, min_scale=0.5, max_scale=2.0**12).state_dict()
    sd["scale"] = 1.0
    scaler = FusedGradScaler(device, init_scale=8.0, min_scale=4.0)  # below this scaler's bound, within the source's
    scaler.load_state_dict(sd)
    assert scaler.get_scale() == 1.0
    assert drive(scaler, device, "o")[0] == [0.5]
