"""Reads a cubin's SASS (cuobjdump) and ptxas's resource report into one summary."""
from __future__ import annotations

import re
import subprocess
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path


def tool(name: str) -> str:
    """cuobjdump/nvdisasm: the CUDA toolkit's if on PATH, else the copy in Triton's wheel."""
    import shutil

    found = shutil.which(name)
    if found:
        return found
    import triton

    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if bundled.exists():
        return str(bundled)
    raise FileNotFoundError(f"{name} is neither on PATH nor in Triton's wheel")


# LDGSTS: cp.async (a pipelined Triton loop); STL: local stores (spills, in a Triton cubin);
# UBLKPF: bulk L2 prefetches; LDSM / STSM: shared-memory matrix loads and stores (FP8's
# in-kernel Vᵀ, kernels/fwd/v_transpose.py)
COUNTED = ("BAR", "SYNCS", "UTMALDG", "UTMASTG", "FCHK", "LDGSTS", "STL", "UBLKPF", "LDSM",
           "STSM")


@dataclass
class SassSummary:
    # shape (e.g. 64x128x16.F32.BF16[.RS]; FP8's QGMMA: 64x128x32.F32.E4M3.E4M3) -> count
    hgmma: Counter = field(default_factory=Counter)
    warpgroup_sync: list = field(default_factory=list)  # ARRIVE / DEPBAR.LE gsb0 0xN, program order
    setmaxnreg: list = field(default_factory=list)  # e.g. ['TRY_ALLOC 240', 'DEALLOC 24']
    # BAR, SYNCS, UTMALDG, UTMASTG, and FCHK (the range check of an IEEE fp32 division, whose
    # slow path is a CALL: one per element when O is divided by the row sums)
    counts: Counter = field(default_factory=Counter)
    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    stack_frame: int | None = None
    dyn_smem: int | None = None
    ptxas_remarks: list = field(default_factory=list)  # e.g. C7515 (wgmma serialized), C7508
    # For each WARPGROUP.DEPBAR: (groups it leaves in flight, kinds of HGMMA issued since the
    # previous DEPBAR, e.g. ('SS', 'RS') when a QK and a PV group were both in flight).
    depbar_windows: list = field(default_factory=list)
    # For each DEPBAR.LE 1 followed by a DEPBAR.LE 0 (IntraWGOverlap: S_n ready, then PV_{n-1}):
    # the MUFU.EX2 between them, i.e. how much of the softmax runs while PV is in flight.
    ex2_between_waits: list = field(default_factory=list)
    issue_turns: list = field(default_factory=list)  # IssueTurn per pingpong turn (issue_turns)
    gemm_loops: list = field(default_factory=list)  # GemmLoop per innermost wgmma loop

    @property
    def spill_bytes(self) -> int:
        return (self.spill_stores or 0) + (self.spill_loads or 0)

    def format(self, only_known: bool = False) -> str:
        """The printable summary. ``only_known`` leaves out what the source of the summary did
        not report (a Triton cubin has no ptxas spill report) and empty sequences (no
        setmaxnreg, no WARPGROUP syncs): a field that does not apply is not printed."""
        lines = ["SASS summary"]
        lines.append("  HGMMA: " + (", ".join(f"{s} x{n}" for s, n in sorted(self.hgmma.items()))
                                    or "none"))
        if self.setmaxnreg or not only_known:
            lines.append("  USETMAXREG: " + (", ".join(self.setmaxnreg) or "none"))
        lines.append("  " + ", ".join(f"{k} {self.counts[k]}" for k in
                                      COUNTED))
        resources = [("registers", self.registers, ""), ("spill stores", self.spill_stores, " B"),
                     ("spill loads", self.spill_loads, " B"), ("stack", self.stack_frame, " B"),
                     ("dynamic smem", self.dyn_smem, " B")]
        lines.append("  " + ", ".join(f"{name} {value}{unit}" for name, value, unit in resources
                                      if value is not None or not only_known))
        if self.warpgroup_sync or not only_known:
            lines.append("  WARPGROUP order: " + " ".join(_run_length(self.warpgroup_sync)))
        if self.ex2_between_waits:
            lines.append("  MUFU.EX2 between DEPBAR.LE 1 and DEPBAR.LE 0: "
                         + ", ".join(map(str, self.ex2_between_waits)))
        if self.issue_turns:
            lines.append("  pingpong issue turns ((polled) = an mbarrier poll before the turn): "
                         + " ".join(_run_length([("[(polled) " if t.polled_before else "[")
                                                  + " ".join(t.events) + "]"
                                                  for t in self.issue_turns])))
        lines += [f"  {loop}" for loop in self.gemm_loops]
        lines += [f"  ptxas: {remark}" for remark in self.ptxas_remarks]
        return "\n".join(lines)


