"""The rescale pass: skip a thread's O (and partial-sum) rescale when its factors are all 1.

The online softmax multiplies O by exp2(m_old − m_new) each block (``softmax.rescale_o``): 64
FMULs a thread a 128-key block at D 128, 12 % of the persistent kernel's KV loop
(notes/coop_overlap.md "Session 45"). With a rescale threshold (FA4's conditional rescale,
``softmax_probs(rescale_threshold=…)``) the max almost never moves after the first blocks, so
the factors are exactly 1. TileLang 0.1.15 has no per-thread branch around a fragment loop, so
this pass wraps each emitted rescale loop in ``if (factor[0] != 1.0f || …)`` over the thread's
factors. Multiplying by 1 is the identity on every float, so the rewrite is exact whatever the
factors are; it saves issue slots only where a whole warp skips.

A rescale loop: ``#pragma unroll`` then a ``for`` whose body stores only to ``acc_o…`` or
``part_sum…`` and multiplies by one ``row_rescale…`` array declared as ``float name[N];``. The
pass refuses a loop that reads two factor arrays, is idempotent, and reports each guard.
"""
import re

from ws_lab.postproc.report import PostprocError, Rewrite

_FACTORS = re.compile(r"^\s*float (row_rescale(?:_\d+)?)\[(\d+)\];", re.M)
_PRAGMA = "#pragma unroll"
_FOR = re.compile(r"^\s*for \(int \w+ = 0; \w+ < \d+; \+\+\w+\) \{$")
_KERNEL = re.compile(r"__global__ void (?:__launch_bounds__\([^)]*\) )?(\w+)\(")
GUARD = "if ({cond}) {{  // skip_unit_rescale"


def _loop_end(lines, start) -> int:
    """The index of the line closing the brace that ``lines[start]`` opens."""
    depth = 0
    for i in range(start, len(lines)):
        depth += lines[i].count("{") - lines[i].count("}")
        if depth == 0:
            return i
    raise PostprocError(f"unbalanced braces from line {start + 1}")


# the only statements a rescale loop holds: loads of the scaled buffer, the factor broadcast,
# component products, the store back
_STORE_BACK = re.compile(r"^\*\(float[24]\*\)\((?:acc_o|part_sum)(?:_\d+)? \+ .*\) = __\d+;$")
_BODY = [re.compile(p) for p in (
    r"^float[24]? __\d+;$",
    r"^float[24] v__\d+ = \*\(float[24]\*\)\((?:acc_o|part_sum)(?:_\d+)? \+ .*\);$",
    r"^float[24] v__\d+ = make_float[24]\((?:row_rescale(?:_\d+)?\[[^\]]+\](?:, )?)+\);$",
    r"^__\d+\.[xyzw] = \(v__\d+\.[xyzw]\*v__\d+\.[xyzw]\);$",
    r"^\}$")] + [_STORE_BACK]


def _rescale_factors(body: list[str], factors: dict[str, int]) -> str | None:
    """The factor array a loop body multiplies by, when the body is a rescale loop: products
    of the scaled buffer and one factor array, stored back, and nothing else."""
    lines = [line.strip() for line in body if line.strip()]
    if not all(any(p.match(line) for p in _BODY) for line in lines) \
            or not any(_STORE_BACK.match(line) for line in lines):
        return None
    used = {f for f in factors if any(re.search(rf"\b{f}\[", line) for line in body)}
    if len(used) > 1:
        raise PostprocError(f"a rescale loop reads {sorted(used)}: one factor array expected")
    return used.pop() if used else None


def skip_unit_rescale(code: str) -> tuple[str, list[Rewrite]]:
    factors = {m.group(1): int(m.group(2)) for m in _FACTORS.finditer(code)}
    if not factors:
        return code, []
    kernel = (_KERNEL.search(code) or [None, "?"])[1]
    lines, out, report, i = code.split("\n"), [], [], 0
    while i < len(lines):
        line = lines[i]
        guarded = out and out[-1].strip().endswith("// skip_unit_rescale")
        if line.strip() == _PRAGMA and i + 1 < len(lines) and _FOR.match(lines[i + 1]) \
                and not guarded:
            end = _loop_end(lines, i + 1)
            name = _rescale_factors(lines[i + 2:end], factors)
            if name is not None:
                indent = line[:len(line) - len(line.lstrip())]
                cond = " || ".join(f"{name}[{k}] != 1.0f" for k in range(factors[name]))
                out.append(indent + GUARD.format(cond=cond))
                out += lines[i:end + 1]
                out.append(indent + "}")
                report.append(Rewrite(kernel, len(out) - (end - i) - 1, lines[i + 1],
                                      GUARD.format(cond=cond) + " " + lines[i + 1].strip()))
                i = end + 1
                continue
        out.append(line)
        i += 1
    return "\n".join(out), report
