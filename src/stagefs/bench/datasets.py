"""Generated datasets that look like the real ones to a file system and to a decoder.

``imagenet_like``: class folders of valid JPEG files whose sizes follow a log-normal law
around ImageNet's (mean about 110 KB). Each file is a small real JPEG with APP segments of
random bytes after its start marker, so PIL decodes it, and its bytes do not compress, as
real JPEG bytes do not.

``text_like``: files of English-like text (words drawn from a vocabulary) whose sizes follow
a log-normal law (mean about 18 KB): a corpus of documents, which ``stagefs pack`` stores
compressed (zstd, about 3.7x), to measure what decoding costs a reader.
"""

from __future__ import annotations

import base64
import os
import struct
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

__all__ = ["Dataset", "imagenet_like", "npz_like", "text_like"]

# A 16x16 baseline JPEG (632 bytes).
_TINY_JPEG = base64.b64decode(
    "/9j/4AAQSkZJRgABAQAAAQABAAD/2wBDABALDA4MChAODQ4SERATGCgaGBYWGDEjJR0oOjM9PDkzODdASFxOQERXRTc4"
    "UG1RV19iZ2hnPk1xeXBkeFxlZ2P/2wBDARESEhgVGC8aGi9jQjhCY2NjY2NjY2NjY2NjY2NjY2NjY2NjY2NjY2NjY2Nj"
    "Y2NjY2NjY2NjY2NjY2NjY2NjY2P/wAARCAAQABADASIAAhEBAxEB/8QAHwAAAQUBAQEBAQEAAAAAAAAAAAECAwQFBgcI"
    "CQoL/8QAtRAAAgEDAwIEAwUFBAQAAAF9AQIDAAQRBRIhMUEGE1FhByJxFDKBkaEII0KxwRVS0fAkM2JyggkKFhcYGRol"
    "JicoKSo0NTY3ODk6Q0RFRkdISUpTVFVWV1hZWmNkZWZnaGlqc3R1dnd4eXqDhIWGh4iJipKTlJWWl5iZmqKjpKWmp6ip"
    "qrKztLW2t7i5usLDxMXGx8jJytLT1NXW19jZ2uHi4+Tl5ufo6erx8vP09fb3+Pn6/8QAHwEAAwEBAQEBAQEBAQAAAAAA"
    "AAECAwQFBgcICQoL/8QAtREAAgECBAQDBAcFBAQAAQJ3AAECAxEEBSExBhJBUQdhcRMiMoEIFEKRobHBCSMzUvAVYnLR"
    "ChYkNOEl8RcYGRomJygpKjU2Nzg5OkNERUZHSElKU1RVVldYWVpjZGVmZ2hpanN0dXZ3eHl6goOEhYaHiImKkpOUlZaX"
    "mJmaoqOkpaanqKmqsrO0tba3uLm6wsPExcbHyMnK0tPU1dbX2Nna4uPk5ebn6Onq8vP09fb3+Pn6/9oADAMBAAIRAxEA"
    "PwDOooor3DpP/9k="
)
_APP_MAX = 65533  # payload bytes of one APPn segment


@dataclass(frozen=True, slots=True)
class Dataset:
    root: str
    files: int
    bytes: int
    classes: int


def jpeg_bytes(size: int, rng: np.random.Generator) -> bytes:
    """A decodable JPEG of ``size`` bytes (up to 3 more where the padding cannot split evenly)."""
    pad = max(0, size - len(_TINY_JPEG))
    parts = [_TINY_JPEG[:2]]
    while pad > 0:
        take = min(pad, _APP_MAX + 4)
        if take < 4:  # too small for a segment: fold into the previous one
            take = 4
        payload = rng.bytes(take - 4)
        parts.append(b"\xff\xe9" + struct.pack(">H", len(payload) + 2) + payload)
        pad -= take
    parts.append(_TINY_JPEG[2:])
    data = b"".join(parts)
    return data


def imagenet_like(
    root: str, files: int = 2000, classes: int = 20, mean_size: int = 110_000, seed: int = 0,
    progress: bool | None = None,
) -> Dataset:
    """Write ``files`` JPEGs in ``classes`` folders under ``root/train``."""
    rng = np.random.default_rng(seed)
    sigma = 0.6
    mu = np.log(mean_size) - sigma**2 / 2
    sizes = np.clip(rng.lognormal(mu, sigma, files), 2_000, 4_000_000).astype(int)
    total = 0
    for c in range(classes):
        os.makedirs(os.path.join(root, "train", f"n{1440764 + c:08d}"), exist_ok=True)
    for i in tqdm(range(files), desc="generating", unit="file", disable=None if progress is None
                  else not progress):
        c = i % classes
        path = os.path.join(root, "train", f"n{1440764 + c:08d}", f"img_{i:07d}.JPEG")
        data = jpeg_bytes(int(sizes[i]), rng)
        with open(path, "wb") as f:
            f.write(data)
        total += len(data)
    return Dataset(root, files, total, classes)


def npz_like(root: str, files: int = 200, shape: tuple[int, ...] = (64, 64), seed: int = 0,
             progress: bool | None = None) -> Dataset:
    """Write ``files`` npz samples (a float32 array and an int label), as DLIO's npz format."""
    rng = np.random.default_rng(seed)
    os.makedirs(os.path.join(root, "train"), exist_ok=True)
    total = 0
    for i in tqdm(range(files), desc="generating", unit="file", disable=None if progress is None
                  else not progress):
        path = os.path.join(root, "train", f"sample_{i:06d}.npz")
        x = rng.integers(0, 255, size=shape).astype(np.float32)
        np.savez(path, x=x, y=np.int64(i % 10))
        total += os.path.getsize(path)
    return Dataset(root, files, total, 10)


def text_like(root: str, files: int = 2000, mean_size: int = 18_000, seed: int = 0,
              progress: bool | None = None) -> Dataset:
    """Write ``files`` text documents in 20 folders under ``root/train``."""
    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"etaoinshrdlcumwfgypbvkjxqz", np.uint8)
    vocab = [letters[rng.integers(0, 26, int(n))].tobytes()
             for n in rng.integers(2, 10, 5000)]
    sigma = 0.8
    mu = np.log(mean_size) - sigma**2 / 2
    sizes = np.clip(rng.lognormal(mu, sigma, files), 200, 1_000_000).astype(int)
    total = 0
    for c in range(20):
        os.makedirs(os.path.join(root, "train", f"part{c:02d}"), exist_ok=True)
    for i in tqdm(range(files), desc="generating", unit="file", disable=None if progress is None
                  else not progress):
        # Zipf-like word frequencies, as in text: a few words most of the time
        picks = np.minimum(rng.zipf(1.3, int(sizes[i]) // 5 + 1) - 1, len(vocab) - 1)
        data = b" ".join(vocab[k] for k in picks)[: int(sizes[i])]
        with open(os.path.join(root, "train", f"part{i % 20:02d}", f"doc_{i:07d}.txt"),
                  "wb") as f:
            f.write(data)
        total += len(data)
    return Dataset(root, files, total, 20)
