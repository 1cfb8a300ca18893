"""The FP8 forward (kernels/fwd/fp8.py) on the GPU against the float64 oracle on the
dequantised inputs (the kernel's own error: P rounded to e4m3 for the PV GEMM, fp32
accumulation), over D 64 / 128, causal and full, query groups 1 / 4 / 8 and S 1 / 127 /
4096, random descales, the output NaN-poisoned before the run (every case within rel-L2
5e-2 on the first GPU run, session 37; the bench rows' 2.1e-2 to 2.6e-2 match FA3 FP8's own,
notes/fp8.md); the quantisation error on bf16-derived inputs against FA3 FP8's, with and
without the Hadamard option; memcheck and racecheck. The coop-overlap designs (SS, RS, RS
with the in-kernel Vᵀ, RS walking K/V downward, and persistent) run the same grid (no lse)
and the same sanitizer script; the persistent one also on forced CTA pairs (its cases are too
small for ``cluster_for`` to pair them)."""
import itertools

import pytest

from tests.ws.grid import assert_sanitizer_clean
from tests.ws.v_transpose_kernel import transpose_block_kernel
from ws_lab import oracle
from ws_lab.kernels.fwd import fp8
from ws_lab.target import compile_sm90a

pytestmark = pytest.mark.hopper

BOUND = 5e-2
# lse's largest |error| (natural log): 1.3e-3 to 5.7e-3 on the first GPU run (session 37); the
# scores come from e4m3 wgmma, whose fp32 accumulation on Hopper keeps fewer mantissa bits
# than an fp32 add (the quantisation test holds the lab's lse error to FA3 FP8's)
LSE_BOUND = 1e-2
CASES = list(itertools.product((64, 128), (False, True), (1, 4, 8), (1, 127, 4096)))


def random_case(head_dim, causal, group, seq_len, **options):
    """e4m3 inputs (B 2, Hkv 2) with random descales in [0.5, 2] through ``attention_fp8``
    into a NaN-poisoned out: (its result, the float64 oracle's (out, lse) on the dequantised
    inputs)."""
    import torch

    batch, kv_heads = 2, 2
    q = torch.randn(batch, seq_len, kv_heads * group, head_dim, device="cuda").to(fp8.FP8)
    k, v = (torch.randn(batch, seq_len, kv_heads, head_dim, device="cuda").to(fp8.FP8)
            for _ in range(2))
    qd, kd, vd = (torch.rand(batch, kv_heads, device="cuda") * 1.5 + 0.5 for _ in range(3))
    out = torch.full(q.shape, float("nan"), dtype=fp8.OUT_DTYPE, device="cuda")
    got = fp8.attention_fp8(q, k, v, causal, q_descale=qd, k_descale=kd, v_descale=vd, out=out,
                            **options)
    first = got[0] if isinstance(got, tuple) else got
    assert first.data_ptr() == out.data_ptr() and torch.isfinite(first).all()
    return got, oracle.attention_ref(fp8.dequantise(q, qd), fp8.dequantise(k, kd),
                                     fp8.dequantise(v, vd), causal=causal)


@pytest.mark.parametrize("head_dim,causal,group,seq_len", CASES)
def test_fp8_forward_matches_the_oracle_on_dequantised_inputs(head_dim, causal, group,
                                                             seq_len):
    (got, lse), (ref, ref_lse) = random_case(head_dim, causal, group, seq_len, return_lse=True)
    assert oracle.rel_l2(got, ref) < BOUND
    assert (lse.double() - ref_lse).abs().max().item() < LSE_BOUND


@pytest.mark.parametrize("head_dim,causal,group,seq_len", CASES)
def test_fp8_coop_forward_matches_the_oracle_on_dequantised_inputs(head_dim, causal, group,
                                                                  seq_len):
    """The coop-overlap design (kernels/fwd/coop.py on e4m3): the same grid, no lse."""
    got, (ref, _) = random_case(head_dim, causal, group, seq_len, design="coop-overlap")
    assert oracle.rel_l2(got, ref) < BOUND


@pytest.mark.parametrize("head_dim,causal,group,seq_len", CASES)
def test_fp8_persistent_forward_matches_the_oracle_on_dequantised_inputs(head_dim, causal, group,
                                                                        seq_len):
    """The persistent coop-overlap design: the same grid, no lse, O stored from registers."""
    got, (ref, _) = random_case(head_dim, causal, group, seq_len,
                                design="coop-overlap-persistent")
    assert oracle.rel_l2(got, ref) < BOUND


@pytest.mark.parametrize("head_dim,causal,group,seq_len", CASES)
def test_fp8_rs_forward_matches_the_oracle_on_dequantised_inputs(head_dim, causal, group,
                                                                seq_len):
    """The coop-overlap design with P from registers (RS) at 224-key blocks, Vᵀ's keys in
    the operand order: the same grid, no lse."""
    got, (ref, _) = random_case(head_dim, causal, group, seq_len, design="coop-overlap-rs")
    assert oracle.rel_l2(got, ref) < BOUND


