"""Build of the optional native kernels (``ckpttool.engine._native``); everything else is in pyproject.toml.

The extension is ``optional``: where no C compiler is present the install still succeeds and the
engine uses its numpy/torch kernels (``ckpttool.engine.native.lib()`` returns ``None``).
Build in a source tree: ``python setup.py build_ext --inplace``.
"""

from glob import glob

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "ckpttool.engine._native",
            sources=sorted(glob("ckpttool/engine/native/*.c")),
            depends=sorted(glob("ckpttool/engine/native/*.h")),
            # bit-exact IEEE arithmetic: no fused multiply-add contraction, no fast-math; sqrt sets
            # no errno (the same correctly rounded result, and loops with sqrt vectorize)
            extra_compile_args=[
                "-O3",
                "-std=c11",
                "-ffp-contract=off",
                "-fno-fast-math",
                "-fno-math-errno",
                "-fno-strict-aliasing",
            ],
            optional=True,
        )
    ]
)
