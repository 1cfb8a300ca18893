"""Random paged-KV problems (each sequence's own blocks, scattered through the pool) and their
check, shared by the interpreter tests, the GPU tests and bench/paged.py."""
import dataclasses
import functools
import secrets

import torch

from ws_lab import oracle, registry

# rel-L2 vs the float64 oracle per dtype (bf16 also meets vLLM's atol 1.5e-2 / rtol 1e-2).
PAGED_TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}


def make_paged(batch, heads, kv_heads, head_dim, block_size, context_lens, dtype, device,
               num_blocks=None, seed=None):
    """q, k_cache, v_cache, block_table, context_lens; returns them and the seed.

    As a block allocator hands them out: every physical block belongs to one sequence (no block
    in two rows of the table), the pool's order shuffled, so each sequence's blocks lie scattered
    through a pool of ``num_blocks`` (default: the table's blocks + 7 unused). A table whose
    rows shared blocks would let a paged kernel read fewer distinct bytes than a contiguous
    copy of the same K/V holds, and the L2 serve the repeats (notes/triton.md, Session 15)."""
    seed = secrets.randbits(31) if seed is None else seed
    # Drawn on the target device: a 32768-block pool is ~10^9 numbers, minutes on a CPU.
    gen = torch.Generator(device=device).manual_seed(seed)
    max_blocks = max(-(-c // block_size) for c in context_lens)
    num_blocks = num_blocks or batch * max_blocks + 7
    if num_blocks < batch * max_blocks:
        raise ValueError(f"pool of {num_blocks} blocks cannot give {batch} sequences "
                         f"{max_blocks} blocks each without sharing")

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    k_cache = randn(num_blocks, block_size, kv_heads, head_dim)
    v_cache = randn(num_blocks, block_size, kv_heads, head_dim)
    pool = torch.randperm(num_blocks, generator=gen, device=device)
    table = pool[:batch * max_blocks].view(batch, max_blocks).to(torch.int32)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    q = randn(batch, heads, head_dim)
    return (q, k_cache, v_cache, table, lens), seed


def assert_matches_oracle(out, ref, seed) -> None:
    """bf16: vLLM's elementwise bar (atol 1.5e-2, rtol 1e-2); other dtypes: rel-L2 within
    ``PAGED_TOLERANCE``. ``seed`` goes into the message, so a failure can be replayed."""
    if out.dtype == torch.bfloat16:
        torch.testing.assert_close(out.double(), ref, atol=1.5e-2, rtol=1e-2,
                                   msg=lambda m: f"seed {seed}: {m}")
    else:
        err = oracle.rel_l2(out, ref)
        assert err <= PAGED_TOLERANCE[out.dtype], f"rel_err {err:.3e} (seed {seed})"


def check_paged(fn, *problem_args, **problem_kwargs) -> tuple[float, float, int]:
    """(rel_err, tolerance, seed) of ``fn(q, k_cache, v_cache, block_table, context_lens, out=)``
    on a fresh problem, writing into a NaN-poisoned output."""
    (q, kc, vc, table, lens), seed = make_paged(*problem_args, **problem_kwargs)
    out = torch.full_like(q, float("nan"))
    fn(q, kc, vc, table, lens, out=out)
    ref = oracle.paged_attention_ref(q, kc, vc, table, lens)
    return oracle.rel_l2(out, ref), PAGED_TOLERANCE[q.dtype], seed


def variants() -> dict:
    """Every path of ``kernels.paged`` the tests cover, name -> paged_attention partial: each
    mode with its defaults, and split_k forced onto each merge (the reduce kernel; the last
    segment program)."""
    paged = registry.decode("paged")
    split = paged.DEFAULTS["split_k"]
    forced = {"split_k-reduce": dataclasses.replace(split, merge_partials=0),
              "split_k-merge": dataclasses.replace(split, merge_partials=1 << 30)}
    out = {m: functools.partial(paged.paged_attention, mode=m) for m in paged.MODES + ("auto",)}
    out.update({name: functools.partial(paged.paged_attention, mode="split_k", config=cfg)
                for name, cfg in forced.items()})
    return out