@pytest.mark.parametrize("head_dim,causal,group,seq_len", CASES)
def test_fp8_rs_vt_forward_matches_the_oracle_on_dequantised_inputs(head_dim, causal, group,
                                                                   seq_len):
    """The RS design with Vᵀ made in the kernel (LDSM.T / PRMT / STSM in the producer
    warpgroup) from V as stored: the same grid, no lse."""
    got, (ref, _) = random_case(head_dim, causal, group, seq_len, design="coop-overlap-rs-vt")
    assert oracle.rel_l2(got, ref) < BOUND


@pytest.mark.parametrize("head_dim,causal,group,seq_len", CASES)
def test_fp8_rs_persistent_forward_matches_the_oracle_on_dequantised_inputs(head_dim, causal,
                                                                           group, seq_len):
    """The RS design on the persistent walk, O through its own tile by TMA: the same grid."""
    got, (ref, _) = random_case(head_dim, causal, group, seq_len,
                                design="coop-overlap-rs-persistent")
    assert oracle.rel_l2(got, ref) < BOUND


@pytest.mark.parametrize("head_dim,causal,group,seq_len", CASES)
def test_fp8_rs_descending_forward_matches_the_oracle_on_dequantised_inputs(head_dim, causal,
                                                                           group, seq_len):
    """The RS design walking K/V downward (FA3's order; the diagonal block first, whose softmax
    checks for wholly masked rows): the same grid."""
    got, (ref, _) = random_case(head_dim, causal, group, seq_len, design="coop-overlap-rs-desc")
    assert oracle.rel_l2(got, ref) < BOUND


@pytest.mark.parametrize("head_dim,causal,group,seq_len", CASES)
def test_fp8_rs_persistent_descending_forward_matches_the_oracle_on_dequantised_inputs(
        head_dim, causal, group, seq_len):
    """The persistent RS design walking K/V downward: the same grid."""
    got, (ref, _) = random_case(head_dim, causal, group, seq_len,
                                design="coop-overlap-rs-persistent-desc")
    assert oracle.rel_l2(got, ref) < BOUND


@pytest.mark.parametrize("block_n,head_dim_v", [(224, 128), (224, 64)])
def test_the_in_kernel_transpose_moves_every_byte_of_a_block(block_n, head_dim_v):
    """``v_transpose.block_mover`` alone (``transpose_block_kernel``): one random byte block
    (any bit pattern, NaN codes too) through LDSM.T / PRMT / STSM comes out as Vᵀ with the keys
    of each 16 in ``coop.operand_key``'s order, bit for bit."""
    import torch

    kernel = compile_sm90a(transpose_block_kernel(block_n, head_dim_v))
    v = torch.randint(0, 256, (block_n, head_dim_v), dtype=torch.uint8, device="cuda")
    vt = torch.full((head_dim_v, block_n), 0x7F, dtype=torch.uint8, device="cuda")
    kernel(v.view(fp8.FP8), vt.view(fp8.FP8))
    keys = torch.tensor([fp8.coop.operand_key(a) for a in range(block_n)], device="cuda")
    assert torch.equal(vt, v[keys].T)


@pytest.mark.parametrize("design", fp8.PERSISTENT_DESIGNS)
@pytest.mark.parametrize("head_dim,causal,group,seq_len",
                         [c for c in CASES if c[2] % 2 == 0 and c[3] > 1])
def test_fp8_persistent_cta_pairs_match_the_oracle(head_dim, causal, group, seq_len, design):
    """The persistent designs on CTA pairs (K / Vᵀ multicast into both CTAs of a pair)."""
    got, (ref, _) = random_case(head_dim, causal, group, seq_len, design=design, cluster=2)
    assert oracle.rel_l2(got, ref) < BOUND


