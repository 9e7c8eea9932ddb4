"""Issue 27 part 4 (CPU): a preference data set from the repository's own source, and a LoRA DPO run on the packaged
SmolLM2 that must raise the held-out pairs' accuracy above 0.5.

    python bench/dpo_from_code.py --out /tmp/dpo-code            # build the pairs, train, print the summary JSON
    python bench/dpo_from_code.py --out /tmp/dpo-code --build-only

Pairs: `entrenar data sft-from-code` rows of src/entrenar (the user gives a signature + docstring, the assistant
answers with the function); chosen = the real function, rejected = the same function corrupted in one of three
ways, in turn: two adjacent body lines of the same indentation swapped, one operator inverted (== / !=, < / >=,
+ / -, and / or, in / not in, ...), or the body's second half cut off. Only short functions are kept (prompt +
response within --max-seq-len tokens of SmolLM2's template), so a CPU run is minutes. Held-out pairs (--heldout)
are drawn first from a seeded shuffle and never trained on; `--val` makes them the eval set, so eval.jsonl's
rewards/accuracies is the held-out accuracy (0 at step 0: every margin is exactly 0 there).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OPERATORS = [(" == ", " != "), (" != ", " == "), (" < ", " >= "), (" > ", " <= "), (" <= ", " > "), (" >= ", " < "),
             (" + ", " - "), (" - ", " + "), (" and ", " or "), (" or ", " and "), (" not in ", " in "),
             (" is not ", " is "), (" is None", " is not None")]


def body_lines(source: str) -> tuple[list[str], int]:
    """The function's lines and the index of its first body line after the docstring."""
    lines = source.splitlines(keepends=True)
    fn = ast.parse(source).body[0]
    first = fn.body[1].lineno if len(fn.body) > 1 else len(lines)
    first -= 1
    decorators = min([fn.lineno, *(d.lineno for d in fn.decorator_list)]) - 1
    return lines, first - decorators


def swap_lines(source: str, rng: random.Random) -> str | None:
    lines, start = body_lines(source)
    indent = [len(line) - len(line.lstrip()) for line in lines]
    pairs = [i for i in range(start, len(lines) - 1)
             if lines[i].strip() and lines[i + 1].strip() and indent[i] == indent[i + 1] and lines[i] != lines[i + 1]
             and not lines[i].lstrip().startswith(("return", "elif", "else", "except", "finally"))]
    if not pairs:
        return None
    i = rng.choice(pairs)
    lines[i], lines[i + 1] = lines[i + 1], lines[i]
    return "".join(lines)


def invert_operator(source: str, rng: random.Random) -> str | None:
    lines, start = body_lines(source)
    body = "".join(lines[start:])
    found = [(m.start(), a, b) for a, b in OPERATORS for m in re.finditer(re.escape(a), body)]
    if not found:
        return None
    at, a, b = rng.choice(sorted(found))
    return "".join(lines[:start]) + body[:at] + b + body[at + len(a):]


def truncate(source: str, rng: random.Random) -> str | None:
    lines, start = body_lines(source)
    n = len(lines) - start
    if n < 2:
        return None
    return "".join(lines[:start + max(1, n // 2)])


CORRUPTIONS = {"swap": swap_lines, "operator": invert_operator, "truncate": truncate}


def build(out: Path, max_seq_len: int, heldout: int, train: int, seed: int) -> dict:
    from entrenar.data.from_code import sft_from_code
    from entrenar.tokenizer import load_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    sft = out / "sft.jsonl"
    sft_from_code([str(REPO / "src" / "entrenar")], sft, overwrite=True)
    tok = load_tokenizer("smollm2-135m-instruct")
    rng = random.Random(seed)
    pairs, kinds = [], list(CORRUPTIONS)
    for i, line in enumerate(sft.read_text().splitlines()):
        row = json.loads(line)
        prompt, answer = row["messages"][:-1], row["messages"][-1]["content"]
        for k in range(len(kinds)):  # the i-th row's corruption in turn, else the next that applies
            kind = kinds[(i + k) % len(kinds)]
            try:
                bad = CORRUPTIONS[kind](answer, rng)
            except SyntaxError:
                bad = None
            if bad is not None and bad.strip() != answer.strip():
                break
        else:
            continue
        longest = max(len(tok.encode_chat([*prompt, {"role": "assistant", "content": text}]).ids)
                      for text in (answer, bad))
        if longest <= max_seq_len:
            pairs.append({"prompt": prompt, "chosen": answer, "rejected": bad, "corruption": kind,
                          "source": row["source"]})
    rng.shuffle(pairs)
    held, rest = pairs[:heldout], pairs[heldout:heldout + train]
    for name, rows in (("heldout", held), ("train", rest)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    counts = {k: sum(r["corruption"] == k for r in pairs) for k in CORRUPTIONS}
    return {"pairs": len(pairs), "heldout": len(held), "train": len(rest), "corruptions": counts}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--heldout", type=int, default=40)
    p.add_argument("--train", type=int, default=400)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", default="1e-4")
    p.add_argument("--beta", default="0.1")
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--build-only", action="store_true")
    args = p.parse_args(argv)
    sys.path[:0] = [str(REPO / "src")]
    data = build(args.out, args.max_seq_len, args.heldout, args.train, args.seed)
    print(json.dumps({"data": data}), flush=True)
    if args.build_only:
        return 0
    run = args.out / "run"
    cmd = [sys.executable, "-m", "entrenar", "finetune", "--model", "smollm2-135m-instruct", "--data",
           str(args.out / "train.jsonl"), "--val", str(args.out / "heldout.jsonl"), "--out", str(run),
           "--objective", "dpo", "--beta", args.beta, "--mode", "lora", "--steps", str(args.steps), "--batch-size",
           str(args.batch_size), "--max-seq-len", str(args.max_seq_len), "--lr", args.lr, "--eval-every",
           str(args.eval_every), "--eval-batches", "0", "--seed", str(args.seed), "--device", "cpu", "--json"]
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, check=False, text=True, stdout=subprocess.PIPE, env=env)
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()] if run.is_dir() else []
    summary = {"command": " ".join(cmd[2:]), "exit_code": proc.returncode, "seconds": round(time.perf_counter() - t0),
               "heldout_accuracy": [(e["step"], round(e["rewards/accuracies"], 4)) for e in evals],
               "heldout_loss": [(e["step"], round(e["loss"], 5)) for e in evals],
               "heldout_margin": [(e["step"], round(e["rewards/margins"], 5)) for e in evals], "data": data}
    print(json.dumps(summary), flush=True)
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())
