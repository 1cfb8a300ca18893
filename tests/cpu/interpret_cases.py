"""Runs the Triton kernels under TRITON_INTERPRET=1 on small cases; prints {case: [err, tol]}
as JSON. Run in a subprocess by test_triton_interpret.py (the variable must be set before
Triton is imported, and must not leak into GPU tests of the same session)."""
import json
import os

import triton
import triton.language as tl

from ws_lab.kernels.decode import triton_common
from ws_lab.kernels.step.sampling import first_k, kth_largest_key, min_max, order_key

# (batch, Hq, Hkv, D, block_size, context lens): groups 1/4/8/32, D 80/96, lens 1/17/513
PAGED = [(3, 4, 1, 64, 16, [1, 17, 513]), (2, 8, 1, 80, 8, [17, 1]), (1, 32, 1, 128, 32, [513]),
         (2, 2, 2, 96, 64, [100, 3])]
MHA = [(s, causal) for s in (40, 97) for causal in (False, True)]
# fused decode (fp16; the interpreter's bf16 dot is wrong, GPU tests cover bf16):
# (batch, Hq, Hkv, D, capacity, positions, block size or None for the static cache)
# the decode layer's linear (fp16; M, N, K, epilogue, LinearConfig fields or None for the rule)
LINEAR = [(5, 64, 256, "bias", None), (64, 32, 256, "glu", (16, 64, 1)),
          (7, 64, 512, "split", (16, 64, 4)), (3, 48, 128, "plain", (16, 128, 1))]
# top-k sampling (fp32 logits, rows, vocab, k): draws outside the k largest, and k = 1 = argmax
SAMPLING = [(3, 8192, 50), (4, 6400, 1), (2, 8000, 7)]
# the sampler's selection itself (dtype, n, k, distinct levels or None): the mask holds exactly
# k values and none outside it is larger; few levels make long runs of ties
SELECT = [("float32", 3000, 50, None), ("bfloat16", 4096, 50, 6), ("float16", 777, 1, None),
          ("bfloat16", 2000, 128, None), ("float32", 64, 64, 3),
          ("float32", 32768, 50, 1)]  # all tied at MAX_CHUNKS keys: packed counts reach 2^31
FUSED = [(3, 14, 2, 64, 160, [0, 1, 159], None), (2, 8, 8, 128, 130, [77, 5], None),
         (2, 32, 8, 128, 96, [95, 40], 16), (4, 14, 2, 64, 64, [63, 0, 31, 17], 8)]


def main():
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    import torch

    from ws_lab.kernels.decode import paged

    from ws_lab.kernels.fwd import triton_mha
    from ws_lab import oracle
    from ws_lab.paged_cases import check_paged, make_paged, variants

    results = {}
    for dtype in (torch.float32, torch.float16):
        for b, hq, hkv, d, bs, lens in PAGED:
            for name, fn in variants().items():
                err, tol, seed = check_paged(fn, b, hq, hkv, d, bs, lens, dtype, "cpu")
                results[f"paged-{name}-{dtype}-B{b}-{hq}/{hkv}-D{d}-bs{bs}-ctx{lens}"] = [err, tol]
        for seq, causal in MHA:
            q, k, v = (torch.randn(2, seq, h, 64).to(dtype) for h in (4, 2, 2))
            out = triton_mha.launch(q, k, v, torch.full_like(q, float("nan")), causal, 0.125)
            ref, _ = oracle.attention_ref(q, k, v, causal=causal, softmax_scale=0.125)
            tol = 1e-5 if dtype == torch.float32 else 2e-3
            results[f"mha-{dtype}-S{seq}-{'causal' if causal else 'full'}"] = [oracle.rel_l2(out, ref), tol]
    from ws_lab.decode_cases import check_decode, make_decode
    from ws_lab.kernels.decode import fused_decode

    for b, hq, hkv, d, cap, pos, bs in FUSED:
        fn = (fused_decode.fused_decode_attention if bs is None
              else fused_decode.fused_paged_decode_attention)
        problem = make_decode(b, hq, hkv, d, cap, pos, torch.float16, "cpu", bs)
        if bs is None:  # q / k_new / v_new as views of one fused qkv row (batch stride only)
            qkv = torch.cat([t.flatten(1) for t in (problem.q, problem.k_new, problem.v_new)], 1)
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=1)
            problem.q, problem.k_new, problem.v_new = (
                q.view(b, hq, d), k.view(b, hkv, d), v.view(b, hkv, d))
        c = check_decode(fn, problem)
        name = f"fused-B{b}-{hq}/{hkv}-D{d}-cap{cap}-pos{pos}-{'static' if bs is None else f'bs{bs}'}"
        results[name] = [c.rel_err, c.tolerance]
        results[name + "-k-slot-ulps"] = [c.k_slot_ulps, 1.0]
        results[name + "-v-slot-and-untouched-exact"] = [
            0.0 if c.v_slot_exact and c.untouched_exact else 1.0, 0.0]
    # lengths past the table's capacity (clamped), negative and zero (zeros), every variant
    for name, fn in variants().items():
        (q, kc, vc, table, _), _ = make_paged(4, 8, 2, 64, 16, [40, 40, 40, 40], torch.float32,
                                              "cpu")
        lens = torch.tensor([0, 10_000, -3, 33], dtype=torch.int32)
        out = fn(q, kc, vc, table, lens, out=torch.full_like(q, float("nan")))
        results[f"paged-{name}-lengths-clamped"] = [
            oracle.rel_l2(out, oracle.paged_attention_ref(q, kc, vc, table, lens)), 1e-5]
    _linear_cases(results)
    _sampling_cases(results)
    _rollout_step_cases(results)
    _fp8_transpose_cases(results)
    _fp8_launch_cases(results)
    # the in-kernel merge ran and left its arrival counters zeroed for the next call: [sum, 0]
    counters = triton_common.cached_arrival_counters()
    results["paged-arrival-counters-reset"] = [
        float(sum(int(c.sum()) for c in counters)) if counters else float("inf"), 0.0]
    print(json.dumps(results))


