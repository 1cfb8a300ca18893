"""Every entry point refuses bad input with a TypeError / ValueError naming the problem, before
any launch: paged_attention, torch.ops.ws_lab.triton_mha (its real and its fake implementation
raise the same errors) and the registry's attention(). Inputs are CPU or meta tensors; no case
reaches a kernel."""
import numpy as np
import pytest
import torch

from ws_lab import registry
from ws_lab.kernels.decode import paged
from ws_lab.kernels.fwd import triton_mha  # noqa: F401  (registers torch.ops.ws_lab.triton_mha)


def _paged(**changes):
    args = dict(q=torch.randn(2, 4, 64), k_cache=torch.randn(8, 16, 2, 64),
                v_cache=torch.randn(8, 16, 2, 64), block_table=torch.zeros(2, 3, dtype=torch.int32),
                context_lens=torch.ones(2, dtype=torch.int32))
    args.update({k: v for k, v in changes.items() if k in args})
    return args, {k: v for k, v in changes.items() if k not in args}


_pool, _q = torch.randn(8, 16, 2, 64), torch.randn(2, 4, 64)
PAGED = [
    ("q a list", dict(q=[[0.0]]), TypeError, "q must be a torch.Tensor"),
    ("mode v3", dict(mode="v3"), ValueError, "mode must be one of"),
    ("int64 table", dict(block_table=torch.zeros(2, 3, dtype=torch.int64)), TypeError,
     "block_table must be int32"),
    ("float lens", dict(context_lens=torch.ones(2)), TypeError, "context_lens must be int32"),
    ("fp64 q", dict(q=torch.randn(2, 4, 64).double()), TypeError, "q has dtype"),
    ("int8 q", dict(q=torch.zeros(2, 4, 64, dtype=torch.int8)), TypeError, "q has dtype"),
    ("fp16 cache, fp32 q", dict(k_cache=torch.randn(8, 16, 2, 64).half()), TypeError, "dtypes differ"),
    ("4-D q", dict(q=torch.randn(2, 1, 4, 64)), ValueError, "expected q"),
    ("3-D cache", dict(k_cache=torch.randn(8, 16, 64)), ValueError, "expected q"),
    ("1-D table", dict(block_table=torch.zeros(6, dtype=torch.int32)), ValueError, "expected q"),
    ("k/v shapes differ", dict(v_cache=torch.randn(8, 16, 1, 64)), ValueError, "differ"),
    ("lens batch", dict(context_lens=torch.ones(3, dtype=torch.int32)), ValueError, "batch mismatch"),
    ("table batch", dict(block_table=torch.zeros(1, 3, dtype=torch.int32)), ValueError,
     "batch mismatch"),
    ("head dim 72", dict(q=torch.randn(2, 4, 72), k_cache=torch.randn(8, 16, 2, 72),
                         v_cache=torch.randn(8, 16, 2, 72)), ValueError, "unsupported head dim 72"),
    ("q/cache head dim", dict(q=torch.randn(2, 4, 128)), ValueError, "!= cache head_dim"),
    ("partial group", dict(q=torch.randn(2, 3, 64)), ValueError, "not a multiple"),
    ("block size 12", dict(k_cache=torch.randn(8, 12, 2, 64), v_cache=torch.randn(8, 12, 2, 64)),
     ValueError, "power of two"),
    ("block size 256", dict(k_cache=torch.randn(2, 256, 2, 64), v_cache=torch.randn(2, 256, 2, 64)),
     ValueError, "power of two"),
    ("strided cache", dict(k_cache=torch.randn(8, 16, 4, 64)[:, :, ::2],
                           v_cache=torch.randn(8, 16, 2, 64)), ValueError, "contiguous"),
    ("transposed table", dict(block_table=torch.zeros(3, 2, dtype=torch.int32).t()), ValueError,
     "block_table must be contiguous"),
    ("scale negative", dict(softmax_scale=-1.0), ValueError, "softmax_scale must be finite"),
    ("scale nan", dict(softmax_scale=float("nan")), ValueError, "softmax_scale must be finite"),
    ("scale string", dict(softmax_scale="0.1"), TypeError, "softmax_scale must be a float"),
    ("scale bool", dict(softmax_scale=True), TypeError, "softmax_scale must be a float"),
    ("0 query heads", dict(q=torch.randn(2, 0, 64)), ValueError, "q has 0 query heads"),
    ("0 KV heads", dict(k_cache=torch.randn(8, 16, 0, 64), v_cache=torch.randn(8, 16, 0, 64)),
     ValueError, "k_cache has 0 KV heads"),
    ("empty pool", dict(k_cache=torch.randn(0, 16, 2, 64), v_cache=torch.randn(0, 16, 2, 64)),
     ValueError, "k_cache holds 0 blocks"),
    ("0-column table", dict(block_table=torch.zeros(2, 0, dtype=torch.int32)), ValueError,
     "block_table has 0 columns"),
    ("out shape", dict(out=torch.empty(2, 4, 32)), ValueError, "out must be a"),
    ("out dtype", dict(out=torch.empty(2, 4, 64, dtype=torch.float16)), ValueError, "out must be a"),
    ("out not a tensor", dict(out=3), TypeError, "out must be a torch.Tensor"),
    ("out strided head dim", dict(out=torch.empty(2, 64, 4).transpose(1, 2)), ValueError,
     "stride 1 in the head dim"),
    ("out is q", dict(q=_q, out=_q), ValueError, "out overlaps q"),  # read after being written
    ("out overlaps k_cache", dict(k_cache=_pool, out=_pool.view(-1)[:512].view(2, 4, 64)),
     ValueError, "out overlaps k_cache"),
    ("out on another device", dict(out=torch.empty(2, 4, 64, device="meta")), ValueError,
     "different devices"),
    ("cpu without the interpreter", dict(), ValueError,
     "CUDA tensors \\(CPU tensors only under TRITON_INTERPRET=1\\), got cpu"),
    ("meta tensors", dict(q=torch.empty(2, 4, 64, device="meta"),
                          k_cache=torch.empty(8, 16, 2, 64, device="meta"),
                          v_cache=torch.empty(8, 16, 2, 64, device="meta"),
                          block_table=torch.zeros(2, 3, dtype=torch.int32, device="meta"),
                          context_lens=torch.ones(2, dtype=torch.int32, device="meta")),
     ValueError, "got meta tensors"),
]


