"""The benchmark suite's entry point: `python -m bench` (from a checkout's root).

    python -m bench --list                          scenarios and groups
    python -m bench run issue25-speed               a group (or scenario names, several at once)
    python -m bench run q05-cli-default --smoke     tiny shapes on the CPU, 3 steps: checks the plumbing

Each run writes bench/results/<UTC date>-<host>-<card>/ (or --out): one JSON per row (bench/rows.py's schema),
run.json (the environment and the command) and table.md. Rows are written as they finish, and the table
after each, so a run stopped by a time limit keeps what it measured. Exit 0 when no row failed (skipped
rows are not failures), 1 otherwise, 2 for an unknown scenario.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import rows as R
from bench.cli_run import run_cli
from bench.peers import run_engine, run_generate, run_peer
from bench.scenarios import GROUPS, SCENARIOS, Scenario, resolve

RESULTS = R.REPO / "bench" / "results"


@dataclass
class Context:
    """What every scenario's runner gets: the run's environment, a scratch directory and the device."""

    env: dict[str, Any]
    work: Path
    smoke: bool
    device: str  # the CLI's --device: cuda, or cpu in --smoke / on a machine without a GPU
    gpus: int

    def row(self, sc: Scenario, **values: Any) -> dict[str, Any]:
        return R.new_row(sc, self.env, **values)


def run_scenario(sc: Scenario, ctx: Context) -> list[dict[str, Any]]:
    """The scenario's rows; a runner that raises gives one failed row with its traceback's end."""
    if ctx.smoke:
        sc = sc.smoke()
    t0 = time.perf_counter()
    try:
        if sc.kind == "cli":
            return run_cli(sc, ctx)
        if sc.kind == "generate":
            return run_generate(sc, ctx)
        if sc.kind == "engine":
            return run_engine(sc, ctx)
        return run_peer(sc, ctx)
    except Exception as e:  # noqa: BLE001 -- a broken runner is a failed row; the other scenarios still run
        tail = traceback.format_exc().strip().splitlines()[-4:]
        return [ctx.row(sc, status="failed", reason=f"{type(e).__name__}: {e} | " + " | ".join(tail),
                        wall_s=time.perf_counter() - t0)]


def list_text() -> str:
    out = ["scenarios:"]
    for sc in SCENARIOS.values():
        gpus = f", {sc.gpus} GPUs" if sc.gpus > 1 else ""
        out.append(f"  {sc.name:<22} {sc.runner:<22} {sc.model} {sc.dtype} {sc.batch}x{sc.seq}{gpus}: {sc.title}")
    out.append("groups:")
    out += [f"  {g:<22} {' '.join(names)}" for g, names in GROUPS.items()]
    return "\n".join(out)


def repeated(scenarios: list[Scenario], repeat: int) -> list[tuple[Scenario, str]]:
    """(scenario, row suffix) for `repeat` rounds of the scenarios in order, round after round (a drift of the
    machine then touches every scenario alike); rounds after the first name their rows NAME-r2, NAME-r3, ... and
    run without --profile (the first round's profile says where the step goes; its trace costs seconds a row)."""
    return [(sc if r == 0 else unprofiled(sc), "" if r == 0 else f"-r{r + 1}") for r in range(repeat)
            for sc in scenarios]


def unprofiled(sc: Scenario) -> Scenario:
    """`sc` without its --profile START:COUNT flags (a CLI row's) or profiled steps (the Liger peer's)."""
    flags = list(sc.flags)
    if "--profile" in flags:
        i = flags.index("--profile")
        del flags[i:i + 2]
    params = {k: v for k, v in sc.params.items() if k != "profile_steps"}
    return dataclasses.replace(sc, flags=tuple(flags), params=params)


def run(names: list[str], *, smoke: bool, out: Path | None, work: Path | None, argv: list[str],
        budget_s: float | None = None, repeat: int = 1) -> Path:
    scenarios = resolve(names)
    probe = {"device": "cpu", "gpus": 0} if smoke else R.probe_device()
    env = {"device": probe["device"], "gpus": probe["gpus"], "versions": R.package_versions(),
           "commit": R.git_commit(), "smoke": smoke, "started_utc": R.utc_now(),
           "command": shlex.join(["python", "-m", "bench", *argv]), "scenarios": [s.name for s in scenarios]}
    folder = out or R.run_folder(RESULTS, env["device"])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "run.json").write_text(json.dumps(env, indent=1) + "\n")
    scratch = work or Path(tempfile.mkdtemp(prefix="entrenar-bench-"))
    ctx = Context(env=env, work=scratch, smoke=smoke, device="cuda" if probe["gpus"] and not smoke else "cpu",
                  gpus=probe["gpus"])
    done: list[dict[str, Any]] = []
    t0 = time.monotonic()
    try:
        for sc, suffix in repeated(scenarios, repeat):
            left = None if budget_s is None else budget_s - (time.monotonic() - t0)
            if left is not None and left < 30:  # the device call's limit: what is left is said, not cut off
                rows = [ctx.row(sc, status="skipped", reason=f"--budget-s {budget_s:.0f} spent ({left:.0f} s left)")]
            else:
                if left is not None and left < sc.timeout_s:
                    sc = dataclasses.replace(sc, timeout_s=left - 20)
                print(f"[bench] {sc.name} ...", file=sys.stderr, flush=True)
                rows = run_scenario(sc, ctx)
            for row in rows:
                if suffix:  # a later round: its own row, compared with its round's baseline
                    row["row"] += suffix
                    row["baseline"] = row["baseline"] and row["baseline"] + suffix
                R.write_row(folder, row)
                done.append(row)
                shown = f"{row['tokens_per_s']:,.0f} tok/s" if row["tokens_per_s"] else row["reason"][:200]
                print(f"[bench] {row['row']}: {row['status']} {shown} ({row['wall_s']:.0f} s)", file=sys.stderr,
                      flush=True)
            (folder / "table.md").write_text(R.table(done, env))
    finally:
        if work is None and not os.environ.get("BENCH_KEEP_WORK"):
            shutil.rmtree(scratch, ignore_errors=True)
    return folder


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="python -m bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="print the scenarios and groups")
    sub = ap.add_subparsers(dest="cmd")
    r = sub.add_parser("run", help="run scenarios and/or groups")
    r.add_argument("names", nargs="+", help="scenario or group names (--list)")
    r.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, 3 steps (checks the plumbing)")
    r.add_argument("--out", type=Path, default=None,
                   help="results folder (default bench/results/<UTC date>-<host>-<card>/)")
    r.add_argument("--budget-s", type=float, default=None,
                   help="wall seconds for the whole run: a scenario gets at most what is left (minus 20 s), and "
                        "once less than 30 s is left the rest are skipped rows saying so (e.g. 540 in a 10-minute "
                        "device call)")
    r.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="run the scenarios N times, round after round (rows of later rounds are NAME-r2, ...); "
                        "table.md adds the median of each scenario's rounds")
    r.add_argument("--work", type=Path, default=None, help="scratch folder for shards and run directories "
                   "(default: a temporary one, removed at the end unless BENCH_KEEP_WORK=1)")
    args = ap.parse_args(argv)
    if args.list or args.cmd is None:
        print(list_text())
        return 0
    try:
        if args.repeat < 1:
            ap.error(f"--repeat must be >= 1, got {args.repeat}")
        folder = run(args.names, smoke=args.smoke, out=args.out, work=args.work, argv=argv, budget_s=args.budget_s,
                     repeat=args.repeat)
    except KeyError as e:
        print(f"unknown scenario or group {e}; `python -m bench --list` names them", file=sys.stderr)
        return 2
    rows = R.read_rows(folder)
    print((folder / "table.md").read_text())
    print(f"results: {folder}")
    return 1 if any(r["status"] == "failed" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
