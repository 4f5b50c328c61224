"""Builds ddiloco's one compiled module, `ddiloco._kernels` (the syncer's fused arithmetic, plain C); everything else
is in pyproject.toml. Without a C compiler the install still succeeds and `ddiloco.kernels` runs its eager torch path,
which gives the same bits (docs/runtime.md, "Compiled kernels")."""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

KERNEL_FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-std=c11"]
"""-ffp-contract=off: no fused multiply-add, so every product and sum rounds as torch's separate ops round it (the
kernels' results must not depend on the instruction set); -fno-math-errno lets rintf become one instruction."""


class OptionalBuildExt(build_ext):
    """A failed compile is reported and skipped, not fatal: the package works without the module."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 -- setuptools raises several unrelated types for "no compiler"
            print(f"ddiloco: not building the compiled kernels ({exc}); the eager torch path is used")

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            print(f"ddiloco: not building {ext.name} ({exc}); the eager torch path is used")


setup(
    ext_modules=[Extension("ddiloco._kernels", ["src/ddiloco/_kernels.c"], extra_compile_args=KERNEL_FLAGS)],
    cmdclass={"build_ext": OptionalBuildExt},
)
