"""How the fused optimizers hold their per-parameter state, and how a state_dict saves it.

A moment is stored in one of four formats (``_constants.STATE_*``): float32, bfloat16, or 8-bit / 4-bit block
floating point codes (``reference.quantize_blockwise``). Inside the optimizer a quantized moment keeps the moment's
own key: ``state["exp_avg"]`` holds the uint8 codes, beside ``state["exp_avg_scale"]`` (the block exponents) and
``state["exp_avg_bits"]`` (the code's width, 8 or 4). A state_dict saves the codes as ``exp_avg_codes`` instead
(``SAVED_CODES_KEYS`` says why).

What the optimizers call, all on one parameter's state dict (or a state_dict):

* options: :func:`option_dtype` (an ``exp_avg_dtype`` value, normalised), :func:`quantized_option`,
  :func:`storage_format` (the format a parameter's moment takes);
* the step's tensors: :func:`float_state`, :func:`step_count`, :func:`moment` (created, or converted from what is
  held), :func:`decode_held` (codes back to float32), :func:`expected_shape`;
* saving: :func:`encode_state_dict`, :func:`dequantize_state_dict`;
* loading: :func:`codes_under_moment_names`, :func:`check_saved_codes`, :func:`check_saved_float`,
  :func:`check_saved_adam_entry`, :func:`decode_loaded`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ampkernels._constants import QUANT_MIN_NUMEL, STATE_BF16, STATE_F32, STATE_Q4, STATE_Q8
from ampkernels.optim import reference

#: The moments that may be stored in another format than the parameter's (FusedAdam's).
MOMENT_KEYS = ("exp_avg", "exp_avg_sq")

# exp_avg_dtype / exp_avg_sq_dtype values -> (canonical value kept in the param group, storage format).
_MOMENT_DTYPES = {
    torch.float32: STATE_F32,
    torch.bfloat16: STATE_BF16,
    torch.uint8: STATE_Q8,
    torch.uint4: STATE_Q4,
}
_MOMENT_ALIASES = {
    "8bit": torch.uint8,
    "4bit": torch.uint4,
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
# The names a state_dict's param groups save those dtypes under: torch.distributed.checkpoint's full_state_dict
# gathering takes tensors and plain Python values only (a torch.dtype fails it: "Unexpected value type").
_MOMENT_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.uint8: "8bit", torch.uint4: "4bit"}
_QUANTIZED = (STATE_Q8, STATE_Q4)
# A quantized moment's state names its code's width: state["exp_avg_bits"] = 8 (checkpoints say what they hold; an
# int, as torch's load_state_dict would take a string apart).
_CODE_NAMES = {STATE_Q8: 8, STATE_Q4: 4}
_CODE_FORMATS = {name: fmt for fmt, name in _CODE_NAMES.items()}
#: The names a state_dict saves quantized moments under. torch's optimizers read 'exp_avg' and 'exp_avg_sq' as float
#: moments, and their load_state_dict casts uint8 codes to float without a word: under other names their step fails
#: instead (KeyError 'exp_avg'). Inside the optimizer the codes keep the moment's own name.
SAVED_CODES_KEYS = {"exp_avg": "exp_avg_codes", "exp_avg_sq": "exp_avg_sq_codes"}
#: The float formats' dtypes.
FORMAT_DTYPES = {STATE_F32: torch.float32, STATE_BF16: torch.bfloat16}


def is_quantized(fmt: int) -> bool:
    return fmt in _QUANTIZED


def _is_codes(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == torch.uint8


# ---- options ----


def option_dtype(value: Any, name: str) -> torch.dtype | None:
    """The canonical ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` of ``value`` (None: the default)."""
    if value is None:
        return None
    dtype = _MOMENT_ALIASES.get(value, value) if isinstance(value, str) else value
    if not isinstance(dtype, torch.dtype) or dtype not in _MOMENT_DTYPES:  # (a list or dict is not hashable)
        raise ValueError(
            f"{name} must be None, torch.float32 / 'fp32', torch.bfloat16 / 'bf16', torch.uint8 / '8bit' or "
            f"torch.uint4 / '4bit', got {value!r}"
        )
    return dtype


def quantized_option(dtype: Any) -> bool:
    """Whether a canonical ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` asks for codes."""
    return _MOMENT_DTYPES.get(dtype) in _QUANTIZED


def storage_format(dtype: torch.dtype, p: torch.Tensor, local: torch.Tensor, where: str) -> int:
    """The format (``_constants.STATE_*``) a moment of parameter ``p`` (``local``: the shard the kernels step) takes
    for the canonical option ``dtype``: quantized only with 2 or more dimensions and ``QUANT_MIN_NUMEL`` elements,
    and only for a contiguous parameter (blocks run along the last dimension). ``where`` starts the error."""
    fmt = _MOMENT_DTYPES[dtype]
    if fmt in _QUANTIZED:
        if p.dim() < 2 or p.numel() < QUANT_MIN_NUMEL:
            return STATE_F32
        if not local.is_contiguous():
            raise ValueError(
                f"{where}={dtype} needs contiguous parameters (blocks run along the last dimension); got one of shape "
                f"{tuple(p.shape)} with strides {local.stride()}"
            )
    return fmt


# ---- the step's tensors ----


def float_state(state: dict, key: str, p: torch.Tensor, dtype: torch.dtype, init=None) -> torch.Tensor:
    """``state[key]`` as a tensor shaped and strided like ``p`` of ``dtype`` on ``p``'s device (created or
    converted; a conversion happens only when a loaded state_dict differs, e.g. torch's CPU steps)."""
    value = state.get(key)
    if value is None:
        value = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        if init is not None:
            value.copy_(init)
    elif value.dtype != dtype or value.device != p.device or value.stride() != p.stride():
        value = torch.empty_like(p, dtype=dtype, memory_format=torch.preserve_format).copy_(value)
    state[key] = value
    return value


