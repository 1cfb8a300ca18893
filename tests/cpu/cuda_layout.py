"""How the CPU tests check a ctypes mirror against the C++ struct it stands for: static_asserts
of its size and field offsets, compiled by nvcc for sm_90 (a moved, resized or retyped field
fails to compile)."""
import ctypes
import subprocess


def size_assert(cpp_struct, mirror) -> str:
    return f'static_assert(sizeof({cpp_struct}) == {ctypes.sizeof(mirror)}, "size");'


def offset_asserts(cpp_struct, mirror, cpp_fields=None) -> list[str]:
    """One static_assert per field of ``mirror``, named ``cpp_fields`` on the C++ side (default:
    the mirror's own names)."""
    names = [n for n, _ in mirror._fields_]
    return [f'static_assert(offsetof({cpp_struct}, {c}) == {getattr(mirror, n).offset}, "{c}");'
            for c, n in zip(cpp_fields or names, names)]


def assert_compiles(tmp_path, include, checks) -> None:
    """``include`` (a quoted path or <header>) and the checks in one translation unit."""
    probe = tmp_path / "layout.cu"
    probe.write_text(f"#include <cstddef>\n#include {include}\nnamespace {{\n"
                     + "\n".join(checks) + "\n}\n")
    proc = subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "-o", str(tmp_path / "x.cubin"),
                           str(probe)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