@pytest.mark.parametrize("changes,exc,message", [c[1:] for c in PAGED], ids=[c[0] for c in PAGED])
def test_paged_attention_refuses(changes, exc, message, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args, kwargs = _paged(**changes)
    with pytest.raises(exc, match=message):
        paged.paged_attention(*args.values(), **kwargs)


def _paged_cuda(**changes):
    """A valid backend='cuda' call (fp16, head dim 128, 16-token blocks) with ``changes``."""
    half = dict(q=torch.randn(2, 4, 128).half(), k_cache=torch.randn(8, 16, 2, 128).half(),
                v_cache=torch.randn(8, 16, 2, 128).half())
    return _paged(**{**half, **changes})


def _misaligned_cache():
    """Contiguous, but 2 bytes past a 16-byte boundary."""
    return torch.randn(8 * 16 * 2 * 128 + 1).half()[1:].view(8, 16, 2, 128)


CUDA_MODE = [
    ("fp32", dict(q=torch.randn(2, 4, 128), k_cache=torch.randn(8, 16, 2, 128),
                  v_cache=torch.randn(8, 16, 2, 128)), TypeError, "takes float16 or bfloat16"),
    ("head dim 64", dict(q=torch.randn(2, 4, 64).half(), k_cache=torch.randn(8, 16, 2, 64).half(),
                         v_cache=torch.randn(8, 16, 2, 64).half()), ValueError,
     "head dim 128 only, got 64"),
    ("block size 32", dict(k_cache=torch.randn(4, 32, 2, 128).half(),
                           v_cache=torch.randn(4, 32, 2, 128).half()), ValueError,
     "block_size 16 only, got 32"),
    ("group 32", dict(q=torch.randn(2, 64, 128).half()), ValueError, "at most 16 heads"),
    ("odd q stride", dict(q=torch.randn(2, 4, 129).half()[..., :128]), ValueError,
     "4-byte aligned with even strides"),
    ("misaligned k_cache", dict(k_cache=_misaligned_cache()), ValueError,
     "k_cache 16-byte aligned"),
    ("a launch config", dict(config=paged.DEFAULTS["gqa"]), ValueError, "plans its own"),
    ("cpu under the interpreter", dict(), ValueError, "needs CUDA tensors, got cpu"),
]


@pytest.mark.parametrize("changes,exc,message", [c[1:] for c in CUDA_MODE],
                         ids=[c[0] for c in CUDA_MODE])
def test_cuda_mode_refuses(changes, exc, message, monkeypatch):
    """Under the interpreter CPU tensors pass the Triton modes' device check, so each case
    reaches backend='cuda''s own checks, which run before its device check."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    args, kwargs = _paged_cuda(**changes)
    with pytest.raises(exc, match=message):
        paged.paged_attention(*args.values(), backend="cuda", **kwargs)


CHECKED = [
    ("length past the table", [0, 49], None, "context_lens\\[1\\] = 49 is outside \\[0, 48\\]"),
    ("negative length", [-1, 3], None, "context_lens\\[0\\] = -1 is outside"),
    ("block id past the pool", [40, 40], (1, 2, 8), "block_table\\[1, 2\\] = 8 is not a block"),
    ("negative block id", [40, 17], (1, 1, -5), "block_table\\[1, 1\\] = -5 is not a block"),
]


@pytest.mark.parametrize("lens,poke,message", [c[1:] for c in CHECKED], ids=[c[0] for c in CHECKED])
def test_check_indices_refuses_values_that_would_read_out_of_bounds(lens, poke, message,
                                                                    monkeypatch):
    """``check_indices=True`` looks at the values (a host sync); CPU tensors pass the device
    check only under the interpreter, and every case here is refused before a launch."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    table = torch.arange(6, dtype=torch.int32).view(2, 3)
    if poke:
        table[poke[0], poke[1]] = poke[2]
    args, _ = _paged(block_table=table, context_lens=torch.tensor(lens, dtype=torch.int32))
    with pytest.raises(ValueError, match=message):
        paged.paged_attention(*args.values(), check_indices=True)


def test_an_unused_block_id_is_not_an_error(monkeypatch):
    """Columns past a sequence's length are never read: check_indices ignores them (a length
    of 17 uses two of three columns)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from ws_lab.kernels.decode.paged import check_index_range

    table = torch.tensor([[0, 1, 99], [2, 3, -7]], dtype=torch.int32)
    check_index_range(table, torch.tensor([17, 32], dtype=torch.int32), 8, 16)


def _qkv(device="cpu", b=1, s=16, hq=4, hkv=2, d=64, dv=None, dtype=torch.float16):
    return (torch.empty(b, s, hq, d, device=device, dtype=dtype).normal_() if device == "cpu" else
            torch.empty(b, s, hq, d, device=device, dtype=dtype),
            torch.empty(b, s, hkv, d, device=device, dtype=dtype),
            torch.empty(b, s, hkv, dv or d, device=device, dtype=dtype))


OP = [
    ("partial group", dict(hq=3), ValueError, "not a multiple of Hkv"),
    ("fp32", dict(dtype=torch.float32), TypeError, "dtype torch.float32"),
    ("head dim 96", dict(d=96), ValueError, r"unsupported head dim \(D=96, Dv=96\)"),
    ("Dv 128 with D 64", dict(dv=128), ValueError, r"D=64, Dv=128"),
    ("empty sequence", dict(s=0), ValueError, "empty input"),
    ("empty batch", dict(b=0), ValueError, "empty input"),
]


@pytest.mark.parametrize("device", ["meta", "cpu"], ids=["fake", "real"])
@pytest.mark.parametrize("dims,exc,message", [c[1:] for c in OP], ids=[c[0] for c in OP])
def test_triton_mha_op_refuses_in_the_op_and_its_fake(device, dims, exc, message):
    q, k, v = _qkv(device, **dims)
    with pytest.raises(exc, match=message):
        torch.ops.ws_lab.triton_mha(q, k, v, True, 0.125)


@pytest.mark.parametrize("device", ["meta", "cpu"], ids=["fake", "real"])
@pytest.mark.parametrize("scale,exc", [(0.0, ValueError), (float("inf"), ValueError)])
def test_triton_mha_op_refuses_bad_scales(device, scale, exc):
    with pytest.raises(exc, match="softmax_scale must be finite"):
        torch.ops.ws_lab.triton_mha(*_qkv(device), False, scale)


def test_triton_mha_op_refuses_mismatched_layouts_and_cpu():
    q, k, v = _qkv("meta")
    with pytest.raises(ValueError, match="batch/seq mismatch"):
        torch.ops.ws_lab.triton_mha(q, k[:, :8], v[:, :8], True, 0.125)
    with pytest.raises(ValueError, match="must be 4-D BSHD"):
        torch.ops.ws_lab.triton_mha(q[0], k[0], v[0], True, 0.125)
    with pytest.raises(ValueError, match="CPU tensors only under TRITON_INTERPRET=1"):
        torch.ops.ws_lab.triton_mha(*_qkv("cpu"), True, 0.125)


ENTRIES = ["pipelined", "coop", "coop-overlap-persistent", "triton-mha"]
REGISTRY = [
    ("causal a string", dict(causal="yes"), TypeError, "causal must be a bool, got str"),
    ("causal an int", dict(causal=1), TypeError, "causal must be a bool, got int"),
    ("causal None", dict(causal=None), TypeError, "causal must be a bool, got NoneType"),
    ("out is q", dict(out="q"), ValueError, "out overlaps q"),
    ("out overlaps v", dict(out="v"), ValueError, "out overlaps v"),
    # accepted: numpy scalars and numpy bools get as far as the device check
    ("numpy float32 scale", dict(softmax_scale=np.float32(0.125)), ValueError, "CUDA tensors"),
    ("numpy float64 scale", dict(softmax_scale=np.float64(0.125)), ValueError, "CUDA tensors"),
    ("numpy bool causal", dict(causal=np.bool_(True)), ValueError, "CUDA tensors"),
]


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("kwargs,exc,message", [c[1:] for c in REGISTRY], ids=[c[0] for c in REGISTRY])
def test_registry_attention_refuses(entry, kwargs, exc, message, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = _qkv(hq=2, d=128)
    kwargs = dict(kwargs)
    if kwargs.get("out") == "q":
        kwargs["out"] = q
    elif kwargs.get("out") == "v":  # v and out carved from one buffer, sharing its middle
        buffer = torch.empty(3 * v.numel(), dtype=torch.float16).normal_()
        v = buffer[v.numel():2 * v.numel()].view(v.shape)
        kwargs["out"] = buffer[v.numel() // 2:v.numel() // 2 + q.numel()].view(q.shape)
    with pytest.raises(exc, match=message):
        registry.get(entry).attention(q, k, v, **kwargs)


def _fused(paged=False, **changes):
    """Arguments of a valid fused-decode call (static caches, or paged with ``paged``), with
    ``changes`` replacing some; keyword options (out, softmax_scale, check_positions) pass
    through."""
    args = dict(q=torch.randn(2, 14, 64).half(), k_new=torch.randn(2, 2, 64).half(),
                v_new=torch.randn(2, 2, 64).half(),
                k_cache=torch.randn(2, 2, 32, 64).half(), v_cache=torch.randn(2, 2, 32, 64).half(),
                cos=torch.randn(32, 64).half(), sin=torch.randn(32, 64).half(),
                positions=torch.tensor([0, 31], dtype=torch.int32))
    if paged:  # the paged entry takes block_table after the caches
        args.update(k_cache=torch.randn(6, 16, 2, 64).half(), v_cache=torch.randn(6, 16, 2, 64).half())
        head = list(args.items())
        args = dict(head[:5] + [("block_table", torch.tensor([[0, 1], [2, 3]], dtype=torch.int32))]
                    + head[5:])
    options = {k: changes.pop(k) for k in ("out", "softmax_scale", "check_positions")
               if k in changes}
    args.update(changes)
    return args, options


FUSED = [
    ("q a list", dict(q=[[0.0]]), TypeError, "q must be a torch.Tensor"),
    ("fp32 q", dict(q=torch.randn(2, 14, 64)), TypeError, "q has dtype torch.float32"),
    ("bf16 cache", dict(k_cache=torch.randn(2, 2, 32, 64).bfloat16()), TypeError,
     "k_cache has dtype torch.bfloat16, q has torch.float16"),
    ("int cos", dict(cos=torch.zeros(32, 64, dtype=torch.int32)), TypeError,
     "cos must be a floating-point tensor"),
    ("int64 positions", dict(positions=torch.tensor([0, 1])), TypeError,
     "positions must be int32"),
    ("4-D q", dict(q=torch.randn(2, 1, 14, 64).half()), ValueError, "q must be \\(B, Hq, D\\)"),
    ("k_new batch", dict(k_new=torch.randn(3, 2, 64).half()), ValueError, "must both be"),
    ("partial group", dict(q=torch.randn(2, 13, 64).half()), ValueError, "not a multiple"),
    ("head dim 96", dict(q=torch.randn(2, 14, 96).half(), k_new=torch.randn(2, 2, 96).half(),
                         v_new=torch.randn(2, 2, 96).half()), ValueError, "unsupported head dim 96"),
    ("cache heads", dict(k_cache=torch.randn(2, 4, 32, 64).half(),
                         v_cache=torch.randn(2, 4, 32, 64).half()), ValueError,
     "static caches must be"),
    ("k/v caches differ", dict(v_cache=torch.randn(2, 2, 16, 64).half()), ValueError,
     "must be equal 4-D caches"),
    ("cos too short", dict(cos=torch.randn(31, 64).half()), ValueError,
     "cos has 31 rows, fewer than the cache's 32 positions"),
    ("sin too narrow", dict(sin=torch.randn(32, 32).half()), ValueError, "sin must be \\(L, D=64\\)"),
    ("positions shape", dict(positions=torch.zeros(3, dtype=torch.int32)), ValueError,
     "positions must be \\(B=2,\\)"),
    ("strided cache", dict(k_cache=torch.randn(2, 2, 64, 64).half()[:, :, ::2],
                           v_cache=torch.randn(2, 2, 32, 64).half()), ValueError,
     "k_cache must be contiguous"),
    ("q heads not packed", dict(q=torch.randn(2, 14, 128).half()[:, :, :64]), ValueError,
     "q must be packed heads"),
    ("out shape", dict(out=torch.empty(2, 14, 32).half()), ValueError, "out must be a contiguous"),
    ("out is q", dict(out="q"), ValueError, "out overlaps q"),
    ("scale zero", dict(softmax_scale=0.0), ValueError, "softmax_scale must be finite"),
    ("cpu without the interpreter", dict(out=torch.empty(2, 14, 64).half()), ValueError,
     "CPU tensors only under TRITON_INTERPRET=1"),
    ("positions on another device", dict(positions=torch.zeros(2, dtype=torch.int32,
                                                                device="meta")), ValueError,
     "inputs are on different devices"),
]


@pytest.mark.parametrize("changes,exc,message", [c[1:] for c in FUSED], ids=[c[0] for c in FUSED])
def test_fused_decode_refuses(changes, exc, message, monkeypatch):
    from ws_lab.kernels.decode import fused_decode

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args, options = _fused(**changes)
    if options.get("out") == "q":
        options["out"] = args["q"]
    with pytest.raises(exc, match=message):
        fused_decode.fused_decode_attention(*args.values(), **options)


FUSED_PAGED = [
    ("table batch", dict(block_table=torch.zeros(3, 2, dtype=torch.int32)), ValueError,
     "block_table must be \\(B=2, max_blocks"),
    ("table int64", dict(block_table=torch.zeros(2, 2, dtype=torch.int64)), TypeError,
     "block_table must be int32"),
    ("block size 12", dict(k_cache=torch.randn(6, 12, 2, 64).half(),
                           v_cache=torch.randn(6, 12, 2, 64).half()), ValueError, "power of two"),
    ("cache heads", dict(k_cache=torch.randn(6, 16, 1, 64).half(),
                         v_cache=torch.randn(6, 16, 1, 64).half()), ValueError,
     "paged caches must be"),
]


@pytest.mark.parametrize("changes,exc,message", [c[1:] for c in FUSED_PAGED],
                         ids=[c[0] for c in FUSED_PAGED])
def test_fused_paged_decode_refuses(changes, exc, message):
    from ws_lab.kernels.decode import fused_decode

    args, options = _fused(paged=True, **changes)
    with pytest.raises(exc, match=message):
        fused_decode.fused_paged_decode_attention(*args.values(), **options)


@pytest.mark.parametrize("positions,message", [([0, 32], "positions\\[1\\] = 32 is outside \\[0, 32\\)"),
                                               ([-1, 3], "positions\\[0\\] = -1 is outside")])
def test_fused_decode_check_positions_refuses_out_of_range(positions, message, monkeypatch):
    """The host check (it syncs); without it positions are clamped in the kernel."""
    from ws_lab.kernels.decode import fused_decode

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    args, options = _fused(positions=torch.tensor(positions, dtype=torch.int32),
                           check_positions=True)
    with pytest.raises(ValueError, match=message):
        fused_decode.fused_decode_attention(*args.values(), **options)


def test_fused_decode_op_fake_refuses_like_the_op():
    """torch.ops.ws_lab.fused_decode on meta tensors runs the fake: same checks, same errors."""
    from ws_lab.kernels.decode import fused_decode  # noqa: F401  (registers the op)

    args, _ = _fused(cos=torch.randn(31, 64).half())
    meta = [t.to("meta") for t in args.values()]
    with pytest.raises(ValueError, match="cos has 31 rows"):
        torch.ops.ws_lab.fused_decode(*meta, 0.125)


def test_fused_decode_op_traces_under_fake_tensors():
    """torch.compile traces the op with fake tensors, which have no addresses: its checks must
    pass them (the aliasing checks run again on the real call), and its fake gives q's shape."""
    from torch._subclasses import FakeTensorMode

    from ws_lab.kernels.decode import fused_decode  # noqa: F401  (registers the op)

    args, _ = _fused()
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in args.values()]
        out = torch.ops.ws_lab.fused_decode(*fake, 0.125)
    assert isinstance(out, torch._subclasses.FakeTensor) and out.shape == args["q"].shape