def _linear_cases(results):
    """linear vs float64 (rel-L2), the split-K case through add_rmsnorm's sum of partials."""
    import torch

    from ws_lab import oracle
    from ws_lab.kernels.step import decode_layer as dl

    for m, n, k, epilogue, fields in LINEAR:
        cfg = dl.LinearConfig(*fields) if fields else None
        x = torch.randn(m, k).half()
        w = (torch.randn(2 * n if epilogue == "glu" else n, k) / k ** 0.5).half()
        bias = torch.randn(n).half() if epilogue == "bias" else None
        ref = x.double() @ w.double().t()
        name = f"linear-{epilogue}-M{m}-N{n}-K{k}"
        if epilogue == "split":
            residual, weight = torch.randn(m, n).half(), torch.randn(n).half()
            total = residual.double() + ref
            ref = weight.double() * total / (total.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
            parts = dl.linear(x, w, split_ok=True, config=cfg)
            results[name + "-partials"] = [0.0 if parts.shape == (fields[2], m, n) else 1.0, 0.0]
            out = dl.add_rmsnorm(parts, weight, 1e-6, residual)
            results[name + "-residual"] = [oracle.rel_l2(residual, total), 2e-3]
        else:
            if bias is not None:
                ref = ref + bias.double()
            if epilogue == "glu":
                ref = torch.nn.functional.silu(ref[:, :n]) * ref[:, n:]
            out = dl.linear(x, w, bias, glu=epilogue == "glu", config=cfg)
        results[name] = [oracle.rel_l2(out, ref), 2e-3]
    # the lm_head's chunk maxima (chunks of 16 in 32-column slices): exactly a pass over Out
    x, w = torch.randn(5, 128).half(), torch.randn(96, 128).half()
    chunk_max = torch.full((5, 6), float("nan"))
    out = dl.linear(x, w, chunk_max=chunk_max, config=dl.LinearConfig(32, 64, 1))
    results["linear-chunk-max"] = [
        float((chunk_max - out.float().view(5, 6, 16).amax(-1)).abs().max()), 0.0]


@triton.jit
def _select_kernel(X, Slot, n, K: tl.constexpr, N_PAD: tl.constexpr, SHIFT: tl.constexpr):
    """The sampler's selection alone: Slot = each of the K largest of X[:n]'s rank among them
    in index order (ties in index order), −1 elsewhere."""
    i = tl.arange(0, N_PAD)
    keys = tl.where(i < n, order_key(tl.load(X + i, mask=i < n), SHIFT), -2147483647 - 1)
    key_min, key_max = tl.reduce((keys, keys), 0, min_max)
    tau, n_above = kth_largest_key(keys, K, key_min, key_max.to(tl.int64) + 1)
    keep, slot = first_k(keys, K, tau, n_above)
    tl.store(Slot + i, tl.where(keep, slot, -1), mask=i < n)


# the FP8 forward's Vᵀ pass (B, S, Hkv, Dv, block_n): S_pad = S rounded up to block_n
FP8_TRANSPOSE = [(2, 5, 3, 64, 4), (1, 130, 2, 128, 256)]
# with P in registers: Vᵀ's keys in coop.operand_key's order (blocks of whole 16s)
FP8_TRANSPOSE_OPERAND = [(1, 230, 2, 128, 224), (2, 37, 1, 64, 32)]


def _expected_vt(v, block_n, operand_order=False):
    """Vᵀ (B, Hkv, Dv, S_pad) of e4m3 ``v`` (B, S, Hkv, Dv) as uint8, by torch: the key columns
    padded with zeros to whole ``block_n`` blocks and, with ``operand_order``, in
    ``coop.operand_key``'s order."""
    import torch

    from ws_lab.kernels.fwd import coop, fp8

    b, s, h, dv = v.shape
    vt = torch.zeros(b, h, dv, fp8.padded_len(s, block_n), dtype=torch.uint8)
    vt[..., :s] = v.view(torch.uint8).permute(0, 2, 3, 1)
    if operand_order:
        vt = vt[..., [coop.operand_key(a) for a in range(vt.shape[-1])]]
    return vt


def _fp8_transpose_cases(results):
    """fp8.transpose_v is V permuted, bit for bit, with zeros in the padded keys (and with
    ``operand_order``, its keys of each 16 in ``coop.operand_key``'s order): [0, 0]."""
    import torch

    from ws_lab.kernels.fwd import fp8

    for b, s, h, dv, block_n in FP8_TRANSPOSE:
        v = torch.randn(b, s, h, dv).to(fp8.FP8)
        vt = fp8.transpose_v(v, block_n)
        exact = vt.dtype == fp8.FP8 and torch.equal(vt.view(torch.uint8), _expected_vt(v, block_n))
        results[f"fp8-transpose-v-B{b}-S{s}-H{h}-D{dv}-bn{block_n}"] = [0.0 if exact else 1.0, 0.0]
    for b, s, h, dv, block_n in FP8_TRANSPOSE_OPERAND:
        v = torch.randn(b, s, h, dv).to(fp8.FP8)
        vt = fp8.transpose_v(v, block_n, operand_order=True)
        exact = torch.equal(vt.view(torch.uint8), _expected_vt(v, block_n, operand_order=True))
        results[f"fp8-transpose-v-operand-order-S{s}-D{dv}-bn{block_n}"] = [
            0.0 if exact else 1.0, 0.0]


def _fp8_launch_cases(results):
    """``fp8.attention_fp8``'s launch path for every design, up to the kernel: the compiled
    kernels replaced by a recorder (nothing here runs TileLang's code), the kernel must get q, k,
    the Vᵀ its design reads (key columns padded to its block, in ``coop.operand_key``'s order for
    P in registers; V itself where the kernel transposes it), the three descales and ``out``.
    Session 41's RS change broke this path for the default design, and only the GPU run caught
    it (notes/fp8.md, "Session 42"): [0, 0]."""
    from unittest import mock

    import torch

    from ws_lab.kernels.fwd import fp8

    b, s, hq, hkv, d = 1, 37, 4, 2, 64
    q = torch.randn(b, s, hq, d).to(fp8.FP8)
    k, v = (torch.randn(b, s, hkv, d).to(fp8.FP8) for _ in range(2))
    descales = {n: torch.rand(b, hkv) + 0.5 for n in ("q_descale", "k_descale", "v_descale")}
    for design in fp8.DESIGNS:
        got = []
        recorder = lambda *args: lambda *launched: got.append((args, launched))  # noqa: E731
        lse = design == "pipelined"
        with mock.patch.object(fp8, "require_device"), \
                mock.patch.object(fp8, "compiled", recorder), \
                mock.patch.object(fp8, "compiled_coop", recorder), \
                mock.patch.object(fp8, "persistent_device_args", lambda device: (132, 50 << 20)):
            out = torch.empty(q.shape, dtype=fp8.OUT_DTYPE)
            fp8.attention_fp8(q, k, v, False, out=out, return_lse=lse, design=design, **descales)
        (built, launched), = got
        if design == "coop-overlap-rs-vt":  # the kernel transposes V itself
            v_right = launched[2] is v
        else:
            want_vt = _expected_vt(v, built[7].block_n, operand_order=design in fp8.RS_DESIGNS)
            v_right = torch.equal(launched[2].view(torch.uint8), want_vt)
        right = (launched[0] is q and launched[1] is k and launched[6] is out and v_right
                 and all(x.equal(descales[n]) for x, n in zip(launched[3:6], descales))
                 and len(launched) == 7 + lse)
        results[f"fp8-launch-{design}"] = [0.0 if right else 1.0, 0.0]


def _rollout_step_cases(results):
    """The loop's one-launch bookkeeping against its definition: forced (a strided view) or
    drawn tokens, EOS once finished, the output column, the positions moved or not."""
    import torch

    from ws_lab.kernels.step import rollout_step

    eos, rows, cols = 3, 5, 7
    for forced_on, move in ((False, True), (True, False)):
        drawn = torch.tensor([3, 1, 4, 1, 5])  # row 0 draws EOS
        forced = torch.randint(0, 6, (cols, rows)).t() if forced_on else None
        finished = torch.tensor([False, False, True, False, True])
        tokens, positions = torch.randint(0, 6, (rows,)), torch.randint(9, 20, (rows,)).int()
        out, step = torch.full((rows, cols), -1), torch.tensor([2])
        token = torch.where(finished, eos, forced[:, 2] if forced_on else drawn)
        expected = dict(out=out.clone(), finished=finished | (token == eos), tokens=token,
                        positions=positions + int(move), step=torch.tensor([3]))
        expected["out"][:, 2] = token
        rollout_step.advance(drawn, forced, finished, tokens, positions, out, step, eos, move)
        got = dict(out=out, finished=finished, tokens=tokens, positions=positions, step=step)
        wrong = sum(not torch.equal(got[k], v) for k, v in expected.items())
        results[f"rollout-step-forced{forced_on}-move{move}"] = [float(wrong), 0.0]


def _sampling_cases(results):
    import torch

    from ws_lab.kernels.step import sampling

    for dtype, n, k, levels in SELECT:
        dt = getattr(torch, dtype)
        x = (torch.randint(0, levels, (n,)).float() if levels else torch.randn(n) * 4).to(dt)
        slot = torch.full((n,), -2, dtype=torch.int32)
        _select_kernel[(1,)](x, slot, n, K=k, N_PAD=triton.next_power_of_2(n),
                             SHIFT=sampling.KEY_SHIFT[dt])
        mask = slot >= 0
        kept, rest = x[mask].float(), x[~mask].float()
        wrong = abs(int(mask.sum()) - k) + int(kept.numel() and rest.numel()
                                                and bool(kept.min() < rest.max()))
        wrong += int(not torch.equal(slot[mask], torch.arange(int(mask.sum()), dtype=torch.int32)))
        wrong += int((slot[~mask] != -1).sum())
        results[f"sampling-select-{dtype}-n{n}-k{k}-levels{levels}"] = [float(wrong), 0.0]

    for rows, vocab, k in SAMPLING:
        logits = torch.randn(rows, vocab)
        ids = sampling.top_k_sample(logits, k, 1.0)
        top = torch.topk(logits, k).indices
        outside = sum(int(i) not in set(t.tolist()) for i, t in zip(ids, top))
        results[f"sampling-outside-top{k}-V{vocab}"] = [float(outside), 0.0]
    logits = torch.randn(3, 8192)  # chunk maxima handed in: the same draw at the same seed
    draws = []
    for given in (None, logits.view(3, -1, sampling.CHUNK).amax(-1)):
        torch.manual_seed(5)
        draws.append(sampling.top_k_sample(logits, 50, 1.0, chunk_max=given))
    results["sampling-given-chunk-max-same-draw"] = [float((draws[0] != draws[1]).sum()), 0.0]
    logits = torch.randn(4, 8192)
    greedy = sampling.top_k_sample(logits, 50, 1e-4)  # Gumbel noise ≪ the logit gaps / T
    results["sampling-cold-draw-is-argmax"] = [
        float((greedy != logits.argmax(-1)).sum()), 0.0]


if __name__ == "__main__":
    main()
