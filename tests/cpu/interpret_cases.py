"""Runs the Triton kernels under TRITON_INTERPRET=1 on small cases; prints {case: [err, tol]}
as JSON. Run in a subprocess by test_triton_interpret.py (the variable must be set before
Triton is imported, and must not leak into GPU tests of the same session)."""
import json
import os

# (batch, Hq, Hkv, D, block_size, context lens): groups 1/4/8/32, D 80/96, lens 1/17/513
PAGED = [(3, 4, 1, 64, 16, [1, 17, 513]), (2, 8, 1, 80, 8, [17, 1]), (1, 32, 1, 128, 32, [513]),
         (2, 2, 2, 96, 64, [100, 3])]
MHA = [(s, causal) for s in (40, 97) for causal in (False, True)]
# fused decode (fp16; the interpreter's bf16 dot is wrong, GPU tests cover bf16):
# (batch, Hq, Hkv, D, capacity, positions, block size or None for the static cache)
FUSED = [(3, 14, 2, 64, 160, [0, 1, 159], None), (2, 8, 8, 128, 130, [77, 5], None),
         (2, 32, 8, 128, 96, [95, 40], 16), (4, 14, 2, 64, 64, [63, 0, 31, 17], 8)]


def main():
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    import torch

    from ws_lab.kernels import paged, triton_mha
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
            out = triton_mha._launch(q, k, v, torch.full_like(q, float("nan")), causal, 0.125)
            ref, _ = oracle.attention_ref(q, k, v, causal=causal, softmax_scale=0.125)
            tol = 1e-5 if dtype == torch.float32 else 2e-3
            results[f"mha-{dtype}-S{seq}-{'causal' if causal else 'full'}"] = [oracle.rel_l2(out, ref), tol]
    from ws_lab.decode_cases import check_decode, make_decode
    from ws_lab.kernels import fused_decode

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
    # the in-kernel merge ran and left its arrival counters zeroed for the next call: [sum, 0]
    counters = list(paged._ARRIVALS.values())
    results["paged-arrival-counters-reset"] = [
        float(sum(int(c.sum()) for c in counters)) if counters else float("inf"), 0.0]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
