"""benchmarks/float8_profile.py: kernels sorted into their categories, and the floors' arithmetic."""

from __future__ import annotations

import pytest

from benchmarks import float8_profile
from benchmarks.models import LLAMA_STACK


@pytest.mark.parametrize(
    ("kernel", "expected"),
    [
        ("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128", "FP8 GEMMs"),
        ("nvjet_tst_256x128_64x4_2x1_v_bz_coopA_TNN", "bf16 GEMMs"),
        ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>", "attention"),
        ("_cross_entropy_rows_kernel", "loss"),
        ("_rms_norm_backward_kernel", "norms, RoPE, SiLU-up"),
        ("_silu_mul_kernel", "norms, RoPE, SiLU-up"),
        ("void ampkernels::cuda::(anonymous namespace)::cast_tiles_kernel<__nv_bfloat16>(...)", "FP8 casts"),
        ("void ampkernels::cuda::(anonymous namespace)::amax_flat_kernel<float>(...)", "FP8 casts"),
        ("void ampkernels::cuda::(anonymous namespace)::step_kernel<(ampkernels::OptKind)0, float>(...)", "optimizer"),
        ("_adam_kernel", "optimizer"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::AddFunctor<float>, ...>", "other"),
    ],
)
def test_kernels_fall_into_their_category(kernel, expected):
    assert float8_profile.category(kernel) == expected


def test_floors_count_the_stacks_flops_and_bytes():
    config, batch = dict(LLAMA_STACK), (8, 2048)
    rates = {"fp8_gemm_tflops": 1000.0, "bf16_gemm_tflops": 500.0, "attention_tflops": 250.0}
    floors = float8_profile.floors(config, batch, params=10**9, rates=rates, copy_gbs=2000.0)
    T, H, F, V, L = 16384, 2048, 8192, 32000, 8
    assert floors["FP8 GEMMs"] == pytest.approx(6 * T * L * (4 * H * H + 3 * H * F) / 1e15 * 1e3)  # ~53 TFLOP
    assert 52.0 < floors["FP8 GEMMs"] < 54.0
    assert floors["bf16 GEMMs"] == pytest.approx(6 * T * H * V / 5e14 * 1e3)
    assert floors["attention"] == pytest.approx(7 * T * 2048 * H * L / 2.5e14 * 1e3)
    assert floors["optimizer"] == pytest.approx(28e9 / 2e12 * 1e3)  # 28 B per parameter
    assert floors["loss"] == pytest.approx(6 * T * V / 2e12 * 1e3)
    assert set(floors) == set(float8_profile.CATEGORIES) - {"other"}


def test_fp8_gemm_kernels_are_learnt_from_the_op_that_launched_them():
    from types import SimpleNamespace as Event

    kernel = Event  # (name=...)
    events = [
        Event(name="aten::_scaled_mm", kernels=[kernel(name="nvjet_sm90_tst_256x128_cublas_fp8")]),
        Event(name="ampkernels::scaled_matmul_fp8_wgmma_", kernels=[kernel(name="scaled_matmul_fp8_wgmma_kernel")]),
        Event(name="aten::mm", kernels=[kernel(name="nvjet_sm90_tst_256x128_cublas_bf16")]),
        Event(name="aten::add_", kernels=[]),
    ]
    learnt = float8_profile.fp8_gemm_kernels(events)
    assert learnt == {"nvjet_sm90_tst_256x128_cublas_fp8", "scaled_matmul_fp8_wgmma_kernel"}
    assert float8_profile.category("nvjet_sm90_tst_256x128_cublas_fp8", frozenset(learnt)) == "FP8 GEMMs"
    assert float8_profile.category("nvjet_sm90_tst_256x128_cublas_bf16", frozenset(learnt)) == "bf16 GEMMs"
