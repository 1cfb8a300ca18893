"""Four TileLang 0.1.15 behaviours around wgmma fences (bundles: python -m
ws_lab.repro NAME). Each passes — and so fails as strict xfail — once TileLang fixes it."""
import pytest

from ws_lab.upstream import fence_operand_num_regs, wgmma_fence_before_wait


@pytest.mark.xfail(strict=True, reason="fence_operand without num_regs fences 4096 registers")
def test_fence_operand_defaults_to_registers_per_thread():
    ok, actual = fence_operand_num_regs.check()
    assert ok, actual


@pytest.mark.xfail(strict=True, reason="wgmma_gemm fences the accumulator before the wait only")
def test_accumulator_is_fenced_after_wait_wgmma():
    ok, actual = wgmma_fence_before_wait.check()
    assert ok, actual


@pytest.mark.xfail(strict=True, reason="T.gemm over 2 warpgroups fences 128 of 64 registers")
def test_gemm_over_two_warpgroups_fences_what_each_thread_holds():
    from ws_lab.upstream import gemm_fence_two_warpgroups

    ok, actual = gemm_fence_two_warpgroups.check()
    assert ok, actual


@pytest.mark.xfail(strict=True, reason="InjectFenceProxy fences wgmma after an unrelated smem store")
def test_no_proxy_fence_for_a_store_no_async_operation_reads():
    from ws_lab.upstream import fence_proxy_for_unrelated_smem

    ok, actual = fence_proxy_for_unrelated_smem.check()
    assert ok, actual
