"""The corpus of the end-to-end run (issue 24 part 5): the .py files of the Python installed on this machine.

Whole packages are held out for validation: no file of a held-out package (nor a vendored copy of it under
another package, nor a byte-identical copy anywhere) is in the training set. The training files are an
even sample of every other package (files in a seeded hash order, up to --train-mb), so no single big
package (torch, transformers) fills the budget alone; the tokenizer is trained on a prefix of that same
order (--tok-mb), never on held-out code.

    python3 bench/e2e_corpus.py --out DIR [--train-mb 150] [--tok-mb 60] [--heldout jinja2,fsspec,...]

writes DIR/train/..., DIR/heldout/... (each file at its path under site-packages, or under stdlib/ for the
standard library), DIR/tok/... (hard links to files of train/) and
DIR/manifest.json (roots, packages per split with files and bytes, what was skipped and why).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import site
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

# Pure-Python packages that torch / transformers pull in, so one of them is on any machine that trains;
# the first --n-heldout present are held out (jinja2: templates; fsspec: file systems; huggingface_hub:
# an HTTP client library) unless --heldout names them.
HELDOUT_CANDIDATES = ("jinja2", "fsspec", "huggingface_hub", "networkx", "filelock", "packaging", "requests",
                      "urllib3", "yaml", "idna", "markupsafe", "certifi", "tqdm")
SKIP_TOP = {"site-packages", "dist-packages", "__pycache__", "entrenar"}  # other roots; our own code
MAX_FILE_BYTES = 1 << 20  # bigger .py files are generated tables (unicode data, sympy's benchmarks), not code


@dataclass
class Package:
    name: str
    files: list[tuple[Path, str]] = field(default_factory=list)  # (absolute path, path inside the package tree)


def roots() -> list[tuple[str, Path]]:
    """(label, directory) of every place this interpreter imports installed code from, each real dir once."""
    found: list[tuple[str, Path]] = []
    paths = list(site.getsitepackages())
    user = site.getusersitepackages()
    if isinstance(user, str):
        paths.append(user)
    paths += [sysconfig.get_paths()[k] for k in ("purelib", "platlib")]
    seen: set[Path] = set()
    for label, p in [("stdlib", sysconfig.get_paths()["stdlib"])] + [("site", p) for p in paths]:
        real = Path(p).resolve()
        if real.is_dir() and real not in seen:
            seen.add(real)
            found.append((label, real))
    return found


def packages(label: str, root: Path) -> dict[str, Package]:
    """Top-level packages (directories) and single modules (.py files) of one root; each file with its
    path under the corpus directory (its path in the root, under stdlib/ for the standard library)."""
    out: dict[str, Package] = {}
    prefix = "stdlib/" if label == "stdlib" else ""
    for entry in sorted(root.iterdir()):
        name = entry.name
        if name in SKIP_TOP or name.endswith((".dist-info", ".egg-info", ".data")) or name.startswith("."):
            continue
        key = name.removesuffix(".py")
        key = f"stdlib.{key}" if label == "stdlib" else key
        pkg = out.setdefault(key, Package(key))
        if entry.is_file() and name.endswith(".py"):
            pkg.files.append((entry, prefix + name))
        elif entry.is_dir():
            for dirpath, dirnames, filenames in os.walk(entry):
                dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
                for f in sorted(filenames):
                    if f.endswith(".py"):
                        p = Path(dirpath) / f
                        pkg.files.append((p, prefix + p.relative_to(root).as_posix()))
    return {k: v for k, v in out.items() if v.files}


def read_code(path: Path, skipped: dict[str, int]) -> bytes | None:
    """The file's bytes if it is a UTF-8 .py file worth training on, else None (counted by reason)."""
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            skipped["over_1MiB"] = skipped.get("over_1MiB", 0) + 1
            return None
        data = path.read_bytes()
        data.decode("utf-8")
    except UnicodeDecodeError:
        skipped["not_utf8"] = skipped.get("not_utf8", 0) + 1
        return None
    except OSError:
        skipped["unreadable"] = skipped.get("unreadable", 0) + 1
        return None
    if not data.strip():
        skipped["empty"] = skipped.get("empty", 0) + 1
        return None
    return data


def pick_heldout(all_pkgs: dict[str, Package], wanted: list[str], n: int) -> list[str]:
    """The named held-out packages (each must exist), or the first n candidates present."""
    if wanted:
        missing = [w for w in wanted if w not in all_pkgs]
        if missing:
            sys.exit(f"--heldout {','.join(missing)}: not installed here; present: {', '.join(sorted(all_pkgs))}")
        return wanted
    chosen = [c for c in HELDOUT_CANDIDATES if c in all_pkgs][:n]
    if len(chosen) < min(n, 2):
        sys.exit(f"fewer than 2 of the held-out candidates {HELDOUT_CANDIDATES} are installed: name some with --heldout")
    return chosen


def order_key(seed: int, rel: str) -> bytes:
    return hashlib.blake2b(rel.encode(), digest_size=8, key=str(seed).encode()).digest()


def write(dst: Path, data: bytes) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(data)


