"""The pipelined backward (kernels/bwd/pipelined.py) on the GPU against autograd through the
float64 oracle: dQ, dK and dV each within a rel-L2 bound, over D 64 / 128, causal and full,
fp16 and bf16, query groups 1 / 4 / 7 / 8 and S 1 / 127 / 456 / 4096, with dK and dV
NaN-poisoned before the run. The forward's out and lse come from the oracle, out as the strided
view it returns. At S = 1 softmax is 1, dS = dP − Δ = 0 and the oracle's dQ and dK are exactly
0: there the bound is on their largest |element| (a relative error would be 0 / 0, the first
run's "inf", notes/bwd.md)."""
import itertools

import pytest

from tests.ws.grid import assert_sanitizer_clean
from ws_lab import oracle
from ws_lab.kernels.bwd import pipelined

pytestmark = pytest.mark.hopper

TOLERANCE = {"float16": 5e-3, "bfloat16": 2e-2}
SEQS = itertools.cycle([1, 127, 456, 4096])
GROUPS = itertools.cycle([1, 4, 7, 8])
CASES = [(d, causal, dtype, next(GROUPS), next(SEQS))
         for d, causal, dtype in itertools.product((64, 128), (False, True),
                                                   ("float16", "bfloat16"))
         for _ in range(2)]


def grad_error(got, ref) -> float:
    """rel-L2 against the oracle, or the largest |got| where the oracle's gradient is 0."""
    import torch

    if torch.count_nonzero(ref) == 0:
        return torch.nan_to_num(got.double(), nan=float("inf")).abs().max().item()
    return oracle.rel_l2(got, ref)


def problem(head_dim, causal, dtype, group, seq_len):
    """Fresh random (q, k, v, out, dout, lse) of a grid case, out and lse from the oracle (out
    as the strided view it returns), and the oracle's (dq, dk, dv)."""
    import torch

    dt = getattr(torch, dtype)
    batch, kv_heads = (1, 2) if seq_len == 4096 else (2, 2)
    q = torch.randn(batch, seq_len, kv_heads * group, head_dim, device="cuda", dtype=dt)
    k, v = (torch.randn(batch, seq_len, kv_heads, head_dim, device="cuda", dtype=dt)
            for _ in range(2))
    dout = torch.randn_like(q)
    out, lse = oracle.attention_ref(q, k, v, causal=causal)
    inputs = (q, k, v, out.to(dt), dout, lse.float())
    return inputs, oracle.attention_bwd_ref(q, k, v, dout, causal=causal)


def poisoned_grads(q, k, v):
    import torch

    return dict(dq=torch.full_like(q, float("nan")), dk=torch.full_like(k, float("nan")),
                dv=torch.full_like(v, float("nan")))


def assert_case_matches_the_oracle(head_dim, causal, dtype, group, seq_len, **options):
    """``attention_bwd(**options)`` on a fresh grid case into NaN-poisoned gradients: each
    within the dtype's bound of the float64 oracle. Returns (inputs, gradients)."""
    inputs, want = problem(head_dim, causal, dtype, group, seq_len)
    got = pipelined.attention_bwd(*inputs, causal, **options, **poisoned_grads(*inputs[:3]))
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert grad_error(g, w) < TOLERANCE[dtype], name
    return inputs, got


@pytest.mark.parametrize("head_dim,causal,dtype,group,seq_len", CASES)
def test_backward_matches_the_oracle(head_dim, causal, dtype, group, seq_len):
    """The default config (``planned_config``: the grid's small problems mostly split the
    group), gradients NaN-poisoned, within the dtype's bound of the float64 oracle."""
    assert_case_matches_the_oracle(head_dim, causal, dtype, group, seq_len)


@pytest.mark.parametrize("head_dim,causal,dtype,group,seq_len", CASES)
def test_the_whole_group_matches_the_oracle(head_dim, causal, dtype, group, seq_len):
    """``DEFAULT`` (the group whole, one CTA per K/V tile and KV head: what the plan picks on
    the 8B rows): the same bound."""
    assert_case_matches_the_oracle(head_dim, causal, dtype, group, seq_len,
                                   config=pipelined.DEFAULT)