def outlier_inputs(seed, outliers):
    """bf16 (q, k, v): B 2, S 1024, Hq 8 / Hkv 2, D 128, N(0, 1); with ``outliers`` four key
    channels × 20 and the same query channels × 5 (the CPU test's outlier pattern,
    notes/fp8.md)."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(2, 1024, 8, 128, device="cuda", generator=gen)
    k, v = (torch.randn(2, 1024, 2, 128, device="cuda", generator=gen) for _ in range(2))
    if outliers:
        k[..., :4] *= 20
        q[..., :4] *= 5
    return tuple(x.to(torch.bfloat16) for x in (q, k, v))


@pytest.mark.parametrize("outliers", [False, True])
def test_quantisation_error_is_no_worse_than_fa3s_and_the_hadamard_option_cuts_outliers(
        outliers):
    """On the same bf16-derived e4m3 inputs and descales, the lab's output against the float64
    oracle on the bf16 inputs is within 0.5 % of FA3 FP8's rel-L2 or below it (on the H100,
    with P shifted by 2^8: +0.07 % and below it; the bench rows were 0.6–2.3 % above FA3's
    before the shift: notes/fp8.md, "Session 51"), and so is its lse error against the oracle
    on the dequantised inputs. The Hadamard option cuts the error by more than 2 × where
    channels carry outliers and leaves it within 5 % on N(0, 1) inputs (nothing to spread).
    Skips where FA3's FP8 forward is not installed."""
    fa3 = pytest.importorskip("fa3_fwd_interface")
    q, k, v = outlier_inputs(0, outliers)
    ref = oracle.attention_ref(q, k, v, causal=True)[0]
    plain, rotated = fp8.quantize(q, k, v), fp8.quantize(q, k, v, hadamard=True)
    ref_lse = oracle.attention_ref(*plain.dequantised(), causal=True)[1]
    out, lse = fp8.attention_fp8(plain.q, plain.k, plain.v, True, return_lse=True,
                                 **plain.descales())
    fa3_out, fa3_lse = fa3.flash_attn_func(plain.q, plain.k, plain.v, causal=True,
                                           return_attn_probs=True, **plain.descales())[:2]
    hadamard = fp8.attention_fp8(rotated.q, rotated.k, rotated.v, True, **rotated.descales())
    errors = {name: oracle.rel_l2(x, ref) for name, x in
              (("lab", out), ("fa3", fa3_out), ("lab+hadamard", hadamard))}
    lse_errors = {name: (x.double() - ref_lse).abs().max().item() for name, x in
                  (("lab", lse), ("fa3", fa3_lse))}
    print(f"outliers={outliers}: rel-L2 {errors}, lse max |error| {lse_errors}")
    assert errors["lab"] <= errors["fa3"] * 1.005
    assert lse_errors["lab"] <= lse_errors["fa3"] * 1.005
    if outliers:
        assert errors["lab+hadamard"] < errors["lab"] / 2
    else:
        assert errors["lab+hadamard"] < errors["lab"] * 1.05


SANITIZED = """
import torch
from ws_lab.kernels.fwd import fp8
for d, causal, s, group in ((64, True, 127, 4), (128, False, 200, 1)):
    q = torch.randn(1, s, 2 * group, d, device="cuda").to(fp8.FP8)
    k, v = (torch.randn(1, s, 2, d, device="cuda").to(fp8.FP8) for _ in range(2))
    out, lse = fp8.attention_fp8(q, k, v, causal, return_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    out = fp8.attention_fp8(q, k, v, causal, design="coop-overlap")
    assert torch.isfinite(out).all()
    out = fp8.attention_fp8(q, k, v, causal, design="coop-overlap-persistent",
                            cluster=2 if group % 2 == 0 else 1)
    assert torch.isfinite(out).all()
    out = fp8.attention_fp8(q, k, v, causal, design="coop-overlap-rs")
    assert torch.isfinite(out).all()
    out = fp8.attention_fp8(q, k, v, causal, design="coop-overlap-rs-vt")
    assert torch.isfinite(out).all()
    out = fp8.attention_fp8(q, k, v, causal, design="coop-overlap-rs-persistent",
                            cluster=2 if group % 2 == 0 else 1)
    assert torch.isfinite(out).all()
    out = fp8.attention_fp8(q, k, v, causal, design="coop-overlap-rs-desc")
    assert torch.isfinite(out).all()
    out = fp8.attention_fp8(q, k, v, causal, design="coop-overlap-rs-persistent-desc",
                            cluster=2 if group % 2 == 0 else 1)
    assert torch.isfinite(out).all()
"""


def test_memcheck_finds_nothing_on_ragged_sequences():
    """S not a multiple of the tiles: the Q tile and the K / Vᵀ tiles past S must be bounded
    (compute-sanitizer memcheck over TileLang's main*_kernel, 0 errors)."""
    assert_sanitizer_clean("memcheck", SANITIZED, kernels="main")


def test_racecheck_finds_nothing_with_the_kernels_own_barriers():
    """TileLang's shared-memory syncs are off in this kernel (``fp8.PASS_CONFIGS``): P's and
    O's tiles are ordered by its own named barriers only, so racecheck must find no hazard."""
    assert_sanitizer_clean("racecheck", SANITIZED, kernels="main")


@pytest.mark.parametrize("causal,seq_len", [(True, 1000), (False, 4096)])
def test_the_default_design_is_the_rules_kernel(causal, seq_len):
    """``design="auto"`` (the default) runs ``heuristics.fp8_design``'s design for the call:
    bit for bit its output, and within the bound of the oracle."""
    import torch

    from ws_lab.kernels.fwd import heuristics, tile_scheduler

    (got, (ref, _)) = random_case(128, causal, 4, seq_len)
    q, k, v = (torch.randn(2, seq_len, h, 128, device="cuda").to(fp8.FP8) for h in (8, 2, 2))
    l2 = tile_scheduler.persistent_device_args(q.device)[1]
    design = heuristics.fp8_design(2, seq_len, 2, 128, False, l2)
    assert torch.equal(fp8.attention_fp8(q, k, v, causal),
                       fp8.attention_fp8(q, k, v, causal, design=design))
    assert oracle.rel_l2(got, ref) < BOUND