@dataclass(frozen=True)
class GemmLoop:
    """An innermost loop holding wgmma (a mainloop's steady state): the span from a backward
    branch's target to the branch, and its instructions by opcode (before the first dot, so
    ``FFMA.FTZ`` counts as FFMA; the GEMMs as HGMMA / QGMMA)."""
    start: int
    end: int
    opcodes: Counter
    # shared-memory loads issued ahead of the loop's first wgmma: a load issued behind wgmma
    # waits for the tensor core to take them (notes/bwd.md "Session 67, later")
    lds_before_gemm: int = 0

    @property
    def instructions(self) -> int:
        return sum(self.opcodes.values())

    def __str__(self):
        gemms = sum(self.opcodes[k] for k in ("HGMMA", "QGMMA"))
        top = ", ".join(f"{k} {n}" for k, n in self.opcodes.most_common(8))
        return (f"GEMM loop {self.start:#x}-{self.end:#x}: {self.instructions} instructions, "
                f"{gemms} wgmma; {top}")


_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")
# a loop's back edge is predicated; an unpredicated backward BRA is the return from an
# out-of-line mbarrier retry block at the function's tail, not a loop of its own
_BACK_EDGE = re.compile(r"^@!?U?P\w+\s+BRA\b[^;]*?(0x[0-9a-f]+)")


def _opcode(ins: str) -> str:
    """The instruction's opcode with its modifiers (``MUFU.EX2``), past any predicate."""
    words = ins.split()
    return words[1] if words and words[0].startswith("@") and len(words) > 1 else (words or [""])[0]


def _addressed_instructions(sass: str) -> list[tuple[int, str]]:
    """(address, instruction text) of each SASS line, in program order."""
    return [(int(m.group(1), 16), m.group(2).strip()) for m in _LINE.finditer(sass)]


def _lds_before_gemm(lines, start: int) -> int:
    """The LDS from ``start`` up to the first wgmma."""
    count = 0
    for _, ins in (line for line in lines if line[0] >= start):
        op = _opcode(ins).split(".")[0]
        if op in ("HGMMA", "QGMMA"):
            return count
        count += op == "LDS"
    return count


def gemm_loops(sass: str) -> list[GemmLoop]:
    """The innermost loops of one function's SASS that issue wgmma, in address order: each
    predicated backward branch closes a loop; one that holds a GEMM and no smaller such loop
    is kept."""
    lines = _addressed_instructions(sass)
    spans = []
    for address, ins in lines:
        m = _BACK_EDGE.search(ins)
        target = int(m.group(1), 16) if m else address
        if target < address:
            body = Counter(_opcode(i).split(".")[0] for a, i in lines if target <= a <= address)
            if body["HGMMA"] or body["QGMMA"]:
                spans.append(GemmLoop(target, address, body, _lds_before_gemm(lines, target)))
    inner = [s for s in spans if not any(o is not s and s.start <= o.start and o.end <= s.end
                                         for o in spans)]
    return sorted(inner, key=lambda loop: loop.start)


def _run_length(seq):
    out, prev, n = [], None, 0
    for item in seq + [None]:
        if item == prev:
            n += 1
            continue
        if prev is not None:
            out.append(prev if n == 1 else f"{prev}×{n}")
        prev, n = item, 1
    return out


_HGMMA = re.compile(r"\b[HQ]GMMA\.(\S+?)\s+(R\d+|RZ),\s*(\S+?),")  # QGMMA: the FP8 form
_WG = re.compile(r"\bWARPGROUP\.(ARRIVE|DEPBAR\.LE\s+gsb0,\s*0x[0-9a-f]+)")
_MAXREG = re.compile(r"\bUSETMAXREG\.(TRY_ALLOC|DEALLOC)\S*\s+(?:UP\d+,\s*)?(0x[0-9a-f]+|\d+)")


def overlaps_gemm_and_softmax(summary: SassSummary) -> bool:
    """True when some wait leaves a group in flight after a window that issued both an SS (QK)
    and an RS (PV) group: the next QK was issued before the previous PV was retired."""
    return any(left >= 1 and {"SS", "RS"} <= set(kinds) for left, kinds in summary.depbar_windows)


@dataclass(frozen=True)
class IssueTurn:
    """One pingpong issue turn: from a warp-scheduler ``BAR.SYNC`` to its ``BAR.ARV``."""
    polled_before: bool  # an mbarrier poll (SYNCS try-wait) since the previous turn ended
    # in program order, runs collapsed: "SS" / "RS" HGMMA, "POLL" (mbarrier try-wait),
    # "MATH" (FMUL / FFMA / MUFU)
    events: tuple


_TURN_SYNC = re.compile(r"^BAR\.SYNC\S*\s+0x([0-9a-f]+),\s*0x100$")
_TURN_ARRIVE = re.compile(r"^BAR\.ARV\s+0x([0-9a-f]+),\s*0x100$")