@pytest.mark.parametrize("head_dim,causal,dtype,group,seq_len,splits", [
    (64, True, "bfloat16", 8, 456, 2), (128, False, "float16", 4, 127, 2),
    (64, False, "float16", 8, 1, 4), (128, True, "bfloat16", 7, 4096, 7),
    (64, True, "float16", 4, 4096, 4), (128, True, "bfloat16", 8, 456, 8)])
def test_split_heads_match_the_oracle(head_dim, causal, dtype, group, seq_len, splits):
    """``Config(head_splits=s)``: each CTA walks group / s heads and adds dK and dV into fp32
    accumulators, cast afterwards: the grid's bound, the gradients NaN-poisoned."""
    import dataclasses

    assert_case_matches_the_oracle(
        head_dim, causal, dtype, group, seq_len,
        config=dataclasses.replace(pipelined.DEFAULT, head_splits=splits))


# bwd-ws runs D 128 and S a multiple of 128: its own grid over the groups and both masks
WS_CASES = [(128, causal, dtype, group, seq_len)
            for causal, dtype in itertools.product((False, True), ("float16", "bfloat16"))
            for group, seq_len in ((1, 128), (4, 384), (7, 1024), (8, 4096))]


@pytest.mark.parametrize("head_dim,causal,dtype,group,seq_len", WS_CASES)
def test_the_ws_backend_matches_the_oracle(head_dim, causal, dtype, group, seq_len):
    """``backend="ws"`` (``ws.flash_bwd_ws``, explicit roles and mbarriers): the grid's bound,
    the gradients NaN-poisoned."""
    assert_case_matches_the_oracle(head_dim, causal, dtype, group, seq_len, backend="ws")


@pytest.mark.parametrize("head_dim,causal,dtype,group,seq_len", WS_CASES[1::2])
def test_the_ws_padded_dq_accumulator_matches_the_oracle(head_dim, causal, dtype, group,
                                                         seq_len):
    """``ws.Config(dq_layout="padded")`` (the 8-column pad; the swizzled layout is the
    default): the same bound, through the pre / postprocess of that layout."""
    from ws_lab.kernels.bwd import ws

    assert_case_matches_the_oracle(head_dim, causal, dtype, group, seq_len,
                                   config=ws.Config(dq_layout="padded"))


@pytest.mark.parametrize("head_dim,causal,dtype,group,seq_len", WS_CASES[::4])
def test_the_ws_pdl_option_matches_the_oracle(head_dim, causal, dtype, group, seq_len):
    """``ws.Config(pdl=True)`` (the three kernels launched as programmatic dependents, not the
    default until measured): the same bound."""
    from ws_lab.kernels.bwd import ws

    assert_case_matches_the_oracle(head_dim, causal, dtype, group, seq_len,
                                   config=ws.Config(pdl=True))


@pytest.mark.parametrize("head_dim,causal,dtype,group,seq_len", CASES[::2])
def test_the_pipelined_plan_without_pdl_matches_the_oracle(head_dim, causal, dtype, group,
                                                           seq_len):
    """Each case's plan with ``pdl=False`` (the plan launches programmatically; this is the
    plain launch, as ``DEFAULT`` and the deterministic mode run): the same bound."""
    import dataclasses

    import torch

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    batch, kv_heads = (1, 2) if seq_len == 4096 else (2, 2)
    plan = pipelined.planned_config(batch, seq_len, kv_heads * group, kv_heads, head_dim,
                                    causal, sms)
    assert_case_matches_the_oracle(head_dim, causal, dtype, group, seq_len,
                                   config=dataclasses.replace(plan, pdl=False))


@pytest.mark.parametrize("head_dim,causal,dtype,group,seq_len", WS_CASES[1::2])
@pytest.mark.parametrize("pdl", [False, True])
def test_the_ws_zero_next_option_matches_the_oracle_call_after_call(head_dim, causal, dtype,
                                                                    group, seq_len, pdl):
    """``ws.Config(zero_next=True)`` (dQ added into one of a kept pair of accumulators while the
    main kernel zeroes the other): three calls in a row on fresh inputs of one shape, each within
    the bound. Calls 2 and 3 add into what calls 1 and 2 zeroed and read them back, so a chunk
    left unzeroed or a parity read early fails them."""
    from ws_lab.kernels.bwd import ws

    for _ in range(3):
        assert_case_matches_the_oracle(head_dim, causal, dtype, group, seq_len,
                                       config=ws.Config(zero_next=True, pdl=pdl))


