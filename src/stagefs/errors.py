"""The stagefs error tree.

Every error stagefs raises is a ``StagefsError``; where a builtin fits, the error is also
that builtin, so ``except FileNotFoundError`` works for users, and ``errno`` is set the way
the real file system would set it.

::

    StagefsError
    ├── PathError (OSError)                    the caller named a path that cannot be used
    │   ├── NotFoundError (FileNotFoundError)          ENOENT
    │   ├── IsADirectoryError_ (IsADirectoryError)     EISDIR
    │   ├── NotADirectoryError_ (NotADirectoryError)   ENOTDIR
    │   ├── SymlinkLoopError (OSError)                 ELOOP: too many levels of symlinks
    │   └── ReadOnlyError (OSError)                    EROFS: stagefs never writes
    ├── FormatError (ValueError)               a pack on disk is not what the format says
    │   ├── UnsupportedVersionError                  written by a newer (or unknown) stagefs
    │   ├── CorruptManifestError                     truncated, bad magic, bad checksum
    │   └── CorruptShardError                        truncated, wrong pack, bad header
    ├── ChecksumError (OSError, EIO)           bytes read did not match the manifest
    ├── OriginUnavailableError (OSError, EIO)  the origin cannot be read (gone, unmounted)
    ├── DescriptorLimitError (OSError, EMFILE) this process is at its open-file limit
    ├── PackError                              packing a source tree failed
    │   ├── UnsafeSymlinkError                       a symlink points out of the tree
    │   ├── UnreadableSourceError (PermissionError)  a file or directory cannot be read
    │   ├── SourceChangedError                       a file changed while it was packed
    │   ├── DestinationExistsError (FileExistsError) a complete pack is already there
    │   └── DestinationFullError (OSError)           DEST's file system is full, or the
    │                                                quota there used up (ENOSPC, EDQUOT)
    ├── ConfigError (ValueError)               a size, a tier spec or a variable is malformed
    ├── ProtocolError (ValueError)             a peer sent bytes that are not the stagefs protocol
    │   └── ProtocolVersionError                     another version of it (another stagefs)
    ├── AuthenticationError (PermissionError)  a peer did not prove the job token
    ├── ClusterError                           no cluster runtime here, or it cannot be used
    └── RuntimeInUseError                      live processes use a job's runtime (clean refuses)

Errors are raised at the boundary where stagefs knows what went wrong, with the path (and
the shard, where one is involved) in the message, and ``from`` the low-level cause.
"""

from __future__ import annotations

import errno
import os
from typing import Any, cast

__all__ = [
    "AuthenticationError",
    "ChecksumError",
    "ClusterError",
    "ConfigError",
    "CorruptManifestError",
    "CorruptShardError",
    "DescriptorLimitError",
    "DestinationExistsError",
    "DestinationFullError",
    "FormatError",
    "IsADirectoryError_",
    "NotADirectoryError_",
    "NotFoundError",
    "OriginUnavailableError",
    "PackError",
    "PathError",
    "ProtocolError",
    "ProtocolVersionError",
    "ReadOnlyError",
    "RuntimeInUseError",
    "SourceChangedError",
    "StagefsError",
    "SymlinkLoopError",
    "UnreadableSourceError",
    "UnsafeSymlinkError",
    "UnsupportedVersionError",
]


class StagefsError(Exception):
    """Base of every error stagefs raises."""

    def __reduce__(self) -> tuple[Any, ...]:
        # pickled as it is (a worker process's error sent to its parent), not rebuilt by
        # calling the class with its args: the subclasses' __init__ take other arguments,
        # and a pool's result thread died unpickling one (the caller waited out its timeout)
        cls, args, *state = cast(tuple[Any, ...], super().__reduce__())
        return (_rebuild, (cls, args), *state)


def _rebuild(cls: type[StagefsError], args: tuple[Any, ...]) -> StagefsError:
    err = cls.__new__(cls, *args)
    (OSError if issubclass(cls, OSError) else Exception).__init__(err, *args)
    return err


class PathError(StagefsError, OSError):
    """A path given by the caller cannot be used; ``errno`` and ``filename`` are set."""

    errno_value = errno.EINVAL

    def __init__(self, path: str, message: str | None = None) -> None:
        code = type(self).errno_value
        OSError.__init__(self, code, message or os.strerror(code), path)


