"""Static report for the lab's Triton kernels without a GPU: compile for sm_90 with Triton's own
compiler (no device needed), then the same SASS summary as ``ws_lab.emit`` gives TileLang kernels.
"""
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ws_lab import sass


@dataclass
class StaticSpec:
    """One Triton kernel specialization: argument types by name, constexprs, launch options."""
    name: str
    jit_fn: object  # a triton.JITFunction (an autotuned kernel's ``.fn``)
    types: dict  # arg name -> "*fp16", "*i32", "fp32", "i32"; constexprs are filled in
    constexprs: dict
    options: dict = field(default_factory=dict)  # num_warps, num_stages
    divisible: tuple = ()  # int args a launch would find divisible by 16 (K, strides)


def compile_sm90(spec: StaticSpec):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {n: ("constexpr" if n in spec.constexprs else spec.types[n])
                 for n in spec.jit_fn.arg_names}
    # what a launch specializes on: 16-byte aligned pointers (every torch allocation is) and
    # ints divisible by 16; without it Triton cannot use cp.async and the report would show a
    # loop the GPU never runs
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(spec.jit_fn.arg_names)
             if signature[n].startswith("*") or n in spec.divisible}
    source = ASTSource(spec.jit_fn, signature, spec.constexprs, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=spec.options)


def print_reports(what: str, items, json_path: Path | None = None) -> list[dict]:
    """The no-GPU fallback of a Triton bench: for each (title, spec, record) a status line while
    Triton compiles, then the report under its title; ``json_path`` gets the records, each with
    its report added. ``what`` names the kernels in the opening line."""
    import json

    from ws_lab import cli

    print(f"no CUDA device: printing the static report (sm_90 SASS summary of {what}) instead\n")
    records = []
    for title, spec, record in items:
        with cli.status(f"compiling {spec.name} for {title}"):
            text = report(spec)
        print(f"{title}: {text}\n")
        records.append(dict(record, report=text))
    if json_path:
        json_path.write_text(json.dumps({"device": None, "static_report": records}, indent=1))
    return records


def report(spec: StaticSpec, out_dir: Path | None = None) -> str:
    """The spec's SASS summary (only the fields a Triton kernel has); ``out_dir`` keeps its
    .cubin and .sass."""
    compiled = compile_sm90(spec)
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(out_dir or tmp)
        where.mkdir(parents=True, exist_ok=True)
        stem = spec.name.replace(" ", "_")
        cubin = where / f"{stem}.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        sass_text = sass.dump_sass(cubin)
        (where / f"{stem}.sass").write_text(sass_text)
        summary = sass.parse_resource_usage(cubin, sass.summarize_sass(sass_text))
    summary.dyn_smem = compiled.metadata.shared
    return (f"{spec.name} (Triton, sm_90, {spec.options}, {spec.constexprs})\n"
            f"{summary.format(only_known=True)}")
