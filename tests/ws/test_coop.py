"""Coop and coop_overlap (2 consumer warpgroups, explicit warp specialization; serial vs
IntraWGOverlap mainloop) vs the float64 oracle on the H100.

Grid per mainloop: D ∈ {64, 128, 256} × fp16/bf16 × causal/full × S ∈ {4096, ragged} × pingpong
on/off, GQA group cycling through 1/4/8, plus batch 3 and a custom scale — 50 cases each;
the persistent overlap kernel (D 64/128) 18 more, and its K/V-multicast CTA pair (cluster 2,
even GQA groups) 17 more, then the overlap mainloop with FA4's conditional rescale
(``lazy_rescale``), plain and persistent, at D 128 with wide scores among them, 20 more, and
the widest case without it, then FA3's downward K/V walk (``kv_descending``, D 64/128/256) 24
more and persistent (D 64/128) 18 more (tolerances: ws_lab.testing.TOLERANCE). Then, per
variant: 20 runs on the same inputs give bitwise-identical output, and compute-sanitizer's
racecheck and memcheck find nothing.
"""
import functools

import pytest

from ws_lab.kernels.fwd import coop, coop_overlap
from tests.ws.grid import (assert_bitwise_repeatable, assert_sanitizer_clean, case_id,
                           default_scale, grid, precompile)
from ws_lab.testing import check_attention, random_qkv

pytestmark = pytest.mark.hopper

HEAD_DIMS = [(64, 64), (128, 128), (256, 256)]
MAINLOOPS = {"serial": coop.serial_mainloop, "overlap": coop_overlap.overlap_mainloop(),
             "lazy": coop_overlap.overlap_mainloop(lazy_rescale=True)}
CASES = [dict(c, mainloop=name) for name in ("serial", "overlap") for c in (
    [c for pp in (True, False)
     for c in grid(HEAD_DIMS, groups=[1, 4, 8], ragged=[1000, 4097, 333], pingpong=pp)] + [
        dict(batch=3, seq_len=777, heads=8, kv_heads=2, head_dim=128, head_dim_v=128, causal=True,
             dtype="float16", scale=None, pingpong=True),
        dict(batch=3, seq_len=130, heads=6, kv_heads=3, head_dim=64, head_dim_v=64, causal=False,
             dtype="bfloat16", scale=0.2, pingpong=True)])]
# persistent (overlap mainloop, D 64/128): a few tiles per CTA, ragged tails, batch 3
CASES += [dict(c, mainloop="overlap", persistent=True) for c in (
    grid(coop.PERSISTENT_HEAD_DIMS, groups=[1, 4, 8], ragged=[1000, 4097, 333], pingpong=True) + [
        dict(batch=3, seq_len=777, heads=8, kv_heads=2, head_dim=128, head_dim_v=128, causal=True,
             dtype="float16", scale=None, pingpong=True),
        dict(batch=2, seq_len=8192, heads=32, kv_heads=8, head_dim=128, head_dim_v=128,
             causal=True, dtype="bfloat16", scale=None, pingpong=True)])]  # cluster_for: 2
# the CTA pair forced on small calls: two heads of each GQA group (2/4/8) share every K/V load
CASES += [dict(c, mainloop="overlap", persistent=True, cluster=2) for c in (
    grid(coop.PERSISTENT_HEAD_DIMS, groups=[2, 4, 8], ragged=[1000, 4097, 333], pingpong=True) + [
        dict(batch=3, seq_len=777, heads=8, kv_heads=2, head_dim=128, head_dim_v=128, causal=True,
             dtype="float16", scale=None, pingpong=True)])]

# FA4's conditional rescale (lazy_rescale): D 128, plain and persistent, and wide scores
# (scale 1 at D 128: a block's max passes the old one by more than 2^8 often) so that both the
# kept and the moved max are exercised
WIDE = dict(batch=2, seq_len=1000, heads=8, kv_heads=2, head_dim=128, head_dim_v=128,
            causal=False, dtype="bfloat16", scale=1.0, pingpong=True)
CASES += [dict(c, mainloop="lazy", **extra) for extra in ({}, {"persistent": True})
          for c in grid([(128, 128)], groups=[1, 4, 8], ragged=[1000, 4097, 333],
                        pingpong=True) + [WIDE, dict(WIDE, causal=True, dtype="float16")]]