def test_the_ws_zero_next_option_replays_from_a_cuda_graph():
    """``zero_next``'s parity lives on the device, so a captured backward replays: a graph of one
    call, replayed three times on fresh inputs copied into its buffers, gives each its own
    gradients (a parity fixed at capture would add into an accumulator nobody zeroes)."""
    import torch

    from ws_lab.kernels.bwd import ws

    inputs, _ = problem(128, True, "bfloat16", 4, 512)
    static = [t.clone() for t in inputs]
    grads = poisoned_grads(*static[:3])
    config = ws.Config(zero_next=True)

    def run():
        pipelined.attention_bwd(*static, True, config=config, **grads)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        run()  # the warm-up makes the pair outside the capture
        with torch.cuda.graph(graph, stream=stream):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        fresh, want = problem(128, True, "bfloat16", 4, 512)
        for buf, t in zip(static, fresh):
            buf.copy_(t)
        for g in grads.values():
            g.fill_(float("nan"))
        graph.replay()
        for name, w in zip(("dq", "dk", "dv"), want):
            assert grad_error(grads[name], w) < TOLERANCE["bfloat16"], name


def pdl_pair(spin_cycles):
    """A one-CTA kernel that lets its dependent launch, spins, then sets Flag; and its dependent,
    which reads Flag before and after its wait into Out."""
    import tilelang.language as T

    @T.prim_func
    def primary(Flag: T.Tensor([1], "int32")):
        with T.Kernel(1, threads=32) as _:
            T.pdl_trigger()
            start = T.alloc_var("int64", init=T.call_extern("int64", "clock64"))
            while T.call_extern("int64", "clock64") - start < spin_cycles:
                T.evaluate(0)
            Flag[0] = 1

    @T.prim_func
    def dependent(Flag: T.Tensor([1], "int32"), Out: T.Tensor([2], "int32")):
        with T.Kernel(1, threads=32) as _:
            Out[0] = T.call_extern("int32", "atomicAdd", T.address_of(Flag[0]), 0)
            T.pdl_sync()
            Out[1] = T.call_extern("int32", "atomicAdd", T.address_of(Flag[0]), 0)

    return primary, dependent


def test_a_pdl_dependent_starts_while_its_predecessor_runs():
    """What ``Config(pdl=True)`` relies on: a TileLang kernel holding ``T.pdl_sync`` is launched
    with programmatic stream serialization, so it starts while its predecessor (which let it,
    ``T.pdl_trigger``) still spins: it reads the flag unset before its wait and set after."""
    import torch

    from ws_lab.target import compile_sm90a

    primary, dependent = (compile_sm90a(f) for f in pdl_pair(20_000_000))  # ≈ 10 ms
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    out = torch.full((2,), -1, dtype=torch.int32, device="cuda")
    # A kernel's first launch loads its module, which waits for the running primary; the
    # steady state is what the backward sees (notes/bwd.md "Session 57").
    dependent(flag, out)
    reads = []
    for _ in range(3):
        flag.zero_()
        out.fill_(-1)
        torch.cuda.synchronize()
        primary(flag)
        dependent(flag, out)
        reads.append(out.tolist())
    assert reads == [[0, 1]] * 3


@pytest.mark.parametrize("head_dim,causal,dtype,group,seq_len", CASES[::3])
def test_the_heads_inner_walk_matches_the_oracle(head_dim, causal, dtype, group, seq_len):
    """``Config(heads_inner=True)`` (off by default until measured): the same bound."""
    import dataclasses

    assert_case_matches_the_oracle(
        head_dim, causal, dtype, group, seq_len,
        config=dataclasses.replace(pipelined.DEFAULT, heads_inner=True))


