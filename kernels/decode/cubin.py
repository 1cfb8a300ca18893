"""The lab's hand-written CUDA kernels (``*.cu`` beside this file): built by ``nvcc`` for the
device's architecture on first use, cached under ``$WS_LAB_CACHE`` (default ``~/.cache/ws_lab``)
keyed by the source's hash, loaded through the CUDA driver API (ctypes) into the device's
primary context, and launched on the current torch stream, so CUDA graphs capture them like any
kernel. ``launch(..., pdl=True)`` launches with programmatic dependent launch (sm_90+): the grid
may start while the one before it drains, and the kernel's ``griddepcontrol.wait`` holds it until
its inputs are written (as the Triton kernels' ``launch_pdl``)."""
import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import torch

from ws_lab.check import SUPPORTED, Support

MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


def arch_flag(capability) -> str:
    major, minor = capability
    return f"-arch=sm_{major}{minor}"


class CudaSource:
    """One ``.cu`` file: its cubin per architecture, and its kernels on each device."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def local_headers(self) -> list[Path]:
        """The ``#include "..."`` files beside the source (cuda_common.cuh)."""
        return [self.path.parent / name for name in
                re.findall(r'^#include "([^"]+)"', self.path.read_text(), re.M)]

    def cached_cubin(self, capability, cache_dir=None) -> Path:
        """Keyed by the source and its local headers: editing either rebuilds."""
        digest = hashlib.sha256(b"".join(
            p.read_bytes() for p in [self.path, *self.local_headers()])).hexdigest()[:16]
        cache = Path(cache_dir or os.environ.get("WS_LAB_CACHE",
                                                 Path.home() / ".cache" / "ws_lab"))
        return cache / self.path.stem / f"{digest}_sm{capability[0]}{capability[1]}.cubin"

    def nvcc(self, capability, cubin: Path, *options, kind="-cubin") -> str:
        """Builds the source into ``cubin`` (PTX with ``kind="-ptx"``); returns nvcc's stderr
        (ptxas's report with ``-Xptxas -v``). RuntimeError if nvcc is missing or fails."""
        nvcc = shutil.which("nvcc")
        if nvcc is None:
            raise RuntimeError(f"{self.path.name} is compiled on first use and needs nvcc on "
                               "PATH (the CUDA toolkit)")
        proc = subprocess.run([nvcc, kind, arch_flag(capability), "-O3", *options, "-o",
                               str(cubin), str(self.path)], capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"nvcc failed on {self.path.name}:\n{proc.stderr[-2000:]}")
        return proc.stderr

    def ptx_entries(self, capability) -> dict[str, str]:
        """No GPU needed (nvcc): each exported kernel's PTX, for what the SASS keeps in uniform
        registers (an instruction's L2 cache policy, say)."""
        with tempfile.TemporaryDirectory() as tmp:
            ptx = Path(tmp) / f"{self.path.stem}.ptx"
            self.nvcc(capability, ptx, kind="-ptx")
            text = ptx.read_text()
        return dict(re.findall(r"\.entry (\w+)\((.*?)(?=\.entry |\Z)", text, re.S))

    def compile(self, capability, cache_dir=None) -> Path:
        """The cubin for a compute capability, built once per source hash and architecture."""
        target = self.cached_cubin(capability, cache_dir)
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_suffix(f".{os.getpid()}.tmp")
            self.nvcc(capability, tmp)
            tmp.replace(target)  # atomic: concurrent first calls each write their own tmp
        return target

    @functools.cache
    def supports(self, capability) -> Support:
        """Whether the kernels can be had for ``capability``: nvcc on PATH, or the cubin already
        cached (asked on every dispatching call)."""
        if shutil.which("nvcc") is not None or self.cached_cubin(capability).exists():
            return SUPPORTED
        return Support(f"{self.path.name} is compiled on first use and needs nvcc on PATH (the "
                       "CUDA toolkit)")

    def launch(self, device, name, grid, threads, smem, args, pdl=False) -> None:
        """Launches kernel ``name`` on ``device``'s current stream (the module built and loaded
        on first use); ``args`` are ctypes values, the kernel's parameters in order."""
        index = torch.cuda.current_device() if device.index is None else device.index
        module = self.module(index)
        with torch.cuda.device(index):
            module.launch(name, grid, threads, smem, torch.cuda.current_stream(index).cuda_stream,
                          args, pdl=pdl)

    @functools.cache
    def module(self, index: int) -> "Module":
        capability = torch.cuda.get_device_capability(index)
        cubin = self.compile(capability).read_bytes()
        with torch.cuda.device(index):
            torch.empty(0, device=f"cuda:{index}")  # creates the primary context, makes it current
            return Module(cubin)

    def _build_listing(self, capability) -> tuple[str, dict[str, list[str]]]:
        """nvcc with ptxas's report, then the SASS: (the report, each exported kernel's opcodes
        in program order, a predicate dropped)."""
        from ws_lab import sass

        with tempfile.TemporaryDirectory() as tmp:
            cubin = Path(tmp) / f"{self.path.stem}.cubin"
            ptxas_report = self.nvcc(capability, cubin, "-Xptxas", "-v")
            listing = sass.dump_sass(cubin)
        kernels = {name: [i.split()[1] if i.startswith("@") else i.split()[0]
                          for i in sass.sass_instructions(body) if i.split()]
                   for name, body in re.findall(r"Function : (\w+)\n(.*?)(?=\n\s*Function : |\Z)",
                                                listing, re.S)}
        return ptxas_report, kernels

    def kernel_opcodes(self, capability) -> dict[str, list[str]]:
        """No GPU needed (nvcc, cuobjdump): each exported kernel's SASS opcodes in program order."""
        return self._build_listing(capability)[1]

    def static_report(self, capability, keys) -> list[dict]:
        """No GPU needed (nvcc, cuobjdump): per exported kernel, ptxas's registers and spill
        bytes and the SASS count of each opcode in ``keys`` (an opcode and its variants)."""
        from ws_lab import sass

        ptxas_report, kernels = self._build_listing(capability)
        usage = {m.group(1): m.group(2) for m in re.finditer(
            r"Compiling entry function '(\w+)'.*?\n(.*?Used \d+ registers[^\n]*)", ptxas_report,
            re.S)}
        reports = []
        for name, ops in kernels.items():
            summary = sass.parse_ptxas(usage.get(name, ""), sass.SassSummary())
            opcodes = Counter(ops)
            counts = {key: sum(n for op, n in opcodes.items()
                               if op == key or op.startswith(key + ".")) for key in keys}
            reports.append(dict(kernel=name, registers=summary.registers,
                                spill_bytes=summary.spill_bytes, **counts))
        return sorted(reports, key=lambda r: r["kernel"])


