"""The Sampler's arguments as users pass them: numpy and torch integers from a config or a
launcher (the state they lead to must still go through ``torch.save`` and
``torch.load(weights_only=True)``, torch's default, and JSON), and floats or strings,
refused by name instead of truncated or failing deep inside."""

from __future__ import annotations

import io
import json
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

import stagefs  # noqa: E402
from stagefs.errors import ConfigError  # noqa: E402
from stagefs.torch import FileDataset, Sampler  # noqa: E402
from tiers_helpers import make_tree  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def ds(tmp_path_factory: pytest.TempPathFactory) -> FileDataset:
    base = tmp_path_factory.mktemp("args")
    make_tree(base / "raw" / "train", n=41, seed=3)
    stagefs.pack(base / "raw", base / "pack", shard_size="32KiB", jobs=1, progress=False,
                 echo=lambda _m: None)
    return FileDataset(base / "pack")


@pytest.mark.parametrize("kind", [np.int64, np.int32, torch.tensor])
def test_a_state_from_numpy_or_torch_ranks_loads_with_weights_only(ds: FileDataset,
                                                                   kind: Any) -> None:
    s = Sampler(ds, seed=kind(4), rank=kind(1), world_size=kind(3), window=kind(2))
    s.set_epoch(kind(2))
    it = iter(s)
    for _ in range(5):
        next(it)
    state = s.state_dict(consumed=kind(15))
    json.dumps(state)
    buf = io.BytesIO()
    torch.save({"sampler": state}, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)["sampler"]
    assert back == state
    again = Sampler(ds, seed=4, rank=1, world_size=3, window=2)
    again.load_state_dict(back)
    assert list(again) == list(it)


@pytest.mark.parametrize(("kw", "named"), [
    ({"rank": 1.0, "world_size": 2}, "rank"),
    ({"rank": 0, "world_size": "2"}, "world_size"),
    ({"seed": 1.7}, "seed"),
    ({"seed": "x"}, "seed"),
    ({"window": 0}, "window"),
    ({"window": 2.5}, "window"),
    ({"prefetch": 1.5}, "prefetch"),
    ({"prefetch": "lots"}, "prefetch"),
    ({"prefetch": -1}, "prefetch"),
])
def test_arguments_that_are_not_whole_numbers_are_refused_by_name(
        ds: FileDataset, kw: dict[str, Any], named: str) -> None:
    with pytest.raises((TypeError, ConfigError), match=named):
        Sampler(ds, **kw)


def test_a_numpy_prefetch_budget_is_a_budget(ds: FileDataset) -> None:
    s = Sampler(ds, prefetch=np.int64(100_000), rank=0, world_size=1)
    assert s.budget == 100_000 and isinstance(s.budget, int)
    s.close()


@pytest.mark.parametrize(("kw", "named"), [
    ({"closed": "false"}, "closed"),
    ({"closed": "0"}, "closed"),
    ({"shuffle": "False"}, "shuffle"),
    ({"drop_last": "no"}, "drop_last"),
    ({"locality": "off"}, "locality"),
    ({"shuffle": 2}, "shuffle"),
])
def test_switches_given_as_strings_are_refused_by_name(ds: FileDataset, kw: dict[str, Any],
                                                       named: str) -> None:
    """A switch read from a config file or a command line as a string was taken as true:
    closed="false" ran closed mode, shuffle="False" shuffled."""
    with pytest.raises(TypeError, match=named):
        Sampler(ds, **kw)


def test_switches_from_numpy_or_torch_or_as_0_and_1_are_taken(ds: FileDataset) -> None:
    s = Sampler(ds, shuffle=np.bool_(False), drop_last=1, closed=torch.tensor(0), rank=0,
                world_size=1)
    assert (s.shuffle, s.drop_last, s.closed) == (False, True, False)
    assert list(s) == list(range(len(ds)))
