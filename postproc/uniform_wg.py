"""The warpgroup-index pass: wgmma descriptors from a warp-uniform warpgroup index.

Where TileLang 0.1.15 splits a GEMM's M over a kernel's consumer warpgroups (``T.gemm`` in an
automatically warp-specialized ``T.Pipelined`` loop), it offsets each wgmma descriptor by a
term in ``(((int)threadIdx.x) >> 7)``. ptxas cannot prove a ``threadIdx`` expression
warp-uniform, so it builds the descriptors in vector registers and moves each into uniform
registers (R2UR) before its wgmma: in the backward's main loop 64 R2UR, 30 VIADD and 28 more
IMAD.MOV a step, 670 instructions a step against TileOPs' 465 (notes/bwd.md "Session 46, later").
CUTLASS reads the index through a shuffle from lane 0 (``canonical_warp_group_idx``), which
ptxas keeps in a uniform register.

The pass declares ``tl_wg_idx`` so at the top of the kernel (every thread active, before any
branch) and puts it in place of ``(((int)threadIdx.x) >> 7)`` in each wgmma call. A warp never
spans two warpgroups, so every thread gets the value it computed before: the rewrite is exact.
It leaves code without such a call alone, is idempotent and reports each rewritten call.
"""
import re

from ws_lab.postproc.report import PostprocError, Rewrite

WG_INDEX = "(((int)threadIdx.x) >> 7)"
NAME = "tl_wg_idx"
DECLARATION = (f"  const int {NAME} = __shfl_sync(0xffffffffu, {WG_INDEX}, 0);"
               "  // uniform_warpgroup")
_DEFINITION = re.compile(
    r"^extern \"C\" __global__ void (?:__launch_bounds__\([^)]*\) )?(\w+)\(.*\) \{$")


def uniform_warpgroup(code: str) -> tuple[str, list[Rewrite]]:
    lines = code.split("\n")
    calls = [i for i, line in enumerate(lines) if "tl::wgmma_" in line and WG_INDEX in line]
    if not calls:
        return code, []
    bodies = [i for i, line in enumerate(lines) if _DEFINITION.match(line)]
    if len(bodies) != 1:
        raise PostprocError(f"uniform_warpgroup: expected one kernel definition, found "
                            f"{len(bodies)}")
    kernel = _DEFINITION.match(lines[bodies[0]]).group(1)
    report = []
    for i in calls:
        report.append(Rewrite(kernel, i + 2, f"wgmma offset by {WG_INDEX}", f"by {NAME}"))
        lines[i] = lines[i].replace(WG_INDEX, NAME)
    lines.insert(bodies[0] + 1, DECLARATION)
    return "\n".join(lines), report