def step_count(state: dict, p: torch.Tensor, default: float = 0.0) -> torch.Tensor:
    """``state["step"]`` as a 0-d float32 tensor on ``p``'s device (created as ``default``, or converted)."""
    value = state.get("step")
    if value is None:
        value = torch.tensor(default, dtype=torch.float32, device=p.device)
    elif not isinstance(value, torch.Tensor):
        value = torch.tensor(float(value), dtype=torch.float32, device=p.device)
    elif value.dtype != torch.float32 or value.device != p.device or value.dim() != 0:
        value = value.to(device=p.device, dtype=torch.float32).reshape(())
    state["step"] = value
    return value


def moment(state: dict, key: str, p: torch.Tensor, fmt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``state[key]`` in format ``fmt`` for parameter (shard) ``p``, and its block exponents (an empty uint8 tensor
    when not quantized): created as zeros, or converted from what is held (codes of another width are decoded
    first; a float moment, torch's or a float32 optimizer's, is quantized)."""
    scale_key, code_key = f"{key}_scale", f"{key}_bits"
    if _CODE_FORMATS.get(state.get(code_key)) != fmt:  # stored in another code (the option changed)
        decode_held(state, key, p.shape)
    value, scales = state.get(key), state.get(scale_key)
    if fmt not in _QUANTIZED:
        value = float_state(state, key, p, FORMAT_DTYPES[fmt])
        return value, torch.empty(0, dtype=torch.uint8, device=p.device)
    codes_shape, scales_shape = reference.quant_layout(p.shape, fmt)
    state[code_key] = _CODE_NAMES[fmt]
    if value is None:
        value = torch.zeros(codes_shape, dtype=torch.uint8, device=p.device)
        scales = torch.zeros(scales_shape, dtype=torch.uint8, device=p.device)
    elif value.dtype != torch.uint8:
        value, scales = reference.quantize_blockwise(value.to(p.device, torch.float32), fmt, key == "exp_avg_sq")
    else:
        value, scales = value.to(p.device), scales.to(p.device)
    state[key], state[scale_key] = value, scales
    return value, scales


def decode_held(state: dict, key: str, shape: torch.Size) -> None:
    """``state[key]``, if held as codes, decoded to float32 of ``shape`` (the group's storage option changed)."""
    held = _CODE_FORMATS.get(state.get(f"{key}_bits"))
    if held is None:
        return
    codes, scales = state[key], state[f"{key}_scale"]
    state[key] = reference.dequantize_blockwise(codes, scales, held, key == "exp_avg_sq", shape)
    for k in (f"{key}_scale", f"{key}_bits"):
        state.pop(k, None)


def expected_shape(state: dict, key: str, value: torch.Tensor, shape: torch.Size) -> tuple[int, ...]:
    """The shape ``state[key]`` (``value``) must have for a parameter (shard) of ``shape``: the parameter's, or
    for codes and their block exponents their layout (``reference.quant_layout``)."""
    if value.dtype == torch.uint8:
        moment_key = key.removesuffix("_scale")
        fmt = _CODE_FORMATS.get(state.get(f"{moment_key}_bits"))
        if fmt is not None and len(shape) >= 1:
            codes_shape, scales_shape = reference.quant_layout(shape, fmt)
            return tuple(scales_shape if key.endswith("_scale") else codes_shape)
    return tuple(shape)


# ---- saving ----


def encode_state_dict(sd: dict[str, Any]) -> dict[str, Any]:
    """``sd`` (torch's state_dict of the optimizer) as saved: codes under their own names (``exp_avg_codes``), and
    the param groups' ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` by name ("8bit", "bf16", ...: what the constructor
    takes), so that every value is a plain type."""
    for saved_id, entry in sd["state"].items():
        if any(_is_codes(entry.get(key)) for key in SAVED_CODES_KEYS):
            sd["state"][saved_id] = {  # a new dict: torch's state_dict shares the entries with the optimizer's state
                SAVED_CODES_KEYS[key] if key in SAVED_CODES_KEYS and _is_codes(value) else key: value
                for key, value in entry.items()
            }
    for group in sd["param_groups"]:  # (torch's state_dict packs new group dicts)
        for key in ("exp_avg_dtype", "exp_avg_sq_dtype"):
            group[key] = _MOMENT_NAMES.get(group.get(key), group.get(key))
    return sd


def dequantize_state_dict(sd: dict[str, Any], shapes: Iterable[tuple[Any, torch.Size]]) -> dict[str, Any]:
    """``sd`` with its codes decoded to float32 moments, what torch.optim.Adam/AdamW load; ``shapes``: (the
    state_dict's entry id, the shape of the parameter's local tensor) of every parameter."""
    for saved_id, shape in shapes:
        entry = sd["state"].get(saved_id)
        if entry is None:
            continue
        entry = sd["state"][saved_id] = dict(entry)
        for key in MOMENT_KEYS:
            if _is_codes(entry.get(key)):
                fmt = _CODE_FORMATS[entry.pop(f"{key}_bits")]
                entry[key] = reference.dequantize_blockwise(
                    entry[key], entry.pop(f"{key}_scale"), fmt, key == "exp_avg_sq", shape
                )
    for g in sd["param_groups"]:
        for key in ("exp_avg_dtype", "exp_avg_sq_dtype"):
            if quantized_option(g.get(key)):
                g[key] = torch.float32
    return sd


# ---- loading ----


def codes_under_moment_names(state_dict: Any, where: str) -> Any:
    """``state_dict`` with saved codes (``exp_avg_codes``) back under their moments' names, as the optimizer holds
    them; ``where`` starts the errors. Anything that is not a state_dict is returned as it is (the caller's checks
    say what is wrong)."""
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("state"), dict):
        return state_dict
    state = dict(state_dict["state"])
    for saved_id, entry in state.items():
        if not isinstance(entry, dict) or not any(name in entry for name in SAVED_CODES_KEYS.values()):
            continue
        entry = state[saved_id] = dict(entry)
        for key, name in SAVED_CODES_KEYS.items():
            if name not in entry:
                continue
            here = f"{where}: state[{saved_id!r}]['{name}']"
            if key in entry:
                raise ValueError(f"{here}: the entry also holds '{key}'; a moment is saved once")
            if not _is_codes(entry[name]):
                raise TypeError(f"{here} must be a uint8 tensor of codes, got {entry[name]!r:.80}")
            entry[key] = entry.pop(name)
    return {**state_dict, "state": state}


def check_saved_float(key: str, value: Any, shape: torch.Size, where: str) -> None:
    """A saved float state tensor (a moment, a momentum buffer, a master copy) of a parameter of ``shape``."""
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        raise TypeError(f"{where} must be a floating-point tensor, got {type(value).__name__}")
    if value.shape != shape:
        raise ValueError(f"{where} has shape {tuple(value.shape)}, the parameter {tuple(shape)}")


def check_saved_codes(key: str, value: Any, entry: dict, shape: torch.Size, where: str) -> bool:
    """Checks saved entry ``key`` of a quantized moment (its codes, block exponents or width) of a parameter of
    ``shape``; False when ``key`` is not part of one (the caller checks it as a float state)."""
    if key in ("exp_avg_bits", "exp_avg_sq_bits"):
        if value not in _CODE_FORMATS:
            raise ValueError(f"{where} must be 8 or 4, got {value!r}")
        moment_key = key.removesuffix("_bits")
        if entry.get(moment_key) is not None and not _is_codes(entry[moment_key]):  # (absent: said below)
            raise ValueError(
                f"{where}: a code width on a float '{moment_key}', without '{SAVED_CODES_KEYS[moment_key]}'"
            )
        return True
    if key not in ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale"):
        return False
    moment_key = key.removesuffix("_scale")
    if not _is_codes(entry.get(moment_key)):
        if key.endswith("_scale"):
            raise ValueError(f"{where}: block exponents without their '{SAVED_CODES_KEYS[moment_key]}' codes")
        return False
    if key == moment_key:  # name the codes as the state_dict saved them
        where = where.replace(f"['{key}']", f"['{SAVED_CODES_KEYS[key]}']", 1)
    fmt = _CODE_FORMATS.get(entry.get(f"{moment_key}_bits"))
    if fmt is None:
        raise ValueError(
            f"{where}: uint8 codes need '{moment_key}_bits' set to 8 or 4, got {entry.get(f'{moment_key}_bits')!r}"
        )
    codes_shape, scales_shape = reference.quant_layout(shape, fmt)
    expected = scales_shape if key.endswith("_scale") else codes_shape
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8:
        raise TypeError(f"{where} must be a uint8 tensor, got {value!r:.80}")
    if tuple(value.shape) != tuple(expected):
        raise ValueError(f"{where} has shape {tuple(value.shape)}, expected {tuple(expected)}")
    if not isinstance(entry.get(f"{moment_key}_scale"), torch.Tensor):
        raise KeyError(
            f"{where}: codes '{SAVED_CODES_KEYS[moment_key]}' without their '{moment_key}_scale' block exponents"
        )
    return True


def check_saved_adam_entry(entry: dict, where: str) -> None:
    """torch's Adam and FusedAdam save a parameter's step and both moments together. Loaded without one of them,
    the step would start the missing moment from zeros (a zero second moment makes the update m / eps) or the bias
    corrections from step 0: an error here, as torch's step raises KeyError."""
    present = [key for key in ("step", *MOMENT_KEYS) if entry.get(key) is not None]
    missing = [key for key in ("step", *MOMENT_KEYS) if entry.get(key) is None]
    if present and missing:
        names = {key: f"'{key}' (or '{SAVED_CODES_KEYS[key]}')" for key in MOMENT_KEYS}
        raise KeyError(
            f"{where} holds {', '.join(repr(k) for k in present)} but no "
            f"{' or '.join(names.get(k, repr(k)) for k in missing)}; a saved Adam state holds 'step' and both "
            "moments together"
        )


def decode_loaded(state: dict, saved: dict, local: torch.Tensor, kept: Callable[[str, int], bool]) -> None:
    """Quantized moments of ``saved`` (a loaded entry, now ``state``) are decoded to float32 on ``local``'s device
    unless ``kept(key, fmt)`` says the optimizer stores that moment in that format (then it loads as is); decoded
    ones are quantized again, if so configured, when the parameter steps."""
    for key in MOMENT_KEYS:
        codes = saved.get(key)
        if not _is_codes(codes):
            continue
        fmt = _CODE_FORMATS[saved[f"{key}_bits"]]
        if kept(key, fmt):
            continue
        state[key] = reference.dequantize_blockwise(
            codes.to(local.device), saved[f"{key}_scale"].to(local.device), fmt, key == "exp_avg_sq", local.shape
        )
        for k in (f"{key}_scale", f"{key}_bits"):
            state.pop(k, None)