@pytest.mark.parametrize("logits, k, temperature, message", [
    (torch.randn(4, 8192), 50, 1.0, "needs a CUDA"),  # a CPU tensor without the interpreter
    ("interp", 0, 1.0, "1 ≤ k"),
    ("interp", 129, 1.0, "1 ≤ k"),
    ("interp-narrow", 65, 1.0, "chunks"),  # 4096 columns: 64 chunks of 64 < k
    ("interp-wide", 50, 1.0, "at most 32768 chunks"),  # the selection's packed counts
    ("interp", 50, 0.0, "temperature must be > 0"),
    ("interp-int", 50, 1.0, "2-D"),
    ("interp-3d", 50, 1.0, "2-D"),
])
def test_top_k_sample_refuses(logits, k, temperature, message, monkeypatch):
    from ws_lab.kernels.step import sampling

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if isinstance(logits, str):
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        logits = {"interp": torch.randn(4, 8192), "interp-narrow": torch.randn(4, 4096),
                  "interp-wide": torch.empty(1, 32768 * 64 + 1),
                  "interp-int": torch.zeros(4, 8192, dtype=torch.int32),
                  "interp-3d": torch.randn(2, 4, 8192)}[logits]
    with pytest.raises(ValueError, match=message):
        sampling.top_k_sample(logits, k, temperature)


