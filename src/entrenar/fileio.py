"""Small file helpers shared by every module that writes files: hashing, atomic writes, JSONL."""

from __future__ import annotations

import contextlib
import errno
import gzip
import hashlib
import json
import os
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self is 3.11+


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    """sha256 of a file, read in chunks (shards and checkpoints can be GBs)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


# sha256 of files this process wrote, computed while writing them (HashingFile): keyed by the file's identity and
# state (device, inode, size, mtime), so a file changed or replaced since is hashed again; taken once
_WRITTEN: dict[tuple[int, int, int, int], str] = {}


def _identity(path: str | Path) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class HashingFile:
    """A binary file open for writing (`with HashingFile(path) as f`) that computes the sha256 of what is written
    to it, so a file of GBs is not read back to be hashed: `background` (the caller keeps every buffer it writes
    unchanged until close) hashes on a second thread while the next buffer is written, else inline. On close
    the digest is remembered for written_sha256."""

    def __init__(self, path: str | Path, background: bool = False):
        from concurrent.futures import ThreadPoolExecutor

        self._f = os.fdopen(open_no_follow(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb")
        self.path, self._h = Path(path), hashlib.sha256()
        self._pool = ThreadPoolExecutor(max_workers=1) if background else None
        self._pending: list[Any] = []
        self.digest: str | None = None

    def write(self, data: Any) -> int:
        if self._pool is not None:
            self._pending.append(self._pool.submit(self._h.update, data))
        else:
            self._h.update(data)
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()

    def fileno(self) -> int:
        return self._f.fileno()

    def close(self) -> None:
        if self._f.closed:
            return
        try:
            for done in self._pending:
                done.result()
        finally:
            if self._pool is not None:
                self._pool.shutdown()
            self._f.close()
        self.digest = self._h.hexdigest()
        _WRITTEN[_identity(self.path)] = self.digest

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def written_sha256(path: str | Path) -> str:
    """sha256 of `path`: the one HashingFile computed while this process wrote it, when the file is still that
    file (same inode, size and mtime), else read and hashed. For the records written right after a file (a
    checkpoint's meta.json, final/'s MANIFEST); verification reads the files (sha256_file)."""
    return _WRITTEN.pop(_identity(path), None) or sha256_file(path)


SAFETENSORS_DTYPES = {name: code for name, code in (
    ("float64", "F64"), ("float32", "F32"), ("float16", "F16"), ("bfloat16", "BF16"), ("int64", "I64"),
    ("int32", "I32"), ("int16", "I16"), ("int8", "I8"), ("uint8", "U8"), ("bool", "BOOL"),
    ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"))}


def write_safetensors(tensors: dict[str, Any], path: str | Path, metadata: dict[str, str] | None = None) -> str:
    """`tensors` (CPU torch tensors) as a safetensors file at `path` (safetensors.torch.save_file's arguments) (the format: a little-endian u64 header size,
    the JSON header padded to 8 bytes, then each tensor's bytes at its data_offsets), written straight from the
    tensors' memory (safetensors.torch.save_file first copies every tensor into a bytes object) and hashed while
    it is written. Returns the sha256 (also remembered for written_sha256)."""
    import struct

    import torch

    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    views, offset = [], 0
    for name in sorted(tensors):
        t = tensors[name].detach()
        assert t.device.type == "cpu", f"{name} is on {t.device}: write_safetensors takes CPU tensors"
        code = SAFETENSORS_DTYPES[str(t.dtype).removeprefix("torch.")]
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy()  # the tensor's own bytes, no copy
        header[name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [offset, offset + raw.nbytes]}
        views.append(memoryview(raw))
        offset += raw.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    chunk = 1 << 26  # 64 MiB: the hash of one chunk runs while the next is written
    with HashingFile(path, background=True) as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for view in views:
            for start in range(0, len(view), chunk):
                f.write(view[start:start + chunk])
    assert f.digest is not None
    return f.digest


def files_sha256(paths: list[Path], threads: int = 4) -> dict[str, str]:
    """{file name: sha256} of `paths`, hashed on up to `threads` threads at once (hashlib lets go of the GIL on
    large buffers: a rank's checkpoint shards, tens of GB for a 7B model, in a fraction of one thread's time)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(paths)))) as pool:
        return dict(zip((p.name for p in paths), pool.map(sha256_file, paths), strict=True))


# What a directory written by entrenar records of its files' sha256: a checkpoint's meta.json (train/checkpoint.py,
# with its COMPLETE marker) and a run's final/ MANIFEST (written last by the command that saved it).
CHECKPOINT_META = "meta.json"
MANIFEST = "sha256.json"
NOT_READ_AS_MODEL = ("optimizer.pt",)  # a checkpoint file no model load reads (resume verifies it)


