"""stagefs: a transient, read-optimised, distributed file system for training data."""

from stagefs.cluster.connect import connect
from stagefs.errors import (
    ChecksumError,
    ConfigError,
    FormatError,
    NotFoundError,
    PackError,
    ReadOnlyError,
    StagefsError,
)
from stagefs.pack import PackReport, pack, unpack
from stagefs.posix.intercept import intercept
from stagefs.store import Store, open

__all__ = [
    "ChecksumError",
    "ConfigError",
    "FormatError",
    "NotFoundError",
    "PackError",
    "PackReport",
    "ReadOnlyError",
    "StagefsError",
    "Store",
    "__version__",
    "connect",
    "intercept",
    "open",
    "pack",
    "unpack",
]

__version__ = "0.1.0"