@pytest.mark.parametrize("weight, message", [
    (torch.randn(64, 128).t(), "contiguous weight"),
    (torch.randn(64, 96).half(), "K = 128"),
    (torch.randn(40, 128).half(), "multiples"),
])
def test_linear_refuses(weight, message, monkeypatch):
    from ws_lab.kernels.step import decode_layer

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match=message):
        decode_layer.linear(torch.randn(4, 128).half(), weight.half())


@pytest.mark.parametrize("chunk_max, message", [
    (torch.empty(4, 4, dtype=torch.float16), "contiguous float32 tensor, got torch.float16"),
    (torch.empty(4, 3), "must be \\(4, 64 / C\\)"),  # 64 columns are not 3 whole chunks
    (torch.empty(5, 4), "must be \\(4, 64 / C\\)"),
    (torch.empty(4, 1), "width 64 must divide the config's BLOCK_N 32"),
    (torch.empty(4, 8)[:, ::2], "contiguous float32 tensor, got torch.float32 with strides"),
])
def test_linear_refuses_chunk_max(chunk_max, message, monkeypatch):
    from ws_lab.kernels.step import decode_layer

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match=message):
        decode_layer.linear(torch.randn(4, 128).half(), torch.randn(64, 128).half(),
                            chunk_max=chunk_max)


