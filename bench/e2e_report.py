"""Helpers of bench/e2e_pretrain.sh (issue 24 part 5): the throughput calibration and the final report.

    python3 bench/e2e_report.py calibrate --run DIR --measure-steps 30 --train-seconds 225 \
        --tokens-per-step 16384 --out FILE.json -- python3 -m entrenar pretrain ... --steps 100000 ...
runs the given pretrain command, stops it with SIGTERM (entrenar's clean stop: exit 143, nothing saved) once
RUN/metrics.jsonl has --measure-steps steps, and writes {tok_s, steps, eval_every} for a run of
--train-seconds at that speed: the real command on the real GPU measures the speed that sets the step count.

    python3 bench/e2e_report.py report --work WORK --out OUT
reads what the stages left in WORK (stage timings, each command's --json line, the runs' metrics) and
writes OUT/summary.json, OUT/report.md (the tables) and OUT/small_greedy.json (what bench/e2e_gguf_check.py
compares llama.cpp with). A stage that failed or never ran is reported as such, never filled in.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

WARMUP_STEPS = 5  # the first steps include Triton compilation/autotuning and allocator warm-up
SMALL_GENERATIONS = ("final", "f16", "f32")  # `generate` of the small model's final/ and of its two GGUFs
TARGET_LOSSES = (8.0, 7.0, 6.0, 5.0, 4.5, 4.0, 3.5, 3.0, 2.75, 2.5, 2.25, 2.0, 1.75, 1.5, 1.25, 1.0)


# ---- small readers --------------------------------------------------------------------------------
def jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def last_json(path: Path) -> dict[str, Any] | None:
    """The command's --json line (the last stdout line that parses as an object), or None."""
    if not path.exists():
        return None
    for line in reversed(path.read_text().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def steady_tok_s(rows: list[dict[str, Any]]) -> float | None:
    steady = rows[WARMUP_STEPS:] or rows
    return statistics.median(r["tok_s"] for r in steady) if steady else None


# ---- calibrate ------------------------------------------------------------------------------------
def calibrate(a: argparse.Namespace) -> int:
    metrics = Path(a.run) / "metrics.jsonl"
    t0 = time.monotonic()
    proc = subprocess.Popen(a.command)
    stopped = False
    while proc.poll() is None:
        if len(jsonl(metrics)) >= a.measure_steps and not stopped:
            proc.send_signal(signal.SIGTERM)  # entrenar stops cleanly (exit 143) and writes nothing more
            stopped = True
        time.sleep(0.25)
    rows = jsonl(metrics)
    wall = time.monotonic() - t0
    if len(rows) < a.measure_steps:
        print(f"calibration: the pretrain command ended (exit {proc.returncode}) after {len(rows)} of "
              f"{a.measure_steps} steps", file=sys.stderr)
        return 1
    tok_s = steady_tok_s(rows[: a.measure_steps])
    wanted = int(a.train_seconds * tok_s / a.tokens_per_step)
    # what is left until the deadline at this speed (the stages before may have run long)
    fits = int(max(0.0, a.deadline - time.time()) * tok_s / a.tokens_per_step) if a.deadline else wanted
    steps = max(a.min_steps, min(a.max_steps, wanted, fits))
    result = {"tok_s": round(tok_s), "steps": steps, "eval_every": max(1, steps // a.evals),
              "steps_for_train_seconds": wanted, "steps_until_deadline": fits,
              "train_seconds_planned": a.train_seconds, "tokens_planned": steps * a.tokens_per_step,
              "measured_steps": len(rows), "wall_s": round(wall, 1), "exit_code": proc.returncode}
    Path(a.out).write_text(json.dumps(result) + "\n")
    print(json.dumps(result))
    return 0


# ---- report ---------------------------------------------------------------------------------------
def run_summary(run: Path, tokens_per_step: int) -> dict[str, Any] | None:
    """Numbers of one pretrain run directory (None when it never started)."""
    rows = jsonl(run / "metrics.jsonl")
    if not rows:
        return None
    evals = jsonl(run / "eval.jsonl")
    info = json.loads((run / "run.json").read_text()) if (run / "run.json").exists() else {}
    mfu = [r["mfu"] for r in rows[WARMUP_STEPS:] if r.get("mfu") is not None]
    step_seconds = sum(r["tokens"] / r["tok_s"] if i == 0 else (r["tokens"] - rows[i - 1]["tokens"]) / r["tok_s"]
                       for i, r in enumerate(rows) if r.get("tok_s"))
    cfg = info.get("config", {})
    return {
        "steps": rows[-1]["step"], "tokens_seen": rows[-1]["tokens"], "tokens_per_step": tokens_per_step,
        "parameters": (info.get("model") or {}).get("parameters"),
        "dtype": cfg.get("dtype"), "dtype_reason": cfg.get("dtype_reason"), "lr": cfg.get("lr"),
        "tok_s_median": round(steady_tok_s(rows)), "tok_s_mean_incl_warmup": round(rows[-1]["tokens"] / step_seconds),
        "mfu_median": round(statistics.median(mfu), 4) if mfu else None,
        "peak_mem_gib": round(max(r.get("mem_mb") or 0 for r in rows) / 1024, 2),
        "seconds_in_steps": round(step_seconds, 1),
        "train_loss_first": rows[0]["loss"],
        "train_loss_last10_mean": statistics.mean(r["loss"] for r in rows[-10:]),
        "val_curve": [{"step": e["step"], "tokens": e["step"] * tokens_per_step, "loss": e["loss"],
                       "ppl": e.get("ppl")} for e in evals],
        "final_dir": (run / "final").is_dir(),
        "versions": info.get("versions"), "git_commit": info.get("git_commit"),
        "cuda_device": (info.get("host") or {}).get("cuda_device"),
    }


def target_table(curve: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each target loss the curve reaches: the tokens of the first eval at or below it."""
    table = []
    start = curve[0]["loss"] if curve and curve[0]["step"] == 0 else math.inf
    for target in (t for t in TARGET_LOSSES if t < start):
        hit = next((p for p in curve if p["step"] > 0 and p["loss"] is not None and p["loss"] <= target), None)
        if hit is not None:
            table.append({"target_loss": target, "tokens": hit["tokens"], "step": hit["step"], "loss": hit["loss"]})
    return table


def bits_per_byte(loss: float | None, tokens: int | None, nbytes: int | None) -> float | None:
    if loss is None or not tokens or not nbytes:
        return None
    return loss / math.log(2) * tokens / nbytes


def stage_table(work: Path) -> list[dict[str, Any]]:
    return jsonl(work / "stages.jsonl")


def generation(path: Path, prompt: str) -> dict[str, Any]:
    j = last_json(path)
    if j is None or not j.get("ok", True) or "token_ids" not in j:
        return {"prompt": prompt, "ok": False, "error": (j or {}).get("error", "no output")}
    return {"prompt": prompt, "ok": True, "text": j["text"], "token_ids": j["token_ids"],
            "stop_reason": j["stop_reason"], "tokens_per_s": j.get("tokens_per_s")}


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def report(a: argparse.Namespace) -> int:
    work, out = Path(a.work), Path(a.out)
    plan = json.loads((work / "plan.json").read_text())
    prompts = plan["prompts"]
    logs = work / "logs"
    manifest = json.loads((work / "corpus" / "manifest.json").read_text()) if (work / "corpus" / "manifest.json").exists() else None
    tok = last_json(logs / "tokenizer.out")
    pack = last_json(logs / "pack_train.out")
    pack_held = last_json(logs / "pack_heldout.out")
    calib = json.loads((work / "calib.json").read_text()) if (work / "calib.json").exists() else None

    main = run_summary(work / "run_main", plan["main"]["tokens_per_step"])
    small = run_summary(work / "run_small", plan["small"]["tokens_per_step"])
    held_bytes = manifest["heldout"]["bytes"] if manifest else None
    held_tokens = pack_held["tokens"] if pack_held and pack_held.get("ok") else None
    train_bytes = manifest["train"]["bytes"] if manifest else None
    train_tokens = pack["tokens"] if pack and pack.get("ok") else None

    def held_eval(name: str) -> dict[str, Any] | None:
        j = last_json(logs / f"{name}.out")
        if j is None:
            return None
        if not j.get("ok", True):
            return {"ok": False, "error": j.get("error")}
        loss = j.get("loss")
        return {"ok": True, "loss": loss, "ppl": j.get("ppl") or j.get("perplexity"), "tokens": j.get("tokens"),
                "bits_per_byte": bits_per_byte(loss, held_tokens, held_bytes)}

    samples = [generation(logs / f"gen_main_{i}.out", p) for i, p in enumerate(prompts)]
    main_gguf = last_json(logs / "export_main.out")
    fp32_final = generation(logs / "gen_main_fp32_final.out", prompts[0])
    fp32_gguf = generation(logs / "gen_main_fp32_gguf.out", prompts[0])
    small_gen = {kind: [generation(logs / f"gen_small_{kind}_{i}.out", p) for i, p in enumerate(prompts)]
                 for kind in SMALL_GENERATIONS}

    def same_tokens(x: dict[str, Any], y: dict[str, Any]) -> dict[str, Any]:
        if not (x["ok"] and y["ok"]):
            return {"compared": False}
        d = first_difference(x["token_ids"], y["token_ids"])
        return {"compared": True, "identical": d is None, "first_difference": d, "tokens": len(x["token_ids"])}

    summary = {
        "issue": "24 part 5: tokenizer train -> data pack -> pretrain -> eval -> generate -> export gguf",
        "device": plan.get("device_name"), "mode": plan["mode"], "plan": plan,
        "stages": stage_table(work),
        "corpus": manifest,
        "tokenizer": tok, "pack_train": pack, "pack_heldout": pack_held,
        "bytes_per_token": {"train": train_bytes / train_tokens if train_bytes and train_tokens else None,
                            "heldout": held_bytes / held_tokens if held_bytes and held_tokens else None},
        "calibration": calib,
        "main": {"model": plan["main"]["model"], "run": main, "pretrain_json": last_json(logs / "pretrain_main.out"),
                 "eval_heldout": held_eval("eval_main"),
                 "target_loss_table": target_table(main["val_curve"]) if main else [],
                 "samples_greedy": samples,
                 "gguf": main_gguf,
                 "gguf_vs_final_greedy_fp32": {"final": fp32_final, "gguf": fp32_gguf,
                                               **same_tokens(fp32_final, fp32_gguf)}},
        "small": {"model": plan["small"]["model"], "run": small, "pretrain_json": last_json(logs / "pretrain_small.out"),
                  "eval_heldout": held_eval("eval_small"),
                  "gguf": {t: last_json(logs / f"export_small_{t}.out") for t in ("f16", "f32")},
                  "greedy_final": small_gen["final"],
                  "greedy_final_vs": {t: [same_tokens(f, g) for f, g in zip(small_gen["final"], small_gen[t])]
                                      for t in ("f16", "f32")}},
        "main_metrics": jsonl(work / "run_main" / "metrics.jsonl"),
    }
    if main and main["val_curve"]:
        last = main["val_curve"][-1]
        summary["main"]["final_val_bits_per_byte"] = bits_per_byte(last["loss"], train_tokens, train_bytes)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_small_greedy(out, work, plan, small_gen)
    (out / "report.md").write_text(markdown(summary))
    print((out / "report.md").read_text())
    return 0


def write_small_greedy(out: Path, work: Path, plan: dict[str, Any], gens: dict[str, list[dict]]) -> None:
    """What the CPU-side llama.cpp check needs besides the GGUFs and tokenizer.json: the prompts, the prompt ids
    our tokenizer gives, the stop ids, the tokenizer's config and the greedy tokens of each `generate` run
    (final/, small-f16.gguf, small-f32.gguf)."""
    tok_dir = work / "tokenizer"
    prompt_ids: list[list[int] | None] = [None] * len(plan["prompts"])
    stop_ids: list[int] | None = None
    if (tok_dir / "tokenizer.json").exists():
        from entrenar.tokenizer import load_tokenizer

        tok = load_tokenizer(str(tok_dir))
        prompt_ids = [tok.encode(p) for p in plan["prompts"]]
        stop_ids = sorted(tok.stop_ids)
    config = tok_dir / "tokenizer_config.json"
    data = {"model": plan["small"]["model"], "device": plan.get("device_name"),
            "generate_flags": plan["small"]["generate_flags"], "stop_ids": stop_ids,
            "tokenizer_config": json.loads(config.read_text()) if config.exists() else None,
            "gguf": {t: f"small-{t}.gguf" for t in ("f16", "f32")},
            "prompts": [{"prompt": p, "prompt_ids": ids, **{kind: gens[kind][i] for kind in SMALL_GENERATIONS}}
                        for i, (p, ids) in enumerate(zip(plan["prompts"], prompt_ids))]}
    (out / "small_greedy.json").write_text(json.dumps(data, indent=2) + "\n")


def fmt(x: Any, spec: str = "") -> str:
    if x is None:
        return "–"
    return format(x, spec) if spec else str(x)


def same_text(cmp: dict[str, Any]) -> str:
    if not cmp.get("compared"):
        return "not compared (a generate failed)"
    if cmp["identical"]:
        return f"identical ({cmp['tokens']} tokens)"
    return f"DIFFERENT from token {cmp['first_difference']} of {cmp['tokens']}"


def markdown(s: dict[str, Any]) -> str:
    lines = [f"# Issue 24 part 5: end to end from scratch ({s['mode']}, {s['device']})", ""]
    lines += ["| stage | wall s | exit | limit s |", "|---|---:|---:|---:|"]
    lines += [f"| {st['stage']} | {fmt(st.get('seconds'))} | {fmt(st.get('rc'))} | {fmt(st.get('limit_s'))} |"
              for st in s["stages"]]
    c = s["corpus"]
    if c:
        lines += ["", (f"Corpus: {c['train']['files']} training files of {c['train']['packages']} packages "
                       f"({c['train']['bytes'] / 2**20:.1f} MiB), held out whole: {', '.join(c['heldout_packages'])} "
                       f"({c['heldout']['files']} files, {c['heldout']['bytes'] / 2**20:.2f} MiB).")]
    for key in ("main", "small"):
        m = s[key]
        r = m["run"]
        lines += ["", f"## {key}: {m['model']}", ""]
        if r is None:
            lines.append("no training step ran")
            continue
        held = m.get("eval_heldout") or {}
        lines += ["| what | value |", "|---|---|",
                  f"| parameters | {fmt(r['parameters'], ',')} |",
                  f"| dtype | {r['dtype']} |",
                  f"| steps, tokens seen | {r['steps']:,}, {r['tokens_seen']:,} |",
                  f"| tokens/s (median, steps {WARMUP_STEPS + 1}+) | {r['tok_s_median']:,} |",
                  f"| MFU (median) | {fmt(r['mfu_median'])} |",
                  f"| peak memory GiB | {r['peak_mem_gib']} |",
                  f"| train loss | {r['train_loss_first']:.4f} -> {r['train_loss_last10_mean']:.4f} (last 10 steps) |",
                  "| val loss (same packages, unseen files) | "
                  + " -> ".join(f"{p['loss']:.3f}" for p in r["val_curve"]) + " |",
                  (f"| held-out packages: loss (bits/byte) | {fmt(held.get('loss'), '.4f')} "
                   f"({fmt(held.get('bits_per_byte'), '.3f')}) |")]
        if key == "main" and m["target_loss_table"]:
            lines += ["", ("Target validation loss (files of the training packages not trained on) and the tokens "
                           "after which this run first reached it (one cosine schedule over the whole run: a run "
                           "planned for fewer tokens decays earlier and reaches each target sooner):"), "",
                      "| target loss | tokens | step | val loss there |", "|---:|---:|---:|---:|"]
            lines += [f"| {t['target_loss']} | {t['tokens']:,} | {t['step']} | {t['loss']:.3f} |"
                      for t in m["target_loss_table"]]
            lines += ["", "| step | tokens | val loss |", "|---:|---:|---:|"]
            lines += [f"| {p['step']} | {p['tokens']:,} | {p['loss']:.4f} |" for p in r["val_curve"]]
        if key == "main":
            lines += ["", "Greedy samples (`entrenar generate`, default dtype):", ""]
            for g in m["samples_greedy"]:
                lines += [f"- prompt {g['prompt']!r}: " + (repr(g["text"])[:400] if g["ok"] else f"FAILED {g['error']}")]
            cmp = m["gguf_vs_final_greedy_fp32"]
            lines += ["", (f"GGUF f16 export: {fmt((m['gguf'] or {}).get('bytes'), ',')} bytes in "
                           f"{fmt((m['gguf'] or {}).get('seconds'))} s; `generate --dtype fp32` of final/ and of the "
                           f"GGUF, first prompt: {same_text(cmp)}")]
        else:
            sizes = ", ".join(f"small-{t}.gguf {fmt((j or {}).get('bytes'), ',')} bytes" for t, j in m["gguf"].items())
            lines += ["", f"GGUF exports: {sizes}. `generate --dtype fp32` of final/ vs of each GGUF:", ""]
            for i, prompt in enumerate(s["plan"]["prompts"]):
                final = s["small"]["greedy_final"][i]
                lines.append(f"- {prompt!r}: f16 {same_text(m['greedy_final_vs']['f16'][i])}, f32 "
                             f"{same_text(m['greedy_final_vs']['f32'][i])}; final/: "
                             + (repr(final["text"])[:200] if final["ok"] else f"FAILED {final['error']}"))
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("calibrate")
    c.add_argument("--run", required=True)
    c.add_argument("--measure-steps", type=int, default=30)
    c.add_argument("--train-seconds", type=float, required=True)
    c.add_argument("--tokens-per-step", type=int, required=True)
    c.add_argument("--min-steps", type=int, default=20)
    c.add_argument("--max-steps", type=int, default=100_000)
    c.add_argument("--deadline", type=float, default=0.0,
                   help="epoch seconds by which the training steps must be done (0: none)")
    c.add_argument("--evals", type=int, default=10, help="evals over the run (--eval-every = steps // this)")
    c.add_argument("--out", required=True)
    c.add_argument("command", nargs=argparse.REMAINDER)
    r = sub.add_parser("report")
    r.add_argument("--work", required=True)
    r.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.cmd == "calibrate":
        a.command = a.command[1:] if a.command[:1] == ["--"] else a.command
        return calibrate(a)
    return report(a)


if __name__ == "__main__":
    sys.exit(main())