class NotFoundError(PathError, FileNotFoundError):
    errno_value = errno.ENOENT


class IsADirectoryError_(PathError, IsADirectoryError):
    errno_value = errno.EISDIR


class NotADirectoryError_(PathError, NotADirectoryError):
    errno_value = errno.ENOTDIR


class SymlinkLoopError(PathError):
    errno_value = errno.ELOOP


class ReadOnlyError(PathError):
    """stagefs is read-only: any write, create, rename or delete fails with EROFS."""

    errno_value = errno.EROFS

    def __init__(self, path: str, message: str | None = None) -> None:
        super().__init__(path, message or "Read-only file system (stagefs serves data read-only)")


class FormatError(StagefsError, ValueError):
    """A file of a pack is not what docs/FORMAT.md says it must be."""


class UnsupportedVersionError(FormatError):
    pass


class CorruptManifestError(FormatError):
    pass


class CorruptShardError(FormatError):
    pass


class ChecksumError(StagefsError, OSError):
    """Bytes read for a file did not match the checksum in the manifest."""

    def __init__(self, path: str, where: str) -> None:
        msg = f"checksum mismatch for {path!r} read from {where}: the copy is corrupt"
        OSError.__init__(self, errno.EIO, msg, path)
        self.where = where

    def __str__(self) -> str:
        return str(self.strerror)


class OriginUnavailableError(StagefsError, OSError):
    """A shard not held locally cannot be read from the origin (moved, deleted, unmounted)."""

    def __init__(self, origin: str, where: str, why: str, *, denied: bool = False) -> None:
        # denied: the origin's reason is a file's mode, and says what to do itself
        msg = (f"the origin {origin} cannot be read ({where}: {why}); shards held in the "
               "tiers still read." + ("" if denied else " Is the shared file system mounted "
                                      "and the dataset there?"))
        OSError.__init__(self, errno.EIO, msg, origin)

    def __str__(self) -> str:
        return str(self.strerror)


class DescriptorLimitError(StagefsError, OSError):
    """A read found no holder it could open: this process has reached its open-file limit
    (stagefs keeps a descriptor open for each shard its tiers hold, and for the shards it
    reads from the origin up to a share of the limit)."""

    def __init__(self, where: str) -> None:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        show = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
        msg = (f"{where}: this process has reached its open-file limit ({soft}; hard limit "
               f"{show}): stagefs keeps a descriptor open for each shard its tiers hold, "
               "and for the shards it reads from the origin up to a share of the limit; "
               "raise the limit (ulimit -n; above the hard limit: ulimit -Hn, nofile in "
               "limits.conf, or Slurm's PropagateResourceLimits)")
        OSError.__init__(self, errno.EMFILE, msg)

    def __str__(self) -> str:
        return str(self.strerror)


class PackError(StagefsError):
    """Packing a source tree failed; nothing that looks like a complete pack was written."""


class UnsafeSymlinkError(PackError):
    pass


class UnreadableSourceError(PackError, PermissionError):
    pass


class SourceChangedError(PackError):
    pass


class DestinationExistsError(PackError, FileExistsError):
    pass


class DestinationFullError(PackError, OSError):
    """The file system that holds the DEST of a pack or an unpack has no room left (ENOSPC),
    or the user's quota there is used up (EDQUOT); ``errno`` is the one the write got."""

    def __init__(self, message: str, code: int = errno.ENOSPC, dest: str | None = None) -> None:
        OSError.__init__(self, code, message, dest)

    def __str__(self) -> str:
        return str(self.strerror)


class ConfigError(StagefsError, ValueError):
    pass


class ProtocolError(StagefsError, ValueError):
    """A peer sent a frame that docs/PROTOCOL.md does not allow (bad magic, version, size)."""


class ProtocolVersionError(ProtocolError):
    """A peer speaks another version of the protocol: it runs another stagefs."""


class AuthenticationError(StagefsError, PermissionError):
    """A peer did not prove that it holds the job token (or we could not prove it to it)."""


class ClusterError(StagefsError):
    """The cluster runtime (map, token) cannot be found or used; the message says what to do."""


class RuntimeInUseError(StagefsError):
    """Live processes hold leases on a job's runtime directory; the message names them."""
