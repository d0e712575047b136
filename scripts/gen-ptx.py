#!/usr/bin/env python3
"""Regenerates crates/nvlink/kernels/copy.ptx from copy.cu with NVRTC for compute_80.

Needs only NVRTC: `pip install nvidia-cuda-nvrtc-cu12` (CUDA 12.x emits PTX that every driver
from 12.x on, including the CUDA 13 drivers, can load). Run from anywhere:

    python3 scripts/gen-ptx.py           # rewrite copy.ptx
    python3 scripts/gen-ptx.py --check   # fail if copy.ptx is not what copy.cu compiles to
"""
import ctypes
import glob
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(ROOT, "crates", "nvlink", "kernels", "copy.cu")
OUTPUT = os.path.join(ROOT, "crates", "nvlink", "kernels", "copy.ptx")
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


def main():
    nvrtc = load_nvrtc()
    with open(SOURCE, "rb") as handle:
        source = handle.read()
    program = ctypes.c_void_p()
    check(nvrtc, nvrtc.nvrtcCreateProgram(ctypes.byref(program), source, b"copy.cu", 0, None, None),
          "nvrtcCreateProgram")
    options = (ctypes.c_char_p * len(OPTIONS))(*OPTIONS)
    check(nvrtc, nvrtc.nvrtcCompileProgram(program, len(OPTIONS), options), "nvrtcCompileProgram",
          program)
    size = ctypes.c_size_t()
    check(nvrtc, nvrtc.nvrtcGetPTXSize(program, ctypes.byref(size)), "nvrtcGetPTXSize")
    ptx = ctypes.create_string_buffer(size.value)
    check(nvrtc, nvrtc.nvrtcGetPTX(program, ptx), "nvrtcGetPTX")
    nvrtc.nvrtcDestroyProgram(ctypes.byref(program))
    header = "// Generated from copy.cu by scripts/gen-ptx.py; do not edit.\n"
    text = header + ptx.value.decode()
    if "--check" in sys.argv[1:]:
        with open(OUTPUT) as handle:
            if handle.read() != text:
                sys.exit(f"{OUTPUT} is stale: run python3 scripts/gen-ptx.py and commit it")
        print(f"{OUTPUT} matches copy.cu")
        return
    with open(OUTPUT, "w") as handle:
        handle.write(text)
    print(f"wrote {OUTPUT} ({size.value} bytes)")


if __name__ == "__main__":
    main()
