"""The anchor pass: drop the proxy fences TileLang adds for a write-only wait anchor.

coop_overlap's ``anchor_probs`` stores four probabilities a thread to a shared buffer named
``wait_anchor…`` before the PV wait, so that ptxas keeps the row max and those exp2s above the
wait (TileOPs' anchor). TileLang 0.1.15's InjectFenceProxy pass sees a generic-proxy shared
store followed by wgmma (async proxy) and puts a ``fence_proxy_async()`` right after every later
``warpgroup_arrive()`` (``ws_lab/upstream/fence_proxy_for_unrelated_smem.py``). A proxy fence
orders accesses to the same bytes through the two proxies; no async operation and no thread
ever reads the anchor's bytes, so those fences order nothing — and they cost 1.4 % (notes/coop_overlap.md,
Session 6).

The pass removes a ``fence_proxy_async()`` right after ``warpgroup_arrive()`` only when the
kernel declares wait anchors, never reads them, and every other generic store to shared memory
is followed by its own ``fence_proxy_async()`` before the next async operation (the kernel's
explicit fence before its O store) — so the fences it removes guard no other store. It
refuses code that breaks either condition, is idempotent, and reports each removal.
"""
import re

from ws_lab.postproc.report import PostprocError, Rewrite

_SHARED = re.compile(r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ \d+\)\);")
_ANCHOR = re.compile(r"^wait_anchor(?:_\d+)?$")
_ARRIVE = "tl::warpgroup_arrive();"
_PROXY_FENCE = "tl::fence_proxy_async();"
_ASYNC = re.compile(r"\btl::(?:wgmma_|tma_load|tma_store\(|warpgroup_arrive\(\))")
_KERNEL = re.compile(r"__global__ void (?:__launch_bounds__\([^)]*\) )?(\w+)\(")


def _stored(line: str, name: str) -> bool:
    """Whether the statement stores into shared buffer ``name`` (the left of its ``=``)."""
    lhs = re.split(r"(?<![=!<>])=(?!=)", line, maxsplit=1)[0]
    return lhs != line and re.search(rf"\*\){name}\)", lhs) is not None


def drop_anchor_fences(code: str) -> tuple[str, list[Rewrite]]:
    lines = code.split("\n")
    shared = {m.group(1) for m in _SHARED.finditer(code)}
    anchors = {n for n in shared if _ANCHOR.match(n)}
    if not anchors:
        return code, []
    kernel = (_KERNEL.search(code) or [None, "?"])[1]
    uses = re.compile(rf"\b({'|'.join(sorted(anchors))})\b")
    for i, line in enumerate(lines):
        if _SHARED.search(line):
            continue
        for name in uses.findall(line):
            if not _stored(line, name):
                raise PostprocError(f"{kernel}:{i + 1}: wait anchor {name} is read; its "
                                    "fences may order something")
        for name in shared - anchors:
            if _stored(line, name) and not _fenced_before_async(lines, i):
                raise PostprocError(f"{kernel}:{i + 1}: a generic store to {name} reaches an "
                                    "async operation without its own proxy fence; the "
                                    "injected fences may guard it")
    out, report = [], []
    for i, line in enumerate(lines):
        prev = next((p for p in reversed(out) if p.strip()), "")
        if line.strip() == _PROXY_FENCE and prev.strip() == _ARRIVE:
            report.append(Rewrite(kernel, len(out), f"{_ARRIVE} {_PROXY_FENCE}", _ARRIVE))
            continue
        out.append(line)
    return "\n".join(out), report


def _fenced_before_async(lines, i) -> bool:
    for line in lines[i + 1:]:
        if line.strip() == _PROXY_FENCE:
            return True
        if _ASYNC.search(line):
            return False
    return True  # nothing async after it