CASES += [dict(WIDE, mainloop="overlap")]  # the same wide scores without the threshold
# FA3's downward K/V walk (coop.Config.kv_descending): the diagonal block first, Check_inf on it
CASES += [dict(c, mainloop="overlap", kv_descending=True)
          for c in grid(HEAD_DIMS, groups=[1, 4, 8], ragged=[1000, 4097, 333], pingpong=True)]
# ... and persistent (D 64/128): tiles of one CTA chained across the walk, the CTA pair forced
# on a small call and chosen by cluster_for on the 8k one
CASES += [dict(c, mainloop="overlap", persistent=True, kv_descending=True) for c in (
    grid(coop.PERSISTENT_HEAD_DIMS, groups=[1, 4, 8], ragged=[1000, 4097, 333], pingpong=True) + [
        dict(batch=2, seq_len=8192, heads=32, kv_heads=8, head_dim=128, head_dim_v=128,
             causal=True, dtype="bfloat16", scale=None, pingpong=True)])]
CASES += [dict(batch=3, seq_len=777, heads=8, kv_heads=2, head_dim=128, head_dim_v=128,
               causal=True, dtype="float16", scale=None, pingpong=True, mainloop="overlap",
               persistent=True, cluster=2, kv_descending=True)]


def _id(c):
    return (f"{c['mainloop']}-{case_id(c)}" + ("-cluster2" if c.get("cluster") == 2 else "")
            + ("-descending" if c.get("kv_descending") else ""))


def _build(c):
    import torch

    coop.compiled_for(c["batch"], c["seq_len"], c["heads"], c["kv_heads"], c["head_dim"],
                      c["head_dim_v"], c["causal"], c["dtype"], default_scale(c), c["pingpong"],
                      MAINLOOPS[c["mainloop"]], c.get("persistent", False), c.get("cluster"),
                      torch.device("cuda", 0), c.get("kv_descending", False))


@pytest.fixture(scope="module", autouse=True)
def precompiled(request):
    precompile(CASES, _build, request)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_coop_matches_oracle(case):
    import torch

    fn = functools.partial(coop.attention, pingpong=case["pingpong"],
                           mainloop_factory=MAINLOOPS[case["mainloop"]],
                           persistent=case.get("persistent", False), cluster=case.get("cluster"),
                           kv_descending=case.get("kv_descending", False))
    result = check_attention(fn, case["batch"], case["seq_len"], case["heads"], case["kv_heads"],
                             case["head_dim"], case["head_dim_v"], case["causal"],
                             getattr(torch, case["dtype"]), softmax_scale=case["scale"])
    assert result.ok, f"{_id(case)}: {result}"


ENTRIES = {"serial": coop.attention, "overlap": coop_overlap.attention,
           "persistent": functools.partial(coop_overlap.attention, persistent=True),
           "cluster": functools.partial(coop_overlap.attention, persistent=True, cluster=2),
           "lazy": functools.partial(coop_overlap.attention, persistent=True,
                                     lazy_rescale=True),
           "descending": functools.partial(coop_overlap.attention, kv_descending=True),
           "persistent-descending": functools.partial(coop_overlap.attention, persistent=True,
                                                      kv_descending=True)}


@pytest.mark.parametrize("entry", list(ENTRIES.values()), ids=list(ENTRIES))
@pytest.mark.parametrize("causal", [False, True])
def test_coop_is_bitwise_repeatable(entry, causal):
    import torch

    qkv, _ = random_qkv(1, 4096, 32, 8, 128, 128, torch.float16, "cuda")
    assert_bitwise_repeatable(entry, qkv, causal)


SANITIZED = """
import functools
import torch
from ws_lab.kernels.fwd import coop, coop_overlap
from ws_lab.testing import check_attention
r = check_attention({entry}, 1, 300, 4, 2, 64, 64, True, torch.float16)
assert r.ok, r
"""


@pytest.mark.parametrize("entry", ["coop.attention", "coop_overlap.attention",
                                   "functools.partial(coop_overlap.attention, persistent=True)",
                                   "functools.partial(coop_overlap.attention, persistent=True, "
                                   "cluster=2)",
                                   "functools.partial(coop_overlap.attention, kv_descending=True)",
                                   "functools.partial(coop_overlap.attention, persistent=True, "
                                   "kv_descending=True)"],
                         ids=list(ENTRIES)[:4] + ["descending", "persistent-descending"])
@pytest.mark.parametrize("tool", ["racecheck", "memcheck"])
def test_coop_sanitizer_clean(tool, entry):
    assert_sanitizer_clean(tool, SANITIZED.format(entry=entry))
