"""The C/C++ compiler of the Bazel check's stand-in CUDA toolchain (tests/test_bazel_build.py).

TensorFlow's `--config=cuda` toolchain has a compiler driver that passes every command to gcc except
the ones carrying `-x cuda` (what TF's `cuda_library` / `tf_gpu_kernel_library` add to their
copts), which it rewrites for nvcc. This does the same, so cc/BUILD's GPU targets compile through
their copts as they would in a TensorFlow Serving build. Set by the check: HOST_CC (gcc), NVCC and
CUDA_ARCH_FLAGS (setup.py's -gencode flags, space-separated).
"""

from __future__ import annotations

import itertools
import os
import sys

# gcc options nvcc takes as they are; a value-taking one consumes the next argument.
NVCC_OPTIONS = {"-c", "-MD"}
NVCC_OPTIONS_WITH_VALUE = {"-o", "-MF", "-isystem"}


def nvcc_command(args: list[str]) -> list[str]:
    """The nvcc command for a gcc-style compile command that compiles CUDA (`-x cuda`)."""
    command = [os.environ["NVCC"], "-std=c++17", "--expt-relaxed-constexpr",
               *os.environ["CUDA_ARCH_FLAGS"].split()]  # fmt: skip
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "-x":
            command += ["-x", "cu" if args[i + 1] == "cuda" else args[i + 1]]
            i += 1
        elif arg == "-iquote":  # nvcc has no -iquote: a plain include directory does the same here
            command += ["-I", args[i + 1]]
            i += 1
        elif arg in NVCC_OPTIONS_WITH_VALUE:
            command += [arg, args[i + 1]]
            i += 1
        elif arg in NVCC_OPTIONS or arg.startswith(("-D", "-I", "-O")):
            command.append(arg)
        elif arg.startswith("-std="):
            pass  # Bazel's default dialect; nvcc gets C++17 above
        elif arg.startswith("-"):
            command += ["-Xcompiler", arg]
        else:
            command.append(arg)  # the source file
        i += 1
    return command


def main(args: list[str]) -> None:
    cuda = any(a == "-x" and b == "cuda" for a, b in itertools.pairwise(args))
    command = nvcc_command(args) if cuda else [os.environ.get("HOST_CC", "gcc"), *args]
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
