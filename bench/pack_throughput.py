"""`data pack` throughput against tokenizers' own encode_batch on the same texts (CPU).

    PYTHONPATH=src python bench/pack_throughput.py --tokenizer DIR [--workers 1,2] INPUT...

Prints one row per measurement: MB of input per second and the ratio to the ceiling, which is
``Tokenizer.encode_batch_fast`` over the same documents (read beforehand, in ~1 MB batches, no
special tokens) -- what tokenization alone costs with tokenizers' own thread pool. The pack rows
include reading, decoding, the val split hash, writing shards and their sha256.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path


def cpu_seconds() -> float:
    """user + system CPU time of this process and its finished children (the pack workers)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def read_texts(inputs: list[str]) -> tuple[list[str], int, int]:
    """Every document of the inputs that pack would use, and the bytes of the files they came from."""
    from entrenar.data.corpus import _SAFE_CUT_BYTES
    from entrenar.data.sources import SkippedFile, expand_inputs, iter_file_texts

    texts, used_bytes, skipped = [], 0, 0
    for path in expand_inputs(inputs):
        try:
            file_texts = [t for t, _ in iter_file_texts(path, 1 << 20, _SAFE_CUT_BYTES)]
        except SkippedFile:
            skipped += 1
            continue
        texts.extend(file_texts)
        used_bytes += path.stat().st_size
    return texts, used_bytes, skipped


def ceiling(tokenizer_dir: str, texts: list[str]) -> tuple[float, int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    batches, batch, size = [], [], 0
    for t in texts:
        batch.append(t)
        size += len(t)
        if size >= 1 << 20:
            batches.append(batch)
            batch, size = [], 0
    batches.append(batch)
    t0 = time.perf_counter()
    n = sum(len(e.ids) for b in batches for e in tok.encode_batch_fast(b, add_special_tokens=False))
    return time.perf_counter() - t0, n


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--workers", default="1,2", help="comma-separated worker counts (1,2)")
    ap.add_argument("inputs", nargs="+")
    args = ap.parse_args()
    from entrenar.data.corpus import pack
    from entrenar.tokenizer import load_tokenizer

    t0 = time.perf_counter()
    texts, used_bytes, skipped = read_texts(args.inputs)
    read_s = time.perf_counter() - t0
    mb = used_bytes / 1e6
    c0 = cpu_seconds()
    seconds, tokens = ceiling(args.tokenizer, texts)
    cpu = [cpu_seconds() - c0]
    print(f"cpus {os.cpu_count()}; {len(texts)} documents, {mb:.1f} MB used ({skipped} files skipped), "
          f"read+decode {read_s:.1f}s, {tokens:,} tokens ({used_bytes / tokens:.2f} bytes/token)")
    rows = [("tokenizers encode_batch_fast (ceiling)", seconds, mb / seconds)]
    tok = load_tokenizer(args.tokenizer)
    for workers in [int(w) for w in args.workers.split(",")]:
        out = Path(tempfile.mkdtemp()) / "shards"
        t0, c0 = time.perf_counter(), cpu_seconds()
        index = pack(args.inputs, tok, out, workers=workers)
        dt = time.perf_counter() - t0
        cpu.append(cpu_seconds() - c0)
        # pack adds EOS per document and leaves out whitespace-only documents
        rows.append((f"entrenar data pack --workers {workers} ({index['tokens']:,} tokens)", dt, mb / dt))
        shutil.rmtree(out.parent)
    print(f"load average at the end: {os.getloadavg()}")
    print("\n| what | wall s | MB/s | vs ceiling | CPU s (user+sys, incl. workers) | MB per CPU s |")
    print("|---|---:|---:|---:|---:|---:|")
    for (name, s, rate), c in zip(rows, cpu):
        print(f"| {name} | {s:.1f} | {rate:.2f} | {rate / rows[0][2]:.2f}x | {c:.1f} | {mb / c:.2f} |")


if __name__ == "__main__":
    main()
