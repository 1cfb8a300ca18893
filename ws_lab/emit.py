"""Emit / inspect a lab kernel without a GPU.

    python -m ws_lab.emit KERNEL [--shape NAME] [--causal] [--dtype fp16|bf16] [--out DIR] [--postproc]

Lowers the kernel for sm_90a, writes the raw CUDA, the post-processed CUDA and their diff,
compiles a cubin with this machine's nvcc and prints the SASS summary (HGMMA shapes,
WARPGROUP.ARRIVE/DEPBAR order, USETMAXREG, BAR/SYNCS/UTMALDG counts, registers, spills, smem).
"""
from __future__ import annotations

import argparse
import difflib
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ws_lab import cli, registry, sass, shapes
from ws_lab.target import SM90A, require_distinct_buffers


@dataclass
class Emitted:
    kernel: str
    shape: shapes.Shape
    source: str
    postprocessed: str
    rewrites: list
    dyn_smem: int
    threads: int
    nvcc_options: tuple = ()  # the device-compile flags TileLang adds for the kernel's pass configs


def lower_prim_func(func, pass_configs=None):
    """TileLang's lowering artifact of a prim_func for sm_90a (no GPU needed)."""
    import tilelang
    import tvm

    require_distinct_buffers(func)
    target = tvm.target.Target(SM90A)
    with tilelang.transform.PassContext(config=pass_configs or {}), target:
        return tilelang.lower(func, target=target)


def lower(kernel_name: str, shape: shapes.Shape, run_postproc: bool | None = None) -> Emitted:
    """Emitted CUDA of a lab kernel, post-processed as it runs: by the passes the kernel
    compiles under (``Kernel.postproc_passes``); ``run_postproc`` True: every pass of
    ``postproc``, False: none."""
    from ws_lab.postproc import PASSES

    kernel = registry.get(kernel_name)
    passes = {None: kernel.postproc_passes, True: PASSES, False: ()}[run_postproc]
    return lower_variant(kernel_name, shape, kernel.prim_func(shape), kernel.pass_configs, passes)


def lower_variant(name: str, shape: shapes.Shape, func, pass_configs, passes=()) -> Emitted:
    """Emitted CUDA of any prim_func (e.g. an ablation of a lab kernel), through ``passes``."""
    from ws_lab.postproc import postprocess

    art = lower_prim_func(func, pass_configs)
    attrs = next(f.attrs for _, f in art.device_mod.functions.items() if "thread_extent" in f.attrs)
    extent = attrs["thread_extent"]
    threads = int(extent["threadIdx.x"]) * int(extent["threadIdx.y"]) * int(extent["threadIdx.z"])
    smem = int(attrs["dyn_shared_memory_buf"]) if "dyn_shared_memory_buf" in attrs else 0
    post, rewrites = postprocess(art.kernel_source, passes)
    return Emitted(name, shape, art.kernel_source, post, rewrites, smem, threads,
                   nvcc_options_for(pass_configs))


def nvcc_options_for(pass_configs) -> tuple:
    """The flags TileLang's CUDA backend passes nvcc for these pass configs
    (``tilelang/cuda/backend.py``): the cubin inspected here must be the one that runs."""
    import tilelang

    return (("--use_fast_math",)
            if (pass_configs or {}).get(tilelang.PassConfigKey.TL_ENABLE_FAST_MATH) else ())


