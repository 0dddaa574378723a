#!/usr/bin/env python3
"""Why the package archive is zstd -3: size and speed of candidate compressors on real modules.

Usage: python bench/compression.py PACKAGE.tar.zst   (or a directory of .ko files)
Prints, per method: compressed size, ratio, compress and decompress wall time (best of 3).
"""
from __future__ import annotations

import gzip
import io
import lzma
import sys
import tarfile
import time
from pathlib import Path

import zstandard


def tar_bytes(src: Path) -> bytes:
    if src.is_dir():
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as t:
            for p in sorted(src.rglob("*")):
                if p.is_file():
                    t.add(p, p.relative_to(src).as_posix())
        return buf.getvalue()
    return zstandard.ZstdDecompressor().stream_reader(open(src, "rb")).read()


def best(fn, n=3):
    t = []
    out = None
    for _ in range(n):
        t0 = time.perf_counter()
        out = fn()
        t.append(time.perf_counter() - t0)
    return out, min(t)


def main() -> None:
    raw = tar_bytes(Path(sys.argv[1]))
    methods = {
        "gzip -6": (lambda b: gzip.compress(b, 6), gzip.decompress),
        "gzip -9": (lambda b: gzip.compress(b, 9), gzip.decompress),
        "xz -6": (lambda b: lzma.compress(b, preset=6), lzma.decompress),
        "zstd -3": (lambda b: zstandard.ZstdCompressor(level=3).compress(b),
                    lambda c: zstandard.ZstdDecompressor().decompress(c)),
        "zstd -3 (threads)": (lambda b: zstandard.ZstdCompressor(level=3, threads=-1).compress(b),
                              lambda c: zstandard.ZstdDecompressor().decompress(c)),
        "zstd -19": (lambda b: zstandard.ZstdCompressor(level=19).compress(b),
                     lambda c: zstandard.ZstdDecompressor().decompress(c)),
    }
    print(f"input: {len(raw) / 1e6:.1f} MB tar of {sys.argv[1]}")
    print(f"{'method':<18} {'size MB':>8} {'ratio':>6} {'compress s':>11} {'decompress s':>13}")
    for name, (c, d) in methods.items():
        reps = 1 if name in ("xz -6", "zstd -19") else 3
        comp, tc = best(lambda: c(raw), reps)
        back, td = best(lambda: d(comp), 3)
        assert back == raw
        print(f"{name:<18} {len(comp) / 1e6:>8.2f} {len(raw) / len(comp):>6.2f} {tc:>11.3f} {td:>13.3f}")


if __name__ == "__main__":
    main()
