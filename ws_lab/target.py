"""The one TileLang target of the lab: Hopper with its arch-specific features (wgmma, setmaxnreg)."""

SM90A = {"kind": "cuda", "arch": "sm_90a"}


def compile_sm90a(func, pass_configs=None):
    """Compiles a prim_func for sm_90a (a plain 'cuda' target may pick sm_90, which has no wgmma)."""
    import tilelang

    return tilelang.compile(func, target=SM90A, pass_configs=pass_configs)