def issue_turns(sass: str, barrier_ids=(1, 2)) -> list[IssueTurn]:
    """The issue turns of a pingpong kernel (named barriers ``barrier_ids`` over 256 threads,
    kernels/fwd/coop.py ``NamedBarrier.WARP_SCHEDULER_WG1/2``), in program order."""
    turns, events, polled = [], None, False
    for ins in sass_instructions(sass):
        opcode = _opcode(ins)
        if (m := _TURN_SYNC.match(ins)) and int(m.group(1), 16) in barrier_ids:
            events, polled_before = [], polled
        elif (m := _TURN_ARRIVE.match(ins)) and events is not None:
            runs = [e for i, e in enumerate(events) if i == 0 or events[i - 1] != e]
            turns.append(IssueTurn(polled_before, tuple(runs)))
            events, polled = None, False
        elif opcode.startswith("SYNCS.PHASECHK"):
            if events is None:
                polled = True
            else:
                events.append("POLL")
        elif events is not None and (m := _HGMMA.search(ins)):
            events.append("SS" if m.group(3).startswith("gdesc") else "RS")
        elif events is not None and opcode.split(".")[0] in ("FMUL", "FFMA", "MUFU"):
            events.append("MATH")
    return turns


def _wg_name(text: str) -> str:
    """'ARRIVE' or 'DEPBAR.LE N' (N: wgmma groups left in flight)."""
    if text == "ARRIVE":
        return text
    return f"DEPBAR.LE {int(text.rsplit(',', 1)[1], 0)}"


def sass_instructions(sass: str) -> list[str]:
    """The instruction text of each SASS line, in program order."""
    return [ins for _, ins in _addressed_instructions(sass)]


def summarize_sass(sass: str, summary: SassSummary | None = None) -> SassSummary:
    s = summary or SassSummary()
    window: list[str] = []
    ex2_since_wait1 = None  # counting MUFU.EX2 after a DEPBAR.LE 1, until the next DEPBAR
    for ins in sass_instructions(sass):
        if m := _HGMMA.search(ins):
            a_in_regs = not m.group(3).startswith("gdesc")
            s.hgmma[m.group(1) + (".RS" if a_in_regs else "")] += 1
            window.append("RS" if a_in_regs else "SS")
        elif m := _WG.search(ins):
            s.warpgroup_sync.append(_wg_name(m.group(1)))
            if s.warpgroup_sync[-1] != "ARRIVE":
                left = int(s.warpgroup_sync[-1].split()[-1])
                s.depbar_windows.append((left, tuple(dict.fromkeys(window))))
                window = []
                if left == 0 and ex2_since_wait1 is not None:
                    s.ex2_between_waits.append(ex2_since_wait1)
                ex2_since_wait1 = 0 if left == 1 else None
        elif m := _MAXREG.search(ins):
            s.setmaxnreg.append(f"{m.group(1)} {int(m.group(2), 0)}")
        opcode = _opcode(ins)
        if opcode == "MUFU.EX2" and ex2_since_wait1 is not None:
            ex2_since_wait1 += 1
        for key in COUNTED:
            if opcode == key or opcode.startswith(key + "."):
                s.counts[key] += 1
    s.issue_turns = issue_turns(sass)
    s.gemm_loops = gemm_loops(sass)
    return s


def parse_ptxas(report: str, summary: SassSummary) -> SassSummary:
    """Registers, stack, spills, and the performance remarks (C7515: ptxas serialized the
    wgmma pipeline; C7508: setmaxnreg ignored) from ``ptxas -v``."""
    summary.ptxas_remarks = [m.group(0).strip() for m in
                             re.finditer(r"\((C75\d\d)\)[^\n]*", report)]
    if m := re.search(r"Used (\d+) registers", report):
        summary.registers = int(m.group(1))
    if m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                      report):
        summary.stack_frame, summary.spill_stores, summary.spill_loads = map(int, m.groups())
    return summary


def parse_resource_usage(cubin: Path, summary: SassSummary) -> SassSummary:
    """Registers and stack bytes from ``cuobjdump --dump-resource-usage`` (for cubins built
    without a ptxas report, e.g. Triton's)."""
    text = subprocess.run([tool("cuobjdump"), "--dump-resource-usage", str(cubin)], check=True,
                          capture_output=True, text=True).stdout
    if m := re.search(r"REG:(\d+) STACK:(\d+)", text):
        summary.registers, summary.stack_frame = int(m.group(1)), int(m.group(2))
    return summary


def dump_sass(cubin: Path) -> str:
    return subprocess.run([tool("cuobjdump"), "--dump-sass", str(cubin)], check=True,
                          capture_output=True, text=True).stdout
