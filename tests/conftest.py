import pytest


def _cuda_reason():
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device (GPU tests run on the H100: see README)"
    major, _ = torch.cuda.get_device_capability()
    if major != 9:
        return f"needs Hopper (sm_90a), found compute capability {major}.x"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _cuda_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