def print_static_report(title, report, capability=(9, 0)) -> None:
    """Prints ``report(capability)`` (a ``static_report`` function) as a table, or why not:
    the no-GPU fallback of the benches (nvcc and cuobjdump, no device)."""
    try:
        rows = report(capability)
    except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:  # nvcc or cuobjdump
        print(f"{title}: no static report ({exc})")
        return
    print(f"{title}, sm_{capability[0]}{capability[1]}:\n")
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(str(r[k]) for k in keys) + " |")


class CuLaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an id, padding, a 64-byte value union."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class CuLaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint),
                ("block_z", ctypes.c_uint), ("shared_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(CuLaunchAttribute)),
                ("num_attrs", ctypes.c_uint)]


class Module:
    """A cubin loaded into one device's primary context, its functions looked up once."""

    def __init__(self, cubin: bytes):
        self._driver = _driver()
        self._handle = ctypes.c_void_p()
        _check(self._driver.cuModuleLoadData(ctypes.byref(self._handle), cubin),
               "cuModuleLoadData")
        self._functions = {}

    def launch(self, name, grid, threads, smem, stream, args, pdl=False):
        fn, allowed = self._functions.get(name, (None, -1))
        if fn is None:
            fn = ctypes.c_void_p()
            _check(self._driver.cuModuleGetFunction(ctypes.byref(fn), self._handle,
                                                    name.encode()), name)
        if smem > allowed:  # a kernel's shared memory can grow with its arguments
            _check(self._driver.cuFuncSetAttribute(fn, MAX_DYNAMIC_SHARED, smem),
                   f"{name}: {smem} bytes of shared memory")
            self._functions[name] = fn, smem
        pointers = (ctypes.c_void_p * len(args))(
            *[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
        if not pdl:
            _check(self._driver.cuLaunchKernel(fn, *grid, threads, 1, 1, smem,
                                               ctypes.c_void_p(stream), pointers, None), name)
            return
        attr = CuLaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION,
                                value=(1).to_bytes(4, "little"))
        config = CuLaunchConfig(*grid, threads, 1, 1, smem, stream, ctypes.pointer(attr), 1)
        _check(self._driver.cuLaunchKernelEx(ctypes.byref(config), fn, pointers, None), name)


@functools.cache
def _driver():
    return ctypes.CDLL("libcuda.so.1")


def _check(result, what):
    if result:
        raise RuntimeError(f"CUDA driver error {result} in {what}")