@pytest.mark.parametrize("chunk_max, message", [
    (torch.empty(4, 127), "got torch.float32 \\(4, 127\\)"),
    (torch.empty(4, 128, dtype=torch.float16), "got torch.float16 \\(4, 128\\)"),
    (torch.empty(128, 4).t(), "with strides \\(1, 4\\)"),
])
def test_top_k_sample_refuses_chunk_max(chunk_max, message, monkeypatch):
    from ws_lab.kernels.step import sampling

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match=message):
        sampling.top_k_sample(torch.randn(4, 8192), 50, 1.0, chunk_max=chunk_max)


_SEED = torch.zeros(1, dtype=torch.int64)


@pytest.mark.parametrize("seed, error, message", [
    (_SEED, TypeError, "seed must be a \\(base, counter\\) pair of tensors, got Tensor"),
    ((_SEED, 3), TypeError, "seed counter must be a torch.Tensor, got int"),
    ((_SEED.int(), _SEED), ValueError, "seed base must be a one-element int64 tensor on cpu, "
                                       "got torch.int32"),
    ((_SEED, torch.zeros(2, dtype=torch.int64)), ValueError,
     "seed counter must be a one-element int64 tensor on cpu, got torch.int64 \\(2,\\)"),
    ((_SEED, _SEED.to("meta")), ValueError, "seed counter .* on meta"),
])
def test_top_k_sample_refuses_seed(seed, error, message, monkeypatch):
    from ws_lab.kernels.step import sampling

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(error, match=message):
        sampling.top_k_sample(torch.randn(4, 8192), 50, 1.0, seed=seed)


