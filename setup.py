"""Build the optional C accelerator; everything else is in pyproject.toml.

``stagefs._speedups`` needs only a C compiler and the Python headers (it carries the one
hash it uses, XXH3-64, itself). If either is missing the build goes on without it and
stagefs uses its pure-Python path (same results, metadata calls about 6x slower);
``stagefs info`` says which one runs, and stagefs logs a notice once per process.
``STAGEFS_REQUIRE_SPEEDUPS=1`` makes a failed build an error (CI sets it: a build that
fails there must not pass as tests skipped).
"""

import os

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "stagefs._speedups",
            ["src/stagefs/_speedups.c"],
            extra_compile_args=["-O3"],
            optional=os.environ.get("STAGEFS_REQUIRE_SPEEDUPS", "") in ("", "0"),
        )
    ]
)
