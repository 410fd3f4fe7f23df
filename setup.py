"""Build hooks: ships `sleuth_autoattach.pth` at the top of site-packages, and builds the
tracer's optional compiled part, the one-pass statistics kernel.

The .pth line imports `sleuth._autoattach`, which does nothing unless a SLEUTH_* variable asks
for a tool; that is what lets `SLEUTH_DUMP_CONFIG=dump.json python train.py` trace a script
nobody edited. `tracer.storage._stats_kernel` (tracer/storage/_stats_kernel.c, plain C with
GCC/Clang vector extensions, and tracer/storage/_table.c, which packs the step files' tables) is
`optional`: where no C compiler is there, or it fails, the install goes on and the tracer uses
its numpy path. It needs
neither torch nor a C++ compiler to build. Everything else about the build lives in pyproject.toml.
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
        # The guides travel with the package, so `sleuth docs` works without a checkout.
        docs = Path(self.build_lib) / "sleuth" / "_docs"
        self.mkpath(str(docs))
        for guide in [Path(__file__).parent / "README.md", *sorted(Path(__file__).parent.glob("docs/*.md"))]:
            self.copy_file(str(guide), str(docs / guide.name))
        # and so do the examples they cite (examples/train.py, its data): `sleuth docs
        # --examples` copies them out, so the guides' commands run as written
        self.mkpath(str(docs / "examples"))
        for example in sorted((Path(__file__).parent / "examples").iterdir()):
            if example.is_file():
                self.copy_file(str(example), str(docs / "examples" / example.name))


_STATS_KERNEL = Extension(
    "tracer.storage._stats_kernel", ["tracer/storage/_stats_kernel.c", "tracer/storage/_table.c"],
    optional=True,
    # no FMA contraction: the sums must not depend on which CPU built the kernel
    extra_compile_args=["-O3", "-ffp-contract=off", "-Wno-psabi"],
)


setup(cmdclass={"build_py": _BuildPyWithPth}, ext_modules=[_STATS_KERNEL])
