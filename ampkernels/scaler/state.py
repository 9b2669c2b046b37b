"""The loss scale's values and the checks of :class:`~ampkernels.FusedGradScaler`'s constructor and
``load_state_dict``: the float32 scale and its bounds, and every entry of a saved state, checked whole before any of
it is loaded (an entry that fails raises naming its key and leaves the scaler as it was)."""

from __future__ import annotations

import math
from typing import Any

import torch

from ampkernels.scaler import reference

# The largest count an int32 tracker holds (the growth and hysteresis trackers are int32 tensors, as stock's).
MAX_COUNT = 2**31 - 1


def as_float32(value: float) -> float:
    """``value`` as the float32 scale holds it: inf beyond float32's range, 0.0 below its smallest subnormal."""
    try:
        v = float(value)
    except OverflowError:  # an int beyond even float64
        v = math.inf if value > 0 else -math.inf
    return float(torch.tensor(v, dtype=torch.float64).float())


def init_scale_value(value: Any) -> float:
    """``init_scale`` as a number: a real number, or a 1-element real tensor without grad (stock takes a 0-d tensor)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.requires_grad or value.dtype == torch.bool or value.is_complex():
            raise ValueError(
                "FusedGradScaler: init_scale must be a finite number > 0 or a 1-element real tensor without grad, "
                f"got {value!r}"
            )
        value = value.item()
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and valid_scale(value)):
        raise ValueError(f"FusedGradScaler: init_scale must be a finite number > 0, got {value!r}")
    return value


def valid_scale(value: float) -> bool:
    """Whether ``value``, stored in the float32 scale, is finite and > 0 (1e-50 is > 0 but stored as 0.0)."""
    v = as_float32(value)
    return math.isfinite(v) and v > 0


def scale_bounds(min_scale: float | None, max_scale: float | None) -> tuple[float, float]:
    """The bounds the scale update clamps to (min_scale defaults to 2**-126), as the float32 values it uses."""
    lo = reference.FLOAT32_TINY if min_scale is None else min_scale
    return as_float32(lo), (math.inf if max_scale is None else as_float32(max_scale))


def bounds_problem(value: float, min_scale: float | None, max_scale: float | None) -> str | None:
    """Why a (valid) scale ``value`` may not be set: outside the bounds, the next update would move it the wrong
    way (an overflow would raise it to min_scale, a clean step cut it to max_scale). None when it lies within."""
    lo, hi = scale_bounds(min_scale, max_scale)
    v = as_float32(value)
    if v < lo:
        return f"is below min_scale ({reference.FLOAT32_TINY if min_scale is None else min_scale})"
    if v > hi:
        return f"is above max_scale ({max_scale})"
    return None


#: The entries stock's state_dict holds, with the types load_state_dict takes (a 1-element tensor as its value).
STATE_TYPES = {
    "scale": (int, float),
    "growth_factor": (int, float),
    "backoff_factor": (int, float),
    "growth_interval": (int,),
    "_growth_tracker": (int,),
}


def checked_values(state_dict: dict[str, Any], min_scale: float | None, max_scale: float | None) -> dict[str, Any]:
    """Stock's entries of ``state_dict`` as numbers, every entry (stock's and the extras) checked first. The scale
    must lie within the bounds the scaler will have after loading: the checkpoint's when it carries them, else
    ``min_scale`` / ``max_scale``."""
    values = {}  # the entries as numbers (a 1-element tensor is taken as its value)
    for key, types in STATE_TYPES.items():
        if key not in state_dict:
            raise KeyError(f"FusedGradScaler.load_state_dict: missing key '{key}'")
        value = state_dict[key]
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, types):
            raise TypeError(
                f"FusedGradScaler.load_state_dict: key '{key}' must be {' or '.join(t.__name__ for t in types)}, "
                f"got {type(state_dict[key]).__name__}"
            )
        values[key] = value
    check_extras(state_dict)
    scale = float(values["scale"])
    if not valid_scale(scale):
        raise ValueError(f"FusedGradScaler.load_state_dict: key 'scale' must be finite and > 0, got {scale}")
    # Within the bounds the scaler has after loading: the checkpoint's, when it carries them.
    if "hysteresis" in state_dict:
        bounds = state_dict.get("min_scale"), state_dict.get("max_scale")
    else:
        bounds = min_scale, max_scale
    problem = bounds_problem(scale, *bounds)
    if problem is not None:
        raise ValueError(f"FusedGradScaler.load_state_dict: key 'scale' ({scale}) {problem}")
    interval, tracker = values["growth_interval"], values["_growth_tracker"]
    if interval < 1:
        raise ValueError(f"FusedGradScaler.load_state_dict: key 'growth_interval' must be >= 1, got {interval}")
    # A tracker at or past the interval would never meet it again: the scale would never grow.
    if not 0 <= tracker < min(interval, MAX_COUNT):
        raise ValueError(
            f"FusedGradScaler.load_state_dict: key '_growth_tracker' must be >= 0 and < growth_interval "
            f"({interval}; and < 2**31 - 1: it is an int32 count), got {tracker}"
        )
    for key in ("growth_factor", "backoff_factor"):
        if not (math.isfinite(float(values[key])) and float(values[key]) > 0):
            raise ValueError(f"FusedGradScaler.load_state_dict: key '{key}' must be finite and > 0, got {values[key]}")
    return values


def check_extras(state_dict: dict[str, Any]) -> None:
    if "hysteresis" not in state_dict:
        return
    hysteresis = state_dict["hysteresis"]
    if isinstance(hysteresis, bool) or not isinstance(hysteresis, int) or not 1 <= hysteresis <= MAX_COUNT:
        raise ValueError(
            "FusedGradScaler.load_state_dict: key 'hysteresis' must be an int >= 1 and < 2**31 (its tracker is "
            f"an int32 tensor), got {hysteresis!r}"
        )
    # The tracker counts the overflows still absorbed: hysteresis after a growth, one less per overflow; above
    # hysteresis it would absorb more overflows in a row than the scaler is configured for.
    tracker = state_dict.get("_hysteresis_tracker", hysteresis)
    if isinstance(tracker, bool) or not isinstance(tracker, int) or not 0 <= tracker <= hysteresis:
        raise ValueError(
            "FusedGradScaler.load_state_dict: key '_hysteresis_tracker' must be an int >= 0 and <= hysteresis "
            f"({hysteresis}), got {tracker!r}"
        )
    for key in ("min_scale", "max_scale"):
        value = state_dict.get(key)
        ok = value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0)
        if key == "min_scale" and ok and value is not None:
            ok = math.isfinite(value)  # as the constructor requires
        if not ok:
            what = "None or finite and > 0" if key == "min_scale" else "None or > 0"
            raise ValueError(f"FusedGradScaler.load_state_dict: key '{key}' must be {what}, got {value!r}")
    low, high = state_dict.get("min_scale"), state_dict.get("max_scale")
    if low is not None and high is not None and low > high:
        raise ValueError(f"FusedGradScaler.load_state_dict: key 'min_scale' ({low}) is above key 'max_scale' ({high})")
