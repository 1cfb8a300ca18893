"""Four TileLang 0.1.15 behaviours around wgmma fences (bundles: python -m
ws_lab.repro NAME). Each passes — and so fails as strict xfail — once TileLang fixes it."""
import pytest

from ws_lab.upstream import StillBroken, expect_fixed

from ws_lab.upstream import fence_operand_num_regs, wgmma_fence_before_wait


@pytest.mark.xfail(strict=True, raises=StillBroken,
                   reason="fence_operand without num_regs fences 4096 registers")
def test_fence_operand_defaults_to_registers_per_thread():
    expect_fixed(fence_operand_num_regs.check())


@pytest.mark.xfail(strict=True, raises=StillBroken,
                   reason="wgmma_gemm fences the accumulator before the wait only")
def test_accumulator_is_fenced_after_wait_wgmma():
    expect_fixed(wgmma_fence_before_wait.check())


@pytest.mark.xfail(strict=True, raises=StillBroken,
                   reason="T.gemm over 2 warpgroups fences 128 of 64 registers")
def test_gemm_over_two_warpgroups_fences_what_each_thread_holds():
    from ws_lab.upstream import gemm_fence_two_warpgroups

    expect_fixed(gemm_fence_two_warpgroups.check())


@pytest.mark.xfail(strict=True, raises=StillBroken,
                   reason="InjectFenceProxy fences wgmma after an unrelated smem store")
def test_no_proxy_fence_for_a_store_no_async_operation_reads():
    from ws_lab.upstream import fence_proxy_for_unrelated_smem

    expect_fixed(fence_proxy_for_unrelated_smem.check())
