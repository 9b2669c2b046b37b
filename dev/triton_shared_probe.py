"""Shared memory of every Hopper candidate of the Triton scaled_matmul kernel, compiled offline for sm_90 (no GPU
needed: Triton compiles for a named target and reports what it allocates), against the tuner's estimate
``_shared_bytes``. The estimate must never be below what Triton allocates (a candidate it keeps would fail to
compile on the GPU, as three flattened ones did for fp32 += a @ b with 8 warps), and where the output is stored
through TMA it must decide "fits in 227 KB" the same way.

python3 dev/triton_shared_probe.py   (PYTHONPATH=repository root; for the GPU's Triton, put a copy of that version
                                      first, e.g. pip install --no-deps --target /tmp/t36 triton==3.6.0 and
                                      PYTHONPATH=/tmp/t36:.)
"""

from __future__ import annotations

import itertools

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ampkernels.triton import scaled_matmul as sm

KERNEL = sm._scaled_mm_tma_kernel
POINTERS = ("a_desc", "b_desc", "out_ptr", "scale_ptr", "bias_ptr", "found_inf_ptr", "partials_ptr", "flags_ptr")


def compiled_shared_bytes(cfg: sm.Config, out_dtype: str, out_tma: bool, accumulate: bool, a_col: bool) -> int:
    """What Triton allocates for this config and epilogue, compiled as the tuner would launch it on an H200 (device
    descriptors, bf16 operands, a tensor scale, found_inf, 16-byte aligned pointers and strides)."""
    constexprs = {
        "out_desc": None, "A_COL_MAJOR": a_col, "B_COL_MAJOR": False, "HAS_BIAS": False, "ACCUMULATE": accumulate,
        "CHECK_FINITE": True, "OUT_TMA": out_tma, "UPCAST": False, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
        "BLOCK_K": cfg.block_k, "GROUP_M": cfg.group_m, "EPILOGUE_SPLIT": cfg.epilogue_split, "NUM_PROGRAMS": 132,
        "FLATTEN": cfg.flatten, "DEVICE_DESC": True, "STREAM_K": cfg.stream_k, "STREAM_K_COLUMNS": 1,
    }  # fmt: skip
    pointer_types = dict.fromkeys(POINTERS, "*fp32") | {"a_desc": "*bf16", "b_desc": "*bf16", "flags_ptr": "*i32"}
    pointer_types["out_ptr"] = f"*{out_dtype}"
    signature = {}
    for name in KERNEL.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        else:
            signature[name] = pointer_types.get(name, "fp32" if name == "alpha" else "i32")
    aligned = POINTERS + ("M", "N", "K", "stride_a", "stride_b", "stride_om")
    attrs = {(KERNEL.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    source = ASTSource(KERNEL, signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).metadata.shared


def main() -> None:
    print(f"triton {triton.__version__}, sm_90, limit {sm.HOPPER_SHARED_BYTES} B")
    configs = dict.fromkeys(
        sm.HOPPER_TMA_CONFIGS + sm.HOPPER_FEW_TILES_CONFIGS + sm.HOPPER_STREAM_K_CONFIGS + sm.HOPPER_IDLE_TAIL_CONFIGS
    )
    epilogues = [  # (out dtype, out through TMA, accumulate); accumulate needs an fp32 out
        ("bf16", True, False), ("fp32", True, False), ("fp32", True, True),
        ("bf16", False, False), ("fp32", False, True),
    ]  # fmt: skip
    wrong = 0
    for cfg, (out_dtype, out_tma, accumulate), a_col in itertools.product(configs, epilogues, (False, True)):
        measured = compiled_shared_bytes(cfg, out_dtype, out_tma, accumulate, a_col)
        out_bytes = (2 if out_dtype == "bf16" else 4) if out_tma else 4  # as _candidates counts pointer stores
        estimate = sm._shared_bytes(cfg, out_bytes, accumulate, out_tma)
        fits, estimate_fits = measured <= sm.HOPPER_SHARED_BYTES, estimate <= sm.HOPPER_SHARED_BYTES
        bad = estimate < measured or (out_tma and fits != estimate_fits)
        wrong += bad
        print(
            f"{cfg.describe():38s} out={out_dtype} {'tma' if out_tma else 'ptr'} acc={accumulate:d} a_col={a_col:d}"
            f"  triton {measured:7d}  estimate {estimate:7d}  {'fits' if fits else 'OVER'}{'  WRONG' if bad else ''}",
            flush=True,
        )
    print(f"{wrong} wrong")


if __name__ == "__main__":
    main()
