"""Shared pieces of the GPU correctness grids: case ids and parallel pre-compilation."""
import itertools
import math
from concurrent.futures import ThreadPoolExecutor


def case_id(c):
    return (f"D{c['head_dim']}-{c['head_dim_v']}-{c['dtype']}-{'causal' if c['causal'] else 'full'}"
            f"-S{c['seq_len']}-B{c['batch']}-g{c['heads'] // c['kv_heads']}"
            + (f"-scale{c['scale']}" if c.get("scale") else "")
            + ("" if c.get("pingpong", True) else "-nopp"))


def grid(head_dims, groups, ragged, kv_heads=2, batch=1, seq_len=4096, **extra):
    """fp16/bf16 × causal/full × S {seq_len, ragged} for each (D, Dv), cycling GQA groups."""
    groups, ragged = itertools.cycle(groups), itertools.cycle(ragged)
    cases = []
    for (d, dv), dtype, causal, is_ragged in itertools.product(
            head_dims, ["float16", "bfloat16"], [False, True], [False, True]):
        cases.append(dict(batch=batch, seq_len=next(ragged) if is_ragged else seq_len,
                          heads=kv_heads * next(groups), kv_heads=kv_heads, head_dim=d,
                          head_dim_v=dv, causal=causal, dtype=dtype, scale=None, **extra))
    return cases


def precompile(cases, build, request=None):
    """Compiles the kernels of the selected cases in parallel (nvcc dominates a serial run);
    with ``request`` (the fixture's), cases that ``-k`` deselected are skipped."""
    if request is not None:
        chosen = {id(item.callspec.params["case"]) for item in request.session.items
                  if "case" in getattr(getattr(item, "callspec", None), "params", {})}
        cases = [c for c in cases if id(c) in chosen]
    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(build, cases))


def default_scale(c):
    return c["scale"] or 1.0 / math.sqrt(c["head_dim"])