def build(out: Path, train_mb: float, tok_mb: float, heldout_mb: float, heldout: list[str], n_heldout: int,
          only: list[str], seed: int, found_roots: list[tuple[str, Path]] | None = None) -> dict:
    """Write the corpus under `out` from `found_roots` (default: this interpreter's); returns the manifest."""
    found_roots = roots() if found_roots is None else found_roots
    all_pkgs: dict[str, Package] = {}
    for label, root in found_roots:
        for k, pkg in packages(label, root).items():
            all_pkgs.setdefault(k, pkg)  # the first root wins (stdlib before site-packages)
    held = pick_heldout(all_pkgs, heldout, n_heldout)
    train_names = [k for k in all_pkgs if k not in held and (not only or k in only)]
    if only and not train_names:
        sys.exit(f"--only {','.join(only)}: none of them is installed")
    skipped: dict[str, int] = {}
    shutil.rmtree(out, ignore_errors=True)

    # held-out files first: their bytes mark copies that must not reach training
    held_hashes: set[bytes] = set()
    held_stats: dict[str, dict[str, int]] = {}
    held_budget = int(heldout_mb * 2**20)
    held_files = sorted((order_key(seed, rel), p.name, path, rel) for p in (all_pkgs[h] for h in held)
                        for path, rel in p.files)
    for _, name, path, rel in held_files:
        data = read_code(path, skipped)
        if data is None:
            continue
        held_hashes.add(hashlib.sha256(data).digest())
        if held_budget <= 0:
            continue  # over the cap: not written, still kept out of training
        held_budget -= len(data)
        write(out / "heldout" / rel, data)
        s = held_stats.setdefault(name, {"files": 0, "bytes": 0})
        s["files"] += 1
        s["bytes"] += len(data)

    held_parts = set(held) | {h.split(".")[-1] for h in held}
    candidates = sorted((order_key(seed, rel), k, path, rel) for k in train_names
                        for path, rel in all_pkgs[k].files)
    budget, tok_budget = int(train_mb * 2**20), int(tok_mb * 2**20)
    train_stats: dict[str, dict[str, int]] = {}
    seen: set[bytes] = set()
    tok_files = tok_bytes = 0
    excluded = {"vendored_heldout": 0, "copy_of_heldout": 0, "duplicate": 0}
    for _, name, path, rel in candidates:
        if budget <= 0:
            break
        if held_parts & set(Path(rel).parts[1:-1]):  # e.g. pip/_vendor/<held-out package>/...
            excluded["vendored_heldout"] += 1
            continue
        data = read_code(path, skipped)
        if data is None:
            continue
        digest = hashlib.sha256(data).digest()
        if digest in held_hashes:
            excluded["copy_of_heldout"] += 1
            continue
        if digest in seen:
            excluded["duplicate"] += 1
            continue
        seen.add(digest)
        budget -= len(data)
        dst = out / "train" / rel
        write(dst, data)
        s = train_stats.setdefault(name, {"files": 0, "bytes": 0})
        s["files"] += 1
        s["bytes"] += len(data)
        if tok_bytes < tok_budget:  # the tokenizer's corpus: a prefix of the same even sample
            tok_dst = out / "tok" / rel
            tok_dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(dst, tok_dst)
            except OSError:
                shutil.copyfile(dst, tok_dst)
            tok_files += 1
            tok_bytes += len(data)
    assert not set(train_stats) & set(held_stats), "a held-out package reached the training set"

    def total(stats: dict[str, dict[str, int]]) -> dict[str, int]:
        return {"packages": len(stats), "files": sum(s["files"] for s in stats.values()),
                "bytes": sum(s["bytes"] for s in stats.values())}

    manifest = {
        "python": sys.version.split()[0], "roots": [f"{label}: {p}" for label, p in found_roots], "seed": seed,
        "heldout_packages": held, "heldout": {**total(held_stats), "per_package": held_stats},
        "train": {**total(train_stats), "cap_bytes": int(train_mb * 2**20), "exhausted": budget > 0,
                  "largest": dict(sorted(train_stats.items(), key=lambda kv: -kv[1]["bytes"])[:12])},
        "tokenizer_corpus": {"files": tok_files, "bytes": tok_bytes},
        "excluded_from_train": excluded, "skipped": skipped,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--train-mb", type=float, default=150.0, help="cap on the training files' bytes (MiB)")
    ap.add_argument("--tok-mb", type=float, default=60.0, help="the tokenizer's share of them (MiB)")
    ap.add_argument("--heldout-mb", type=float, default=8.0, help="cap on the held-out files written (MiB)")
    ap.add_argument("--heldout", default="", help="comma-separated packages to hold out (default: candidates)")
    ap.add_argument("--n-heldout", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated training packages (a small dry run)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    def names(s: str) -> list[str]:
        return [x for x in s.split(",") if x]

    m = build(a.out, a.train_mb, a.tok_mb, a.heldout_mb, names(a.heldout), a.n_heldout, names(a.only), a.seed)
    print(f"corpus: train {m['train']['packages']} packages, {m['train']['files']} files, "
          f"{m['train']['bytes'] / 2**20:.1f} MiB; tokenizer {m['tokenizer_corpus']['bytes'] / 2**20:.1f} MiB; "
          f"held out {', '.join(m['heldout_packages'])}: {m['heldout']['files']} files, "
          f"{m['heldout']['bytes'] / 2**20:.2f} MiB; excluded {m['excluded_from_train']}; skipped {m['skipped']}")


if __name__ == "__main__":
    main()
