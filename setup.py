"""Build the optional C parts; everything else is in pyproject.toml.

``stagefs._speedups`` needs only a C compiler and the Python headers (it carries the one
hash it uses, XXH3-64, itself). If either is missing the build goes on without it and
stagefs uses its pure-Python path (same results, metadata calls about 6x slower);
``stagefs info`` says which one runs, and stagefs logs a notice once per process.
``stagefs.posix._preload`` is the preload library ``stagefs run`` loads into programs
(LD_PRELOAD): plain C against libc, no Python API (it is built as an extension only so that
it is compiled, named and installed with the package; it is never imported). Without it,
``stagefs run`` serves Python programs only, and says so.

``STAGEFS_REQUIRE_SPEEDUPS=1`` makes a failed build of either an error (CI sets it: a build that
fails there must not pass as tests skipped).
"""

import os

from setuptools import Extension, setup

OPTIONAL = os.environ.get("STAGEFS_REQUIRE_SPEEDUPS", "") in ("", "0")

setup(
    ext_modules=[
        Extension(
            "stagefs._speedups",
            ["src/stagefs/_speedups.c"],
            depends=["src/stagefs/_xxh3.h"],
            extra_compile_args=["-O3"],
            optional=OPTIONAL,
        ),
        Extension(
            "stagefs.posix._preload",
            ["src/stagefs/posix/preload.c"],
            depends=["src/stagefs/_xxh3.h"],
            extra_compile_args=["-O2", "-fvisibility=hidden"],
            libraries=["dl", "pthread"],
            optional=OPTIONAL,
        ),
    ]
)
