"""The decode loop's per-token bookkeeping in one launch: after the draw, write the token (or the
forced one; EOS once a row has finished) into the output column, mark rows that just emitted
EOS, feed the token back as the next input, advance the positions and the step counter.

Counterparts: the "update state" tail of gpt-fast's / SGLang's CUDA-graph decode steps, which
run it as a handful of torch ops; in a graph each of those is a dependent launch of ~2 µs, and
the Qwen2.5-0.5B step at B 64 is ~1 ms (notes/rollout.md, Session 18).

One program holds every row (B ≤ MAX_ROWS): the step counter is read once and advanced once.
On sm_90 it launches with programmatic dependent launch and waits for the draw before its first
load; the top-k sampler lets it launch as soon as the sampler's programs start (kernels/step/
sampling.py), so its launch is off the step's critical path: with the sampler's rework −7.9 µs
a Qwen2.5-0.5B decode step (notes/rollout.md, Session 22).
On a CPU tensor without the interpreter the same update runs as torch ops
(``ws_lab.rollout.loop``).
"""
import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from ws_lab.check import Support, triton_supports
from ws_lab.kernels.decode.triton_common import has_pdl

MAX_ROWS = 4096


@triton.jit
def _advance_kernel(Drawn, Forced, Finished, Tokens, Positions, Out, Step, rows, out_stride,
                    forced_row, forced_col, eos_id, FORCED: tl.constexpr, MOVE: tl.constexpr,
                    BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()  # launched while the sampler runs (it lets dependents launch at its top)
    b = tl.arange(0, BLOCK)
    ok = b < rows
    step = tl.load(Step)
    if FORCED:
        token = tl.load(Forced + b * forced_row + step * forced_col, mask=ok, other=0)
    else:
        token = tl.load(Drawn + b, mask=ok, other=0)
    finished = tl.load(Finished + b, mask=ok, other=0) != 0
    token = tl.where(finished, eos_id, token)
    tl.store(Out + b * out_stride + step, token, mask=ok)
    tl.store(Finished + b, finished | (token == eos_id), mask=ok)
    tl.store(Tokens + b, token, mask=ok)
    if MOVE:
        tl.store(Positions + b, tl.load(Positions + b, mask=ok) + 1, mask=ok)
    tl.store(Step, step + 1)


def supports(tokens: torch.Tensor) -> Support:
    """Whether ``advance`` runs here: Triton on the device, one program for every row."""
    device = triton_supports(tokens.device)
    if device and tokens.shape[0] > MAX_ROWS:
        return Support(f"one program holds at most {MAX_ROWS} rows, got {tokens.shape[0]}")
    return device


def advance(drawn, forced, finished, tokens, positions, out, step, eos_id, move):
    """In place: token = forced[:, step] if ``forced`` is given else ``drawn``; EOS where
    ``finished``; out[:, step] = token; finished |= token == eos_id; tokens = token;
    positions += 1 if ``move``; step += 1. ``out`` (B, N) int64 with unit column stride,
    ``step`` a one-element int64 tensor."""
    rows = tokens.shape[0]
    if out.stride(1) != 1 or step.numel() != 1 or rows > MAX_ROWS:
        raise ValueError(f"advance: out needs unit column stride, step one element and at most "
                         f"{MAX_ROWS} rows; got strides {out.stride()}, step {tuple(step.shape)}, "
                         f"{rows} rows")
    pdl = has_pdl(tokens.device)
    _advance_kernel[(1,)](drawn, drawn if forced is None else forced, finished, tokens,
                          positions, out, step, rows, out.stride(0),
                          0 if forced is None else forced.stride(0),
                          0 if forced is None else forced.stride(1), eos_id,
                          FORCED=forced is not None, MOVE=move,
                          BLOCK=max(triton.next_power_of_2(rows), 32), PDL=pdl, num_warps=1,
                          launch_pdl=pdl)


def static_specs(rows=64):
    """sm_90 specialization of the bookkeeping kernel (drawn tokens, positions moved)."""
    from ws_lab.triton_static import StaticSpec

    types = {n: "i32" for n in _advance_kernel.arg_names}
    types.update(Drawn="*i64", Forced="*i64", Finished="*i1", Tokens="*i64", Positions="*i32",
                 Out="*i64", Step="*i64")
    meta = dict(FORCED=False, MOVE=True, BLOCK=max(triton.next_power_of_2(rows), 32), PDL=True)
    return [StaticSpec("rollout_advance", _advance_kernel, types, meta, dict(num_warps=1))]