def write_manifest(directory: str | Path) -> Path:
    """MANIFEST of `directory`: the sha256 of every file in it (subdirectories included), written last."""
    d = Path(directory)
    digests = {str(f.relative_to(d)): written_sha256(f) for f in sorted(d.rglob("*")) if f.is_file() and f.name != MANIFEST}
    return atomic_write(d / MANIFEST, json.dumps({"written_by": "entrenar", "sha256": digests}, indent=2) + "\n")


def recorded_hashes(directory: str | Path) -> tuple[Path, dict[str, str]] | None:
    """(the record, {file: sha256}) that entrenar wrote for `directory` (a checkpoint's meta.json, a final/'s
    MANIFEST), or None for a directory without one (an HF model of someone else, an older run's final/)."""
    from .errors import InputError

    d = Path(directory)
    record = d / MANIFEST if (d / MANIFEST).is_file() else d / CHECKPOINT_META if (d / "COMPLETE").is_file() and \
        (d / CHECKPOINT_META).is_file() else None
    if record is None:
        return None
    try:
        digests = json.loads(record.read_text())["sha256"]
        if not (isinstance(digests, dict) and all(isinstance(v, str) for v in digests.values())):
            raise TypeError("sha256 is not a map of file -> digest")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise InputError(f"{record}: unreadable ({type(e).__name__}: {e}), so the files of {d} cannot be checked: "
                         f"the directory is corrupt; use another checkpoint or re-create it") from None
    return record, digests


def verify_recorded(directory: str | Path, skip: tuple[str, ...] = NOT_READ_AS_MODEL) -> int:
    """InputError naming the first file of `directory` whose sha256 differs from (or is missing from) what entrenar
    recorded when it wrote it (recorded_hashes); files in `skip` (not read by a model load) are not hashed.
    Returns how many files were checked (0 when nothing is recorded). Read-only commands run it on a checkpoint or
    final/ before loading it (issue 38: corrupted weight bytes gave `eval` exit 0 with a null loss)."""
    from .errors import InputError

    found = recorded_hashes(directory)
    if found is None:
        return 0
    record, digests = found
    d, checked = Path(directory), 0
    for name, digest in sorted(digests.items()):
        if name in skip:
            continue
        f = d / name
        if not f.is_file():
            raise InputError(f"{f}: missing, though {record.name} records it: {d} is incomplete; use another "
                             f"checkpoint or re-create it")
        actual = sha256_file(f)
        if actual != digest:
            raise InputError(f"{f}: sha256 {actual[:12]}.. does not match the {digest[:12]}.. recorded in {record.name} "
                             f"when it was written: the file is corrupt (a disk or copy error); use another checkpoint "
                             f"(or re-create it)")
        checked += 1
    return checked


# What the OS says when a write cannot go on (a full disk, a quota, a file-size limit, a read-only or failing disk):
# libraries that do not raise OSError keep only this text (tokenizers' plain `Exception: No space left on device`)
DISK_FULL_TEXTS = tuple(os.strerror(code) for code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO))


def disk_write_error(e: BaseException) -> BaseException | None:
    """`e` when it is a write the disk refused, whoever raised it: an OSError, safetensors' SafetensorError (its
    wrapper of one: "File too large"), the tokenizers library's plain Exception carrying the OS's text ("No space left
    on device"), torch.save's RuntimeError from its zip writer ("[enforce fail at inline_container.cc] ... unexpected
    pos", "PytorchStreamWriter failed writing file"); None for anything else (a bug stays a bug)."""
    from safetensors import SafetensorError

    text = str(e)
    if isinstance(e, (OSError, SafetensorError)):
        return e
    if type(e) is Exception and any(t in text for t in DISK_FULL_TEXTS):
        return e
    if isinstance(e, RuntimeError) and ("inline_container" in text or "PytorchStreamWriter failed" in text):
        return e
    return None


def _tmp_path(path: Path) -> Path:
    # one naming rule for every tmp-then-rename site: hidden, next to the target, unique per process
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def open_no_follow(path: str | Path, flags: int, mode: int = 0o644) -> int:
    """os.open of a file entrenar writes (in a run directory above all) that never follows a symbolic link at
    `path` (O_NOFOLLOW): a link planted there, to a file elsewhere, is an InputError naming it instead of that file
    being truncated or appended to (issue 51: `pretrain --resume auto` overwrote the file a linked RUN/.lock
    pointed to)."""
    from .errors import InputError

    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise InputError(f"{path} is a symbolic link (to {os.readlink(path)}), where entrenar writes its own file; "
                         f"links there are never followed, so nothing was written: remove the link (or choose "
                         f"another directory)") from None


def clear_path(path: str | Path) -> None:
    """Remove what is at `path` without following a link: a link or a file is unlinked (never its target), a
    directory removed with its contents; nothing there is fine."""
    p = Path(path)
    if p.is_symlink() or (p.exists() and not p.is_dir()):
        p.unlink()
    elif p.is_dir():
        shutil.rmtree(p)


