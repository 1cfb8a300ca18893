"""The one TileLang target of the lab: Hopper with its arch-specific features (wgmma, setmaxnreg)."""

SM90A = {"kind": "cuda", "arch": "sm_90a"}
# SMs of the lab's H100 SXM: persistent kernels lowered without a GPU (ws_lab.emit) size
# their grid for it; on a GPU they ask the device.
H100_SMS = 132
H100_L2_BYTES = 50 * 1024 * 1024


def require_distinct_buffers(func) -> None:
    """ValueError where two parameters of ``func`` are bound to one buffer: TileLang 0.1.15 does
    that silently to parameters sharing one ``T.Tensor`` annotation object
    (tests/upstream/test_shared_annotation.py)."""
    owner = {}
    for param in func.params:
        buf = func.buffer_map.get(param)
        if buf is None:
            continue
        name = param.name.removesuffix("_handle")
        if buf.data in owner:
            raise ValueError(f"parameters {owner[buf.data]} and {name} of "
                             f"{func.attrs['global_symbol'] if func.attrs else 'the prim_func'} "
                             f"are one buffer ({buf.name}): give each its own T.Tensor")
        owner[buf.data] = name


def compile_sm90a(func, pass_configs=None):
    """Compiles a prim_func for sm_90a (a plain 'cuda' target may pick sm_90, which has no
    wgmma), after ``require_distinct_buffers``."""
    import tilelang

    require_distinct_buffers(func)
    return tilelang.compile(func, target=SM90A, pass_configs=pass_configs)