def test_prefetch_l2_refuses_a_strided_tensor():
    from ws_lab.kernels.step import decode_layer

    with pytest.raises(ValueError, match="contiguous tensor"):
        decode_layer.prefetch_l2(torch.empty(8, 8).t())


_CACHE = torch.empty(2, 2, 8, 64, dtype=torch.bfloat16)
_POS = torch.full((2,), 3, dtype=torch.int32)


@pytest.mark.parametrize("k, v, positions, error, message", [
    (_CACHE, torch.empty(2, 2, 9, 64, dtype=torch.bfloat16), _POS, ValueError, "one .* shape"),
    (_CACHE[0], _CACHE[0], _POS, ValueError, "one .* shape"),
    (_CACHE, _CACHE.transpose(2, 3).contiguous().transpose(2, 3), _POS, ValueError, "contiguous"),
    (_CACHE, _CACHE.half(), _POS, TypeError, "caches differ"),
    (_CACHE, _CACHE, _POS.long(), TypeError, "positions must be int32"),
    (_CACHE, _CACHE, _POS[:1], TypeError, r"shape \(2,\)"),
    (_CACHE, _CACHE, _POS.to("meta"), ValueError, "positions on meta"),
])
def test_prefetch_context_l2_refuses(k, v, positions, error, message):
    from ws_lab.kernels.step import decode_layer

    with pytest.raises(error, match=message):
        decode_layer.prefetch_context_l2(k, v, positions)


def test_linear_refuses_mixed_dtypes(monkeypatch):
    from ws_lab.kernels.step import decode_layer

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(TypeError, match="share a dtype"):
        decode_layer.linear(torch.randn(4, 128).half(), torch.randn(64, 128))


def test_rollout_step_refuses_a_strided_output():
    from ws_lab.kernels.step import rollout_step

    rows = torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="unit column stride"):
        rollout_step.advance(rows, None, torch.zeros(4, dtype=torch.bool), rows.clone(),
                             torch.zeros(4, dtype=torch.int32),
                             torch.zeros(8, 4, dtype=torch.long).t(), torch.zeros(1, dtype=torch.long),
                             3, True)


def _norm_case(**changes):
    base = dict(x=torch.randn(4, 64).half(), weight=torch.randn(64).half(),
                residual=torch.randn(4, 64).half())
    return {**base, **changes}


NORM_CASES = [
    ("short residual", dict(residual=torch.randn(2, 64).half()), ValueError, "residual \\(4, 64\\)"),
    ("short weight", dict(weight=torch.randn(32).half()), ValueError, "weight must be \\(64,\\)"),
    ("transposed x", dict(x=torch.randn(64, 4).half().t()), ValueError, "x must be contiguous"),
    ("fp16 partials", dict(x=torch.randn(2, 4, 64).half()), TypeError, "fp32 when split-K"),
    ("residual dtype", dict(residual=torch.randn(4, 64)), TypeError, "residual torch.float16"),
    ("4-D x", dict(x=torch.randn(1, 2, 4, 64).half()), ValueError, "\\(rows, H\\)"),
    ("a list", dict(weight=[1.0] * 64), TypeError, "weight must be a torch.Tensor"),
    ("other device", dict(weight=torch.randn(64, device="meta").half()), ValueError,
     "different devices"),
    ("2M columns", dict(x=torch.empty(1, 2**21).half(), weight=torch.empty(2**21).half(),
                        residual=None), ValueError, "at most 32768"),
]


