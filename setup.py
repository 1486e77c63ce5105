"""Build the optional C accelerator; everything else is in pyproject.toml.

``stagefs._speedups`` needs a C compiler, the Python headers and xxhash.h (Debian/Ubuntu:
``apt-get install libxxhash-dev``). If any is missing the build goes on without it and
stagefs uses its pure-Python path (same results, slower metadata calls).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "stagefs._speedups",
            ["src/stagefs/_speedups.c"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
