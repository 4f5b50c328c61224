"""Builds ddiloco's one compiled module, `ddiloco._kernels` (the syncer's fused arithmetic, plain C); everything else
is in pyproject.toml. Without a C compiler the install still succeeds and `ddiloco.kernels` runs its eager torch path,
which gives the same bits (docs/runtime.md, "Compiled kernels")."""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, CompileError, ExecError, LinkError, PlatformError

KERNEL_FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-std=gnu11"]
"""-ffp-contract=off: no fused multiply-add, so every product and sum rounds as torch's separate operations round it
(the results must not depend on the instruction set); -fno-math-errno lets rintf be one instruction; gnu11 for GCC's
vector extensions."""
NO_COMPILER = (CCompilerError, CompileError, ExecError, LinkError, PlatformError, OSError)
"""What setuptools raises when there is no working C compiler (or no Python headers)."""


class OptionalBuildExt(build_ext):
    """A module that cannot be compiled is reported and skipped, not fatal: the package works without it."""

    def run(self) -> None:
        try:
            super().run()
        except NO_COMPILER as exc:
            print(f"ddiloco: not building the compiled kernels ({exc}); the eager torch path is used")

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except NO_COMPILER as exc:
            print(f"ddiloco: not building {ext.name} ({exc}); the eager torch path is used")


setup(
    ext_modules=[Extension("ddiloco._kernels", ["src/ddiloco/_kernels.c"], extra_compile_args=KERNEL_FLAGS)],
    cmdclass={"build_ext": OptionalBuildExt},
)
