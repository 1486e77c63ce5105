"""benchmarks/mlperf.py refuses what it cannot run before any work: a mode it does not know
ran as the "api" mode under the typo's name, a workload it does not know was a KeyError."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "mlperf.py"


def _mlperf() -> object:
    spec = importlib.util.spec_from_file_location("mlperf_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["mlperf_script"] = mod  # dataclasses look their module up by name
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules["mlperf_script"]
    return mod


@pytest.mark.parametrize("args, words", [
    (["--modes", "plain,apii"], "mlperf: --modes apii: unknown; choose from plain,run,api"),
    (["--workloads", "unet"], "mlperf: --workloads unet: unknown; choose from unet3d,"),
])
def test_an_unknown_mode_or_workload_is_named(args: list[str], words: str,
                                              tmp_path: Path) -> None:
    main = _mlperf().main  # type: ignore[attr-defined]
    with pytest.raises(SystemExit) as exc:
        main([*args, "--pfs", str(tmp_path / "nopfs"), "--out", str(tmp_path / "out")])
    assert str(exc.value).startswith(words), exc.value
    assert not (tmp_path / "out").exists()
