"""Build hooks: ships `sleuth_autoattach.pth` at the top of site-packages, and builds the
tracer's optional one-pass statistics kernel.

The .pth line imports `sleuth._autoattach`, which does nothing unless a SLEUTH_* variable asks
for a tool; that is what lets `SLEUTH_DUMP_CONFIG=dump.json python train.py` trace a script
nobody edited. `tracer._fused` (tracer/_fused.c, plain C with GCC/Clang vector extensions) is
`optional`: where it cannot be compiled the install goes on and the tracer uses its numpy path.
Everything else about the build lives in pyproject.toml.
"""
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

_PTH = "sleuth_autoattach.pth"


class _BuildPyWithPth(build_py):
    def run(self):
        super().run()
        # A .pth file only takes effect at the top of a site directory, so it is copied beside
        # the packages rather than inside one.
        self.copy_file(str(Path(__file__).parent / _PTH), str(Path(self.build_lib) / _PTH))


_FUSED = Extension(
    "tracer._fused", ["tracer/_fused.c"], depends=["tracer/_fused_helper.h"], optional=True,
    # no FMA contraction: the sums must not depend on which CPU built the kernel
    extra_compile_args=["-O3", "-ffp-contract=off", "-Wno-psabi"],
)

setup(cmdclass={"build_py": _BuildPyWithPth}, ext_modules=[_FUSED])
