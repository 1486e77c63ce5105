"""The on-disk format of a pack (docs/FORMAT.md): manifest, shards, codecs, checksums."""

from stagefs.format.checksum import checksum
from stagefs.format.codecs import CODEC_NONE, CODEC_ZSTD, Codec
from stagefs.format.manifest import Manifest, ManifestBuilder
from stagefs.format.shard import ShardHeader, ShardWriter, shard_name
from stagefs.format.spec import (
    KIND_DIR,
    KIND_FILE,
    KIND_SYMLINK,
    MANIFEST_NAME,
    NO_INDEX,
    PACK_STATE_DIR,
    PIECE,
    SUPPORTED_VERSIONS,
    VERSION,
)

__all__ = [
    "CODEC_NONE",
    "CODEC_ZSTD",
    "KIND_DIR",
    "KIND_FILE",
    "KIND_SYMLINK",
    "MANIFEST_NAME",
    "NO_INDEX",
    "PACK_STATE_DIR",
    "PIECE",
    "SUPPORTED_VERSIONS",
    "VERSION",
    "Codec",
    "Manifest",
    "ManifestBuilder",
    "ShardHeader",
    "ShardWriter",
    "checksum",
    "shard_name",
]
