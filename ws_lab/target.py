"""The one TileLang target of the lab: Hopper with its arch-specific features (wgmma, setmaxnreg)."""

SM90A = {"kind": "cuda", "arch": "sm_90a"}
# SMs of the lab's H100 SXM: persistent kernels lowered without a GPU (ws_lab.emit) size
# their grid for it; on a GPU they ask the device.
H100_SMS = 132
H100_L2_BYTES = 50 * 1024 * 1024


def compile_sm90a(func, pass_configs=None):
    """Compiles a prim_func for sm_90a (a plain 'cuda' target may pick sm_90, which has no wgmma)."""
    import tilelang

    return tilelang.compile(func, target=SM90A, pass_configs=pass_configs)