def atomic_write(path: str | Path, data: bytes | str | Callable[[Path], None]) -> Path:
    """Write `path` so that a crash leaves either the old file or the new one, never a partial one.

    `data` is bytes, text (UTF-8), or a callable that writes the given temporary path. A symbolic link at `path`
    is replaced by the file (its target is never written), and one at the temporary path is removed first.
    """
    path = Path(path)
    tmp = _tmp_path(path)
    clear_path(tmp)  # a stale temporary, or a link planted under its name
    path.parent.mkdir(parents=True, exist_ok=True)  # a missing parent of an --out is made (CLI-OUT-PARENTS)
    try:
        if callable(data):
            data(tmp)
        else:
            raw = data.encode("utf-8") if isinstance(data, str) else data
            with os.fdopen(open_no_follow(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb") as f:
                f.write(raw)
        os.replace(tmp, path)  # rename(2) replaces a link at `path`, never follows it
    finally:
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
    return path


def append_text(path: str | Path, text: str) -> None:
    """Append `text` (UTF-8) to `path` (created if missing), never through a symbolic link (open_no_follow): the
    append-only logs of a run (metrics.jsonl, eval.jsonl) and a task eval's rows."""
    with os.fdopen(open_no_follow(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND), "a", encoding="utf-8") as f:
        f.write(text)


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling directory; rename it to `path` only when the block succeeds.

    `path` must not exist (callers refuse or remove an existing target first).
    """
    path = Path(path)
    tmp = _tmp_path(path)
    clear_path(tmp)  # a stale temporary, or a link planted under its name (never followed)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


# The longest line a JSONL row of SFT / preference / `eval --data` may be, in characters: far past any chat that fits
# a context (128k tokens are ~0.5 M characters); a longer line is refused before it is parsed, rendered and
# tokenized (a 60 MB line took 2 minutes of `data check` to be skipped as too long)
MAX_ROW_CHARS = 8 << 20


def read_jsonl(path: str | Path, on_error: Callable[[int, json.JSONDecodeError], None] | None = None,
               max_line_chars: int | None = None) -> Iterator[tuple[int, Any]]:
    """(line number, object) for each non-blank line: the one JSONL reader (SFT data, pretraining
    rows, metrics). ``.gz`` files are decompressed; a UTF-8 byte-order mark is accepted. A line that
    is not JSON is an InputError naming file:line, or, with ``on_error``, is passed to it
    (which may raise) and skipped; so is a line nested too deeply for Python's parser (RecursionError) and,
    with ``max_line_chars``, a longer line (not parsed). Text that is not UTF-8 is an InputError."""
    from .errors import InputError

    opener: Any = gzip.open if str(path).endswith(".gz") else open
    lineno = 0
    with opener(path, "rt", encoding="utf-8-sig") as f:
        try:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    if max_line_chars is not None and len(line) > max_line_chars:
                        raise json.JSONDecodeError(f"a line of {len(line):,} characters, longer than the "
                                                   f"{max_line_chars:,} a row may have; not read", "", 0)
                    try:
                        obj = json.loads(line)
                    except RecursionError:
                        raise json.JSONDecodeError("nested too deeply (arrays or objects inside each other "
                                                   "beyond what the JSON parser can follow)", "", 0) from None
                except json.JSONDecodeError as e:
                    if on_error is None:
                        raise InputError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
                    on_error(lineno, e)
                    continue
                yield lineno, obj
        except UnicodeDecodeError as e:
            raise InputError(f"{path}:{lineno + 1}: not UTF-8 text ({e.reason}); JSONL must be UTF-8") from None


def regular_file_problem(path: str | Path) -> str | None:
    """What `path` is when it is there but not a regular file (a FIFO, a socket, a device, a directory), for an
    InputError before it is opened: opening a FIFO without a writer blocks for ever (SIGTERM included) and a device
    reads without end. None for a regular file (a link to one too) and for nothing there (the open says so)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return None
    kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else
            "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else
            "a special file")
    return f"{kind}, not a regular file"


def describe_path(path: str | Path) -> str:
    """What is at `path`, for a message about an input that is not what a flag expects: "no such file or
    directory", "a directory of token shards (index.json of `entrenar data pack`)", "a directory (N entries:
    a, b, ...)" or "a file" (issue 38 item 10: `--data DIR` said "no such file" about a directory that exists)."""
    p = Path(path)
    if not p.exists():
        return "no such file or directory"
    if p.is_dir():
        if (p / "index.json").is_file():
            return "a directory of token shards (index.json of `entrenar data pack`)"
        try:
            names = sorted(e.name for e in p.iterdir())
        except OSError as e:
            return f"a directory that cannot be listed ({e.strerror})"
        shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        return f"a directory ({len(names)} entries: {shown})" if names else "an empty directory"
    return "a file" if p.is_file() else "not a regular file or directory"