@pytest.mark.parametrize("changes,exc,message", [c[1:] for c in NORM_CASES],
                         ids=[c[0] for c in NORM_CASES])
def test_add_rmsnorm_refuses(changes, exc, message, monkeypatch):
    from ws_lab.kernels.step import decode_layer

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    case = _norm_case(**changes)
    with pytest.raises(exc, match=message):
        decode_layer.add_rmsnorm(case["x"], case["weight"], 1e-6, case["residual"])


@pytest.mark.parametrize("gate_up,message", [
    (torch.randn(4, 63).half(), "\\(rows, 2·I\\)"),
    (torch.randn(2, 4, 64).half(), "\\(rows, 2·I\\)"),
])
def test_silu_mul_refuses(gate_up, message):
    from ws_lab.kernels.step import decode_layer

    with pytest.raises(ValueError, match=message):
        decode_layer.silu_mul(gate_up)


@pytest.mark.parametrize("kwargs,message", [
    (dict(bias=torch.randn(32).half()), "bias must be \\(64,\\)"),
    (dict(bias=torch.randn(64).half(), glu=True), "goes without glu"),
    (dict(bias=torch.randn(64).half(), split_ok=True), "split-K partials carry no bias"),
])
def test_linear_refuses_a_bias_it_would_drop(kwargs, message, monkeypatch):
    from ws_lab.kernels.step import decode_layer

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg = decode_layer.LinearConfig(32, 32, 2, 2) if kwargs.get("split_ok") else None
    with pytest.raises(ValueError, match=message):
        decode_layer.linear(torch.randn(4, 128).half(), torch.randn(64, 128).half(), config=cfg,
                            **kwargs)


@pytest.mark.parametrize("k,temperature,exc,message", [
    (2.5, 1.0, TypeError, "k must be an int"),
    (50, float("nan"), ValueError, "temperature must be > 0 and finite"),
    (50, float("inf"), ValueError, "temperature must be > 0 and finite"),
])
def test_top_k_sample_refuses_types_and_nan(k, temperature, exc, message, monkeypatch):
    from ws_lab.kernels.step import sampling

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(exc, match=message):
        sampling.top_k_sample(torch.randn(4, 8192), k, temperature)


def test_sampling_config_refuses_nan_temperature_and_float_k():
    from ws_lab.rollout.sampling import Sampling

    with pytest.raises(ValueError, match="temperature ≥ 0"):
        Sampling(temperature=float("nan"), top_k=50)
    with pytest.raises(TypeError, match="top_k must be an int"):
        Sampling(top_k=2.5)


@pytest.fixture(scope="module")
def tiny_rollout():
    pytest.importorskip("transformers")
    from ws_lab.rollout import config
    from ws_lab.rollout.model import DecodeModel

    hf = config.random_model(config.qwen2_config(config.TINY), torch.float32, "cpu")
    return hf, DecodeModel(hf, 2, 32, attention="sdpa")


@pytest.mark.parametrize("change,message", [
    (dict(max_new=0), "max_new must be a positive int"),
    (dict(max_new=-3), "max_new must be a positive int"),
    (dict(max_new=2.0), "max_new must be a positive int"),
    (dict(prompts=torch.zeros(3, 4, dtype=torch.int64)), "B=2, P ≥ 1"),
    (dict(prompts=torch.zeros(2, 4)), "int64 / int32"),
    (dict(prompts=torch.full((2, 4), 96)), "token ids must lie in \\[0, 96\\)"),
    (dict(max_new=40), "exceed the cache's 32 positions"),
    (dict(forced=torch.zeros(2, 3, dtype=torch.int64)), "forced must be"),
])
def test_generate_refuses(change, message, tiny_rollout):
    from ws_lab.rollout.loop import generate
    from ws_lab.rollout.sampling import Sampling

    _, model = tiny_rollout
    args = dict(prompts=torch.zeros(2, 4, dtype=torch.int64), max_new=5, forced=None)
    args.update(change)
    with pytest.raises(ValueError, match=message):
        generate(model, args["prompts"], args["max_new"], Sampling(), 0, forced=args["forced"])


@pytest.mark.parametrize("batch,capacity,message", [
    (0, 32, "batch must be a positive int"), (2, 0, "capacity must be a positive int"),
    (2, 10**6, "exceeds the model's 512 positions")])
def test_decode_model_refuses(batch, capacity, message, tiny_rollout):
    from ws_lab.rollout.model import DecodeModel

    with pytest.raises(ValueError, match=message):
        DecodeModel(tiny_rollout[0], batch, capacity, attention="sdpa")