@pytest.mark.parametrize("head_dim,causal,dtype,group,seq_len", CASES[::3])
def test_the_per_warpgroup_dq_planes_match_the_oracle(head_dim, causal, dtype, group, seq_len):
    """``Config(dq_planes=2)`` (dQ staged and added per warpgroup; off by default, measured
    slower): the same bound, through its own pre- and postprocess over the planar
    accumulator."""
    import dataclasses

    assert_case_matches_the_oracle(
        head_dim, causal, dtype, group, seq_len,
        config=dataclasses.replace(pipelined.DEFAULT, dq_planes=2))


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("head_dim,causal,dtype,group,seq_len", CASES[::2])
def test_the_uniform_warpgroup_kernels_match_the_oracle(head_dim, causal, dtype, group, seq_len,
                                                         deterministic):
    """``Config(uniform_wg=True)`` (postproc.uniform_warpgroup; off by default until measured),
    the main kernel and the deterministic mode's dQ kernel: the grid's bound."""
    import dataclasses

    assert_case_matches_the_oracle(
        head_dim, causal, dtype, group, seq_len, deterministic=deterministic,
        config=dataclasses.replace(pipelined.DEFAULT, uniform_wg=True),
        dq_config=dataclasses.replace(pipelined.DQ_DEFAULT, uniform_wg=True))


@pytest.mark.parametrize("head_dim,causal,dtype,group,seq_len", CASES[::3])
def test_deterministic_mode_matches_the_oracle_and_repeats_bitwise(head_dim, causal, dtype,
                                                                   group, seq_len):
    """dQ from the dQ kernel (no atomics): within the grid's bound, and 20 more runs into fresh
    NaN-poisoned buffers give the first run's dq, dk and dv bit for bit."""
    import torch

    inputs, first = assert_case_matches_the_oracle(head_dim, causal, dtype, group, seq_len,
                                                   deterministic=True)
    for _ in range(20):
        again = pipelined.attention_bwd(*inputs, causal, deterministic=True,
                                        **poisoned_grads(*inputs[:3]))
        assert all(torch.equal(a, b) for a, b in zip(again, first))


@pytest.mark.parametrize("causal", [False, True])
def test_forward_lse_matches_the_oracle(causal):
    import torch

    from ws_lab.kernels.fwd import pipelined as fwd

    q = torch.randn(2, 1000, 8, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 1000, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out, lse = fwd.attention(q, k, v, causal=causal, return_lse=True)
    ref_out, ref_lse = oracle.attention_ref(q, k, v, causal=causal)
    assert oracle.rel_l2(out, ref_out) < 1e-2
    assert (lse.double() - ref_lse).abs().max().item() < 1e-3


@pytest.mark.parametrize("deterministic", [False, True])
def test_one_compile_serves_every_batch(deterministic):
    """The training op's kernels take B at launch (``dynamic_batch``, as the op calls them): at
    batches 1, 3 and 2 (a planner's probes, then a micro-batch), S 127, group 7, causal, out
    and the three gradients NaN-poisoned match the oracle, and batches 3 and 2 compile nothing
    (a batch in the key would add an entry to every cache)."""
    import torch

    from ws_lab.kernels.bwd import prepost
    from ws_lab.kernels.fwd import pipelined as fwd

    caches = (fwd.compiled, pipelined.compiled, pipelined.compiled_dq,
              prepost.compiled_preprocess, prepost.compiled_postprocess)
    sizes = []
    for batch in (1, 3, 2):
        q = torch.randn(batch, 127, 14, 64, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch, 127, 2, 64, device="cuda", dtype=torch.bfloat16)
                for _ in range(2))
        dout = torch.randn_like(q)
        out, lse = fwd.attention(q, k, v, causal=True, out=torch.full_like(q, float("nan")),
                                 return_lse=True, dynamic_batch=True)
        want_out, want_lse = oracle.attention_ref(q, k, v, causal=True)
        assert oracle.rel_l2(out, want_out) < TOLERANCE["bfloat16"], batch
        assert (lse.double() - want_lse).abs().max().item() < 1e-3, batch
        grads = pipelined.attention_bwd(q, k, v, out, dout, lse, True,
                                        deterministic=deterministic, dynamic_batch=True,
                                        **poisoned_grads(q, k, v))
        want = oracle.attention_bwd_ref(q, k, v, dout, causal=True)
        for name, got, ref in zip(("dq", "dk", "dv"), grads, want):
            assert grad_error(got, ref) < TOLERANCE["bfloat16"], (batch, name)
        sizes.append([c.cache_info().currsize for c in caches])
    assert sizes[0] == sizes[1] == sizes[2], sizes


