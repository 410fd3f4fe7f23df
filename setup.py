"""Build hooks: ships `sleuth_autoattach.pth` at the top of site-packages, and builds the
tracer's optional compiled parts: the one-pass statistics kernel and the op observer.

The .pth line imports `sleuth._autoattach`, which does nothing unless a SLEUTH_* variable asks
for a tool; that is what lets `SLEUTH_DUMP_CONFIG=dump.json python train.py` trace a script
nobody edited. `tracer._fused` (tracer/_fused.c, plain C with GCC/Clang vector extensions, and
tracer/_table.c, which packs the step files' tables) is
`optional`: where it cannot be compiled the install goes on and the tracer uses its numpy path.
`tracer._observer` (tracer/_observer.cpp, the op level's capture through torch's C++ op
callbacks, `"op_capture": "observer"`) is built against the torch of the build environment, so
only where torch is importable there: `scripts/install.sh` installs with
`--no-build-isolation` after the torch pin (pip's isolated build would have no torch, or fetch
an unpinned one). It is optional too; without it that capture says how to get it. Everything
else about the build lives in pyproject.toml.
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


_FUSED = Extension(
    "tracer._fused", ["tracer/_fused.c", "tracer/_table.c"], optional=True,
    depends=["tracer/_fused_helper.h", "tracer/_fused_api.h"],
    # no FMA contraction: the sums must not depend on which CPU built the kernel
    extra_compile_args=["-O3", "-ffp-contract=off", "-Wno-psabi"],
)



_OBSERVER_SOURCES = (
    "_observer", "_observer_store", "_observer_rows", "_observer_hooks", "_observer_params",
)


def _observer() -> list[Extension]:
    """The op observer's extension, built against the torch importable here; none without it.
    A plain extension (torch's BuildExtension would compile the C kernel as C++ too)."""
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:  # an isolated build environment: the observer is not built
        return []
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", 1))
    return [Extension(
        "tracer._observer", [f"tracer/{name}.cpp" for name in _OBSERVER_SOURCES],
        language="c++", optional=True,
        include_dirs=["tracer", *cpp_extension.include_paths()],
        library_dirs=cpp_extension.library_paths(),
        libraries=["c10", "torch", "torch_cpu", "torch_python"],
        depends=["tracer/_fused_api.h", "tracer/_observer.h"],
        # NDEBUG: RecordFunction's debug-only checks reject inputs() read in these callbacks
        extra_compile_args=["-std=c++20", "-O2", "-DNDEBUG", "-DTORCH_EXTENSION_NAME=_observer",
                            "-DTORCH_API_INCLUDE_EXTENSION_H", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
                            "-fvisibility=hidden", "-g0"],
    )]


setup(cmdclass={"build_py": _BuildPyWithPth}, ext_modules=[_FUSED, *_observer()])
