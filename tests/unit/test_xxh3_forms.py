"""The four forms of XXH3-64's long-input loop in src/stagefs/_xxh3.h (plain C, SSE2, AVX2,
AVX-512) each give the xxhash package's value: a program compiled with each form forced
hashes slices of random bytes (lengths around block and stripe edges, odd starting addresses)."""

from __future__ import annotations

import random
import shutil
import subprocess
from pathlib import Path

import pytest
import xxhash

import stagefs

# the installed package's copy (CI runs the tests against the wheel, with no src/ beside)
HEADER = Path(stagefs.__file__).resolve().parent / "_xxh3.h"

PROGRAM = r"""
#include <stdio.h>
#include <stdlib.h>
#include "_xxh3.h"
/* prog DATA OFF:LEN...: the hash of each slice of DATA */
int main(int argc, char **argv) {
    FILE *f = fopen(argv[1], "rb");
    static unsigned char data[1 << 22];
    size_t n = fread(data, 1, sizeof data, f);
    for (int i = 2; i < argc; i++) {
        size_t off, len;
        if (sscanf(argv[i], "%zu:%zu", &off, &len) != 2 || off + len > n) return 2;
        printf("%llu\n", (unsigned long long)xxh3_64(data + off, len));
    }
    return 0;
}
"""

FORMS = {"plain C": 0, "SSE2": 1, "AVX2": 2, "AVX-512": 3}


def _cpu_has(flag: str) -> bool:
    try:
        return any(flag in line.split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("flags"))
    except OSError:
        return False


@pytest.mark.parametrize("form", sorted(FORMS))
def test_each_form_equals_xxhash(form: str, tmp_path: Path) -> None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    level = FORMS[form]
    x86 = subprocess.run([cc, "-dM", "-E", "-"], input=b"", capture_output=True,
                         check=True).stdout.find(b"__x86_64__") >= 0
    if level and not x86:
        pytest.skip(f"{form} is an x86-64 form")
    if level == 2 and not _cpu_has("avx2"):
        pytest.skip("this CPU has no AVX2")
    if level == 3 and not _cpu_has("avx512f"):
        pytest.skip("this CPU has no AVX-512")
    (tmp_path / "p.c").write_text(PROGRAM)
    exe = tmp_path / "p"
    subprocess.run([cc, "-O2", f"-DXXH3_FORCE={level}", f"-I{HEADER.parent}", "-o", exe,
                    tmp_path / "p.c"], check=True)
    rnd = random.Random(level)
    data = rnd.randbytes(3 << 20)
    (tmp_path / "data").write_bytes(data)
    block = 1024
    lengths = [241, 255, 256, 1023, 1024, 1025, 1088, 2047, 2048, 2049, 3 * block + 63,
               65536, 100_003, 1 << 20, (1 << 20) + 1, 3 << 20]
    lengths += [rnd.randrange(241, 3 << 20) for _ in range(20)]
    slices = [(0 if n == 3 << 20 else rnd.randrange(0, min(64, (3 << 20) - n + 1)), n)
              for n in lengths]
    out = subprocess.run([exe, tmp_path / "data", *(f"{o}:{n}" for o, n in slices)],
                         capture_output=True, check=True).stdout.split()
    assert [int(h) for h in out] == [xxhash.xxh3_64_intdigest(data[o:o + n]) for o, n in slices]