def nvcc_cubin(source: str, cubin: Path, options: tuple = ()) -> str:
    """Compiles CUDA source to an sm_90a cubin as TileLang would; returns ptxas's -v report."""
    from tilelang import env

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise FileNotFoundError("nvcc is not on PATH (needed to compile the emitted CUDA)")
    cu = cubin.with_suffix(".cu")
    cu.write_text(source)
    cmd = [nvcc, "-std=c++20", "-O3", "-w", "-lineinfo", "--cubin", "-gencode",
           "arch=compute_90a,code=sm_90a", "-Xptxas", "-v", f"-I{env.TILELANG_TEMPLATE_PATH}",
           f"-I{env.CUTLASS_INCLUDE_DIR}", *options, "-o", str(cubin), str(cu)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"nvcc failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return done.stderr


def inspect(emitted: Emitted, out_dir: Path) -> sass.SassSummary:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{emitted.kernel}_{emitted.shape.name}_{'causal' if emitted.shape.causal else 'full'}"
    (out_dir / f"{stem}.cu").write_text(emitted.source)
    (out_dir / f"{stem}.post.cu").write_text(emitted.postprocessed)
    diff = difflib.unified_diff(emitted.source.splitlines(True), emitted.postprocessed.splitlines(True),
                                f"{stem}.cu", f"{stem}.post.cu")
    (out_dir / f"{stem}.diff").write_text("".join(diff))
    cubin = out_dir / f"{stem}.cubin"
    ptxas = nvcc_cubin(emitted.postprocessed, cubin, emitted.nvcc_options)
    sass_text = sass.dump_sass(cubin)
    (out_dir / f"{stem}.sass").write_text(sass_text)
    summary = sass.parse_ptxas(ptxas, sass.summarize_sass(sass_text))
    summary.dyn_smem = emitted.dyn_smem
    return summary


def report(kernel_name: str, shape: shapes.Shape, out_dir: Path | None = None,
           run_postproc: bool | None = None) -> str:
    """Lowers, compiles and summarizes one kernel on one shape; returns the printable report.
    A Triton kernel gets its sm_90 static report (Triton's own compiler, then the same SASS
    summary); it has no TileLang source and no post-processor."""
    kernel = registry.get(kernel_name)
    if kernel.static_specs:
        from ws_lab import triton_static

        with cli.status(f"compiling {kernel_name} on {shape.name} for sm_90 (Triton)"):
            return "\n\n".join(f"{kernel_name} on {shape.name}: " + triton_static.report(spec, out_dir)
                               for spec in kernel.static_specs(shape))
    with cli.status(f"lowering {kernel_name} on {shape.name} for sm_90a"):
        emitted = lower(kernel_name, shape, run_postproc)
    with tempfile.TemporaryDirectory() as tmp, cli.status(f"compiling {kernel_name} with nvcc"):
        summary = inspect(emitted, Path(out_dir or tmp))
    # a family with fixed input types (the FP8 forward) names them, not the shape's dtype
    dtype = getattr(kernel.module_object(), "INPUT_DTYPE", shape.dtype)
    head = (f"{kernel_name} on {shape.name} ({'causal' if shape.causal else 'non-causal'}, "
            f"{dtype}): {emitted.threads} threads, {len(emitted.source.splitlines())} lines "
            f"of CUDA, {len(emitted.rewrites)} post-processor rewrites")
    rewrites = [f"  rewrite {r}" for r in emitted.rewrites]
    diff = "".join(difflib.unified_diff(emitted.source.splitlines(True),
                                        emitted.postprocessed.splitlines(True), "emitted",
                                        "post-processed", n=1))
    return "\n".join([head, *rewrites] + ([diff.rstrip()] if diff else []) + [summary.format()])


DEFAULT_SHAPE = "llama8b-4k"  # where the kernel supports it; else its first registered shape


def _parser():
    ap = cli.ArgumentParser(prog="python -m ws_lab.emit", description=__doc__.splitlines()[0])
    ap.add_argument("kernel", choices=sorted(registry.KERNELS), help="a registered kernel")
    ap.add_argument("--shape", choices=sorted(shapes.SHAPES),
                    help=f"a registered shape (default: {DEFAULT_SHAPE} where the kernel "
                         "supports it, else the first registered shape it supports)")
    ap.add_argument("--causal", action=argparse.BooleanOptionalAction, default=None,
                    help="override the shape's default mask")
    ap.add_argument("--dtype", choices=sorted(shapes.DTYPES), default="float16",
                    help="element type of q, k, v (fp16 = float16, bf16 = bfloat16)")
    ap.add_argument("--out", type=Path, default=None,
                    help="a directory to keep .cu/.post.cu/.diff/.cubin/.sass in (created)")
    ap.add_argument("--postproc", action=argparse.BooleanOptionalAction, default=None,
                    help="run every CUDA post-processor pass (--no-postproc: none; default: the "
                         "passes the kernel compiles under); each rewrite names its pass")
    return ap


def shape_for(kernel: str, shape_name: str | None, dtype: str = "float16",
              causal: bool | None = None) -> shapes.Shape:
    """The case ``emit`` lowers: the named shape, or the kernel's default (``DEFAULT_SHAPE``
    where it runs it, else its first registered shape); refuses a shape the kernel does not
    run with a ``UsageError`` naming what it runs."""
    supported = registry.supported_shapes(kernel)
    if shape_name is None:
        if not supported:
            raise cli.UsageError(f"{kernel} supports no registered shape")
        shape_name = next((s.name for s in supported if s.name == DEFAULT_SHAPE), supported[0].name)
    shape = shapes.get(shape_name).with_dtype(shapes.DTYPES[dtype])
    if causal is not None:
        shape = shape.with_mask(causal)
    if not registry.get(kernel).supports(shape):
        raise cli.unsupported(kernel, shape, supported)
    return shape


def _main(argv):
    args = _parser().parse_args(argv)
    shape = shape_for(args.kernel, args.shape, args.dtype, args.causal)
    if args.postproc is not None and registry.get(args.kernel).static_specs:
        raise cli.UsageError(f"--postproc rewrites TileLang's CUDA; {args.kernel} is a Triton kernel")
    cli.out_dir(args.out)
    if not registry.get(args.kernel).static_specs:  # Triton reports need no nvcc
        cli.require_nvcc("emit")
    print(report(args.kernel, shape, args.out, args.postproc))
    if args.out:
        print(f"files in {args.out}")


def main(argv=None):
    cli.main(_main, argv, "python -m ws_lab.emit")


if __name__ == "__main__":
    main()
