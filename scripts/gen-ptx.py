#!/usr/bin/env python3
"""Regenerates the PTX of crates/nvlink/kernels/ (copy.cu -> copy.ptx, gemm.cu -> gemm.ptx) with
NVRTC for compute_80.

Needs NVRTC and, for gemm.cu, the CUDA headers it includes (mma.h and cuda_bf16.h from the
runtime package, crt/mma.h from the nvcc one), all from PyPI:

    pip install nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12 nvidia-cuda-nvcc-cu12

(CUDA 12.x emits PTX that every driver from 12.x on, including the CUDA 13 drivers, can load.)
Run from anywhere:

    python3 scripts/gen-ptx.py           # rewrite both .ptx files
    python3 scripts/gen-ptx.py --check   # fail if a .ptx file is not what its .cu compiles to
"""
import ctypes
import glob
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = os.path.join(ROOT, "crates", "nvlink", "kernels")
# Each source and whether it needs the CUDA headers (copy.cu includes nothing).
SOURCES = [("copy.cu", False), ("gemm.cu", True)]
OPTIONS = [b"--gpu-architecture=compute_80", b"--std=c++17", b"-default-device"]


def load_nvrtc():
    candidates = []
    try:
        import nvidia.cuda_nvrtc as package

        for path in package.__path__:
            candidates += sorted(glob.glob(os.path.join(path, "lib", "libnvrtc.so*")))
    except ImportError:
        pass
    candidates += ["libnvrtc.so", "libnvrtc.so.12"]
    for candidate in candidates:
        try:
            return ctypes.CDLL(candidate)
        except OSError:
            continue
    sys.exit("NVRTC not found: pip install nvidia-cuda-nvrtc-cu12")


def include_dirs():
    """The include folders of pip's CUDA packages that hold the headers gemm.cu needs."""
    try:
        import nvidia
    except ImportError:
        nvidia = None
    roots = list(nvidia.__path__) if nvidia is not None else []
    found = []
    for root in roots:
        for header in ("mma.h", "cuda_bf16.h", os.path.join("crt", "mma.h")):
            for path in glob.glob(os.path.join(root, "*", "include", header)):
                folder = path[: -len(header) - 1]
                if folder not in found:
                    found.append(folder)
    return found


def check(nvrtc, status, what, program=None):
    if status == 0:
        return
    nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
    message = nvrtc.nvrtcGetErrorString(status).decode()
    if program is not None:
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(program, log)
        message += "\n" + log.value.decode()
    sys.exit(f"{what} failed: {message}")


def compile_ptx(nvrtc, name, headers):
    """The PTX text of kernels/NAME, with the generated-file header line."""
    with open(os.path.join(KERNELS, name), "rb") as handle:
        source = handle.read()
    options = list(OPTIONS)
    if headers:
        folders = include_dirs()
        if not folders:
            sys.exit(f"{name} needs the CUDA headers: pip install nvidia-cuda-runtime-cu12 "
                     "nvidia-cuda-nvcc-cu12")
        options += [b"-I" + folder.encode() for folder in folders]
    program = ctypes.c_void_p()
    check(nvrtc, nvrtc.nvrtcCreateProgram(ctypes.byref(program), source, name.encode(), 0, None,
                                          None), "nvrtcCreateProgram")
    array = (ctypes.c_char_p * len(options))(*options)
    check(nvrtc, nvrtc.nvrtcCompileProgram(program, len(options), array),
          f"nvrtcCompileProgram of {name}", program)
    size = ctypes.c_size_t()
    check(nvrtc, nvrtc.nvrtcGetPTXSize(program, ctypes.byref(size)), "nvrtcGetPTXSize")
    ptx = ctypes.create_string_buffer(size.value)
    check(nvrtc, nvrtc.nvrtcGetPTX(program, ptx), "nvrtcGetPTX")
    nvrtc.nvrtcDestroyProgram(ctypes.byref(program))
    return f"// Generated from {name} by scripts/gen-ptx.py; do not edit.\n" + ptx.value.decode()


def main():
    nvrtc = load_nvrtc()
    checking = "--check" in sys.argv[1:]
    stale = []
    for name, headers in SOURCES:
        text = compile_ptx(nvrtc, name, headers)
        output = os.path.join(KERNELS, name[: -len(".cu")] + ".ptx")
        if checking:
            try:
                with open(output) as handle:
                    current = handle.read()
            except FileNotFoundError:
                current = None
            if current != text:
                stale.append(output)
            else:
                print(f"{output} matches {name}")
            continue
        with open(output, "w") as handle:
            handle.write(text)
        print(f"wrote {output} ({len(text)} bytes)")
    if stale:
        sys.exit(f"{', '.join(stale)} stale: run python3 scripts/gen-ptx.py and commit it")


if __name__ == "__main__":
    main()
