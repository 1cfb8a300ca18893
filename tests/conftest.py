"""Two GPU markers: ``gpu`` needs a CUDA GPU of compute capability 8.0 or newer (the Triton
kernels: the seeds' L4 runs them), ``hopper`` needs sm_90 (the TileLang kernels: wgmma, TMA,
setmaxnreg). Without one the marked tests skip with the reason."""
import pytest

# Importing ws_lab moves the checkout's root to the end of sys.path, before any test module
# imports transformers (ws_lab/__init__.py says why); pytest's append import mode
# (pyproject.toml) keeps it there.
import ws_lab  # noqa: F401


def _capability():
    try:
        import torch
    except ImportError:
        return None, "torch is not installed"
    if not torch.cuda.is_available():
        return None, "no CUDA device (GPU tests run on the H100: see README)"
    return torch.cuda.get_device_capability(), None


def _reasons():
    capability, reason = _capability()
    if capability is None:
        return {"gpu": reason, "hopper": reason}
    major, minor = capability
    return {"gpu": None if major >= 8 else f"needs compute capability ≥ 8.0, found {major}.{minor}",
            "hopper": None if major == 9 else f"needs Hopper (sm_90a), found {major}.{minor}"}


def pytest_collection_modifyitems(config, items):
    reasons = _reasons()
    for item in items:
        for marker, reason in reasons.items():
            if reason and marker in item.keywords:
                item.add_marker(pytest.mark.skip(reason=reason))