def test_the_op_trains_under_torch_compile_as_one_graph():
    """torch.ops.ws_lab.attention's gradients, eager and with the forward under
    torch.compile(fullgraph=True) (AOT autograd compiles the backward; one graph, no recompile
    on a second batch of the same shape), against the oracle."""
    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters

    from ws_lab.kernels.bwd import attention_op  # noqa: F401  (registers the op)

    def forward(q, k, v):
        return torch.ops.ws_lab.attention(q, k, v, True, None)[0] * 1.0

    def grads(fn, q, k, v, dout):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        fn(*leaves).backward(dout)
        return [t.grad for t in leaves]

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(forward, fullgraph=True)
    for _ in range(2):
        q = torch.randn(2, 456, 14, 64, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(2, 456, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        dout = torch.randn_like(q)
        eager, traced = grads(forward, q, k, v, dout), grads(compiled, q, k, v, dout)
        want = oracle.attention_bwd_ref(q, k, v, dout, causal=True)
        for e, c, w in zip(eager, traced, want):
            assert oracle.rel_l2(c, e) < 1e-3  # dQ's reduce-adds land in no fixed order
            assert oracle.rel_l2(c, w) < TOLERANCE["bfloat16"]
    assert counters["stats"]["unique_graphs"] == 1


def test_a_llama_block_trains_as_one_graph():
    """A LLaMA block (RMSNorm, GQA attention through torch.ops.ws_lab.attention, SwiGLU MLP;
    tests/llama_block.py) under torch.compile(fullgraph=True): forward and backward as one
    graph with no recompile over two batches of one shape, and the input's and every
    parameter's gradient equal to eager's up to bf16 rounding (Inductor fuses the norms and
    the MLP's elementwise ops; dQ's reduce-adds land in no fixed order)."""
    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters

    from tests.llama_block import LlamaBlock

    torch.manual_seed(0)
    block = LlamaBlock(hidden=512, heads=8, kv_heads=2, intermediate=1024).cuda()
    block = block.to(torch.bfloat16)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(block, fullgraph=True)
    for _ in range(2):
        x = torch.randn(2, 456, 512, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        grads = []
        for model in (block, compiled):
            block.zero_grad(set_to_none=True)
            leaf = x.detach().requires_grad_()
            model(leaf).backward(dy)
            grads.append([leaf.grad] + [p.grad for p in block.parameters()])
        for eager, traced in zip(*grads):
            assert torch.isfinite(traced).all()
            assert oracle.rel_l2(traced, eager) < 1e-2
    assert counters["stats"]["unique_graphs"] == 1


def test_a_qwen2_model_trains_on_the_lab_attention():
    """A small Qwen2 (D 64, GQA 4 / 2, bf16) with ``attn_implementation="ws_lab"``
    (ws_lab/rollout/hf_attention.py): its logits and every parameter's gradient equal SDPA's
    up to bf16 rounding (tests/cpu/test_hf_attention.py checks the adapter in fp32 against
    the oracle)."""
    import copy

    import torch

    pytest.importorskip("transformers")
    from ws_lab.rollout import config, hf_attention

    shape = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    sdpa = config.random_model(config.qwen2_config(config.TINY, **shape), torch.bfloat16,
                               "cuda")
    lab = copy.deepcopy(sdpa)
    lab.set_attn_implementation(hf_attention.register())
    ids = torch.randint(0, sdpa.config.vocab_size, (4, 456), device="cuda")
    results = []
    for model in (sdpa, lab):
        model.train()
        logits = model(ids).logits
        logits.float().square().mean().backward()
        results.append((logits.detach(), [p.grad for p in model.parameters()]))
    (want, want_grads), (got, got_grads) = results
    assert oracle.rel_l2(got, want) < 1e-2
    assert all(oracle.rel_l2(g, w) < 2e-2 for g, w in zip(got_grads, want_grads))


def test_the_training_decoder_on_the_lab_attention_errs_as_hfs_decoder_does():
    """``TrainingDecoder`` with ``attn_implementation="ws_lab"`` (q, k, v handed to the op in
    (B, T, H, D) by ``rope_qkv(bshd=True)``), bf16, against HF's decoder in float64 (autograd
    through the reference): the hidden states and every parameter's gradient err no more than
    1.5 × HF's own bf16 decoder's. Layer 0's kept K / V equal the SDPA decoder's bitwise (the
    same RoPE pass, the other layout)."""
    import copy

    import torch

    pytest.importorskip("transformers")
    from tests.decoder_grads import errors_against_float64
    from ws_lab.rollout import config, hf_attention
    from ws_lab.rollout.train_stack import TrainingDecoder

    shape = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    hf = config.random_model(config.qwen2_config(config.TINY, **shape), torch.bfloat16, "cuda")
    model = copy.deepcopy(hf).train()
    model.set_attn_implementation(hf_attention.register())
    ids = torch.randint(0, hf.config.vocab_size, (3, 456), device="cuda")
    weight = torch.randn(3, 456, hf.config.hidden_size, device="cuda", dtype=torch.float64)
    for name, lab, own in errors_against_float64(TrainingDecoder(model), model, hf, ids, weight):
        assert lab <= 1.5 * own + 1e-4, name  # a NaN fails it
    with torch.no_grad():
        lab_kv = TrainingDecoder(model)(ids, keep_kv=True)[1][0]
        sdpa_kv = TrainingDecoder(hf)(ids, keep_kv=True)[1][0]
    for got_t, want_t in zip(lab_kv, sdpa_kv):
        assert got_t.shape == want_t.shape and torch.equal(got_t, want_t)


SANITIZED = """
import torch
from ws_lab import oracle
from ws_lab.kernels.bwd import pipelined
for d, causal, s in ((64, True, 127), (128, False, 200)):
    q = torch.randn(1, s, 8, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, s, 2, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)
    out, lse = oracle.attention_ref(q, k, v, causal=causal)
    want = oracle.attention_bwd_ref(q, k, v, dout, causal=causal)
    planned = pipelined.planned_config(1, s, 8, 2, d, causal, 132)  # the group split in 4 here
    for options in (dict(config=planned), dict(config=pipelined.DEFAULT),
                    dict(dynamic_batch=True)):  # the op's kernels: B at launch, the plan's split
        grads = pipelined.attention_bwd(q, k, v, out.to(q.dtype), dout, lse.float(), causal,
                                        **options)
        assert all(oracle.rel_l2(g, w) < 2e-2 for g, w in zip(grads, want))
"""


SANITIZED_WS = """
import torch
from ws_lab import oracle
from ws_lab.kernels.bwd import pipelined, ws
for causal, s in ((True, 256), (False, 384)):
    q = torch.randn(2, s, 8, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, s, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)
    out, lse = oracle.attention_ref(q, k, v, causal=causal)
    want = oracle.attention_bwd_ref(q, k, v, dout, causal=causal)
    for options in (dict(backend="ws"), dict(backend="ws", dynamic_batch=True),
                    dict(config=ws.Config(dq_layout="padded")), dict(config=ws.Config(pdl=True)),
                    dict(config=ws.Config(zero_next=True)), dict(config=ws.Config(zero_next=True))):
        grads = pipelined.attention_bwd(q, k, v, out.to(q.dtype), dout, lse.float(), causal,
                                        **options)
        assert all(oracle.rel_l2(g, w) < 2e-2 for g, w in zip(grads, want))
"""


@pytest.mark.parametrize("tool", ["racecheck", "memcheck"])
def test_sanitizers_find_nothing_on_the_ws_backend(tool):
    """``backend="ws"`` (mbarriers only, TileLang's syncs off), causal and full, a static and a
    dynamic batch, the padded dQ layout, PDL and zero_next (twice: the second call adds into what
    the first zeroed): no shared-memory hazard (racecheck) and no access
    out of bounds (memcheck) in its main kernel or the pre / postprocess."""
    assert_sanitizer_clean(tool, SANITIZED_WS, kernels="main")


@pytest.mark.parametrize("tool", ["racecheck", "memcheck"])
def test_sanitizers_find_nothing_on_ragged_sequences(tool):
    """S not a multiple of either tile: the Q / dO / lse / Δ tiles and the K / V tile past S
    must be bounded (memcheck, 0 errors), and no shared-memory hazard in the main kernel or its
    pre / postprocess (racecheck, 0 hazards). TileLang names them main*_kernel."""
    assert_sanitizer_clean(tool, SANITIZED, kernels="main")