@pytest.mark.parametrize("option,value", [("attention", "flash"), ("gemms", "cutlass"),
                                          ("prefill", "compiled")])
def test_decode_model_refuses_an_unknown_backend(option, value, tiny_rollout):
    from ws_lab.rollout.model import DecodeModel

    with pytest.raises(ValueError, match=f"{option} must be one of .* got '{value}'"):
        DecodeModel(tiny_rollout[0], 2, 32, **{"attention": "sdpa", option: value})


def _interp_paged(dtype=torch.float16):
    """A valid paged call on CPU tensors (run under the interpreter)."""
    q = torch.randn(2, 4, 64, dtype=dtype)
    kc, vc = torch.randn(8, 16, 2, 64, dtype=dtype), torch.randn(8, 16, 2, 64, dtype=dtype)
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    return q, kc, vc, table, torch.tensor([5, 40], dtype=torch.int32)


@pytest.mark.parametrize("case,exc,message", [
    ("expanded out", ValueError, "must not be expanded"),
    ("one cache", ValueError, "k_cache and v_cache overlap"),
    ("needs grad", ValueError, "has no backward: q require grad"),
    ("bf16 interpreted", TypeError, "interpreter computes bf16 tl.dot wrong"),
    ("three warps", ValueError, "num_warps a power of two"),
])
def test_paged_refuses_layouts_and_configs(case, exc, message, monkeypatch):
    from ws_lab.kernels.decode import heuristics, paged

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, kc, vc, table, lens = _interp_paged(torch.bfloat16 if "bf16" in case else torch.float16)
    kwargs = {}
    if case == "expanded out":
        kwargs["out"] = torch.empty(1, 4, 64, dtype=q.dtype).expand(2, 4, 64)
    if case == "one cache":
        vc = kc
    if case == "needs grad":
        q.requires_grad_(True)
    with pytest.raises(exc, match=message):
        if case == "three warps":
            kwargs["config"] = heuristics.LaunchConfig(64, 3, 2, 4)
        paged.paged_attention(q, kc, vc, table, lens, **kwargs)


def test_host_checks_refuse_graph_capture(monkeypatch):
    from ws_lab import check
    from ws_lab.kernels.decode import paged

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(check, "capturing", lambda device: True)
    with pytest.raises(ValueError, match="cannot run inside CUDA-graph capture"):
        paged.paged_attention(*_interp_paged(), check_indices=True)


def _interp_fused_paged(positions, table):
    from ws_lab.rope import rope_tables

    q = torch.randn(2, 4, 64).half()
    k_new, v_new = torch.randn(2, 2, 64).half(), torch.randn(2, 2, 64).half()
    kc, vc = torch.randn(8, 16, 2, 64).half(), torch.randn(8, 16, 2, 64).half()
    cos, sin = rope_tables(64, 64)
    return (q, k_new, v_new, kc, vc, torch.tensor(table, dtype=torch.int32), cos, sin,
            torch.tensor(positions, dtype=torch.int32))


@pytest.mark.parametrize("positions,table,message", [
    ([3, 3], [[0, 1, 2, 3], [0, 4, 5, 6]], "write the same cache slot"),
    ([3, 20], [[0, 1, 2, 3], [4, 9, 5, 6]], "= 9 is not a block of the pool"),
    ([3, 64], [[0, 1, 2, 3], [4, 5, 6, 7]], "positions\\[1\\] = 64 is outside"),
])
def test_fused_paged_check_indices(positions, table, message, monkeypatch):
    from ws_lab.kernels.decode import fused_decode

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match=message):
        fused_decode.fused_paged_decode_attention(*_interp_fused_paged(positions, table),
                                                  check_indices=True)


def test_fused_refuses_one_cache_for_k_and_v(monkeypatch):
    from ws_lab.kernels.decode import fused_decode

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    args = list(_interp_fused_paged([3, 20], [[0, 1, 2, 3], [4, 5, 6, 7]]))
    args[4] = args[3]
    with pytest.raises(ValueError, match="k_cache and v_cache overlap"):
        fused_decode.fused_paged_decode_attention(*args)


def test_the_interpreter_takes_bf16_linear_through_torch(monkeypatch):
    """Triton's interpreter computes bf16 tl.dot wrong: linear takes the torch formula there."""
    from ws_lab import oracle
    from ws_lab.kernels.step import decode_layer

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x, w = torch.randn(4, 128).bfloat16(), torch.randn(64, 128).bfloat16()
    out = decode_layer.linear(x, w)
    assert oracle.rel_l2(out, x.double() @ w.double().t()) < 1e-2


def test_triton_mha_refuses_bf16_under_the_interpreter(monkeypatch):
    from ws_lab.kernels.fwd import triton_mha

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v = (torch.randn(1, 40, h, 64).bfloat16() for h in (4, 2, 2))
    with pytest.raises(TypeError, match="interpreter computes bf16 tl.dot wrong"):
        triton_mha.attention(q, k, v, causal=True)
