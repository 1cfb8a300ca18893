"""The paged problems every paged test and bench row draws from: as a block allocator hands
blocks out, no physical block belongs to two sequences (shared blocks let a paged kernel read
fewer distinct bytes than the contiguous copy SDPA is timed on, and the L2 serve the repeats)."""
import pytest
import torch

from ws_lab.paged_cases import make_paged


@pytest.mark.parametrize("batch,context_lens,block_size,num_blocks", [
    (8, [2048] * 8, 16, None), (4, [32768] * 4, 16, None), (3, [523, 37, 2011], 32, 2048),
    (16, [4096] * 16, 16, None), (1, [57600], 16, 32768)])
def test_default_tables_share_no_block(batch, context_lens, block_size, num_blocks):
    (_, kc, _, table, lens), _ = make_paged(batch, 8, 2, 64 if batch > 1 else 16, block_size,
                                            context_lens, torch.float16, "cpu", num_blocks)
    blocks = table.flatten()
    assert blocks.unique().numel() == blocks.numel()  # one owner per physical block
    assert int(blocks.min()) >= 0 and int(blocks.max()) < kc.shape[0]
    assert lens.tolist() == context_lens
    # the pool's order is shuffled: a sequence's blocks are not one contiguous run
    if table.shape[1] > 4:
        assert not bool((table[0].diff() == 1).all())


def test_a_pool_too_small_to_give_each_sequence_its_own_blocks_is_refused():
    with pytest.raises(ValueError, match="without sharing"):
        make_paged(4, 8, 2, 64, 16, [256] * 4, torch.float16, "cpu", num_blocks=40)
