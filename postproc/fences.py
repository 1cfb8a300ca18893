"""The wgmma fence pass: fence every retired wgmma group's registers right after its wait.

TileLang 0.1.15 ends each wgmma group with ``warpgroup_fence_operand`` *before* the user's
wait (``ws_lab/upstream/wgmma_fence_before_wait.py``), so nothing stops nvcc from moving reads
of the accumulator (and reuse of an RS group's A registers) above the wait. FA3 fences after
``warpgroup_wait<N>`` (``hopper/utils.h``). This pass walks the emitted statements in order:

  * a group is ``warpgroup_arrive()`` … ``wgmma_ss/rs<…>(…)`` … ``warpgroup_commit_batch()``;
    its operands are the fences TileLang emits right around it (accumulator, and for RS the A
    fragment), which carry the right per-thread register counts;
  * ``wait_wgmma<N>()`` / ``warpgroup_wait<N>()`` retires all but the newest N committed groups;
    after it the pass makes sure each retired group's fences follow, inserting the missing ones.

It is idempotent (fences already right after the wait are recognized), reports each insertion,
and refuses code it does not understand (a group without fences, a group never waited for).
"""
import re

from ws_lab.postproc.report import PostprocError, Rewrite

_ARRIVE = re.compile(r"\btl::warpgroup_arrive\(\);")
_MMA = re.compile(r"\btl::wgmma_(ss|rs)<")
_COMMIT = re.compile(r"\btl::warpgroup_commit_batch\(\);")
_WAIT = re.compile(r"\btl::(?:wait_wgmma|warpgroup_wait)<(\d+)>\(\);")
_FENCE = re.compile(r"tl::warpgroup_fence_operand\(reinterpret_cast<(?:const )?\w+\*>\((\w+) \+ 0\), \d+\);")
_OPERAND = re.compile(r"\((\w+) \+ ")  # buffers a wgmma call reads or accumulates into
_KERNEL = re.compile(r"__global__ void (?:__launch_bounds__\([^)]*\) )?(\w+)\(")


def fence_after_wait(code: str) -> tuple[str, list[Rewrite]]:
    lines = code.split("\n")
    out: list[str] = []
    report: list[Rewrite] = []
    pending: list[dict] = []  # committed, not yet retired groups, oldest first
    group = None
    kernel = "?"

    def fence_run(start, step):
        found, j = [], start
        while 0 <= j < len(lines) and _FENCE.search(lines[j]):
            found.append(lines[j].strip())
            j += step
        return found

    i = 0
    while i < len(lines):
        line = lines[i]
        out.append(line)
        if m := _KERNEL.search(line):
            kernel = m.group(1)
        if _ARRIVE.search(line):
            group = {"around": fence_run(i - 1, -1), "operands": set(), "mma": None,
                     "line": i + 1}
        elif group is not None and _MMA.search(line):
            group["mma"] = _MMA.search(line).group(1)
            group["operands"] |= set(_OPERAND.findall(line))
        elif group is not None and _COMMIT.search(line):
            # Fences around a group may belong to its neighbour: keep those naming its operands.
            group["fences"] = list(dict.fromkeys(
                f for f in group["around"] + fence_run(i + 1, 1)
                if _FENCE.search(f).group(1) in group["operands"]))
            if group["mma"] is None or not group["fences"]:
                raise PostprocError(f"{kernel}: wgmma group at line {group['line']} has "
                                    f"{'no wgmma' if group['mma'] is None else 'no operand fences'}; "
                                    "the fence pass does not know this pattern")
            pending.append(group)
            group = None
        elif m := _WAIT.search(line):
            keep = int(m.group(1))
            retired, pending = (pending[:len(pending) - keep], pending[len(pending) - keep:]) \
                if keep else (pending, [])
            wanted = list(dict.fromkeys(f for g in retired for f in g["fences"]))
            present = set(fence_run(i + 1, 1))
            missing = [f for f in wanted if f not in present]
            if missing:
                indent = line[:len(line) - len(line.lstrip())]
                out += [indent + f for f in missing]
                report.append(Rewrite(kernel, len(out) - len(missing), line.strip(),
                                      " ".join([line.strip()] + missing)))
        i += 1
    if group is not None or pending:
        first = (group or pending[0])["line"]
        raise PostprocError(f"{kernel}: the wgmma group at line {first} is never waited for; "
                            "the fence pass does not know where to fence it")
    return "\n".join(out), report
