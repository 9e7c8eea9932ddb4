"""How a 2-rank gloo job (torchrun, CPU) ends when it does not finish (issue 28 item 5, issue 29):

  - while it runs, a second writer on its directory is refused (exit 2) naming rank 0 and its launcher;
  - its launcher SIGKILLed: the workers are gone within WORKERS_GONE_S, and `--resume auto` starts at once
    (the run directory's lock went with them);
  - Ctrl-C (SIGINT to the launcher, as a terminal sends it): ONE JSON line (rank 0's), exit 130, and a
    resume command that is the torchrun command, which then finishes the run bit-identical to an
    uninterrupted one;
  - a rank SIGKILLed (the OOM killer's way): the survivor names the lost rank, the last complete checkpoint
    and the resume command, exit 4 (rank 1 speaks when rank 0 is the one lost);
  - SIGTERM to the launcher (docker stop, SLURM): as Ctrl-C, exit 143;
  - a guard while a checkpoint write is stuck (one rank's writer never comes, the other's waits in a collective of
    the writers' group): every process exits 3 within EXIT_BOUND_S, none aborts at exit, no COMPLETE.

The runs reuse test_distributed's tiny model, data and its uninterrupted 2-rank run (`fsdp`) as the reference.
Each costs a torchrun start (seconds on 2 cores): few, and a slowed step so a signal lands mid-run.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from entrenar import cli
from entrenar.train import checkpoint as C
from entrenar.train.runlock import LOCK_FILE
from tests import test_distributed as td
from tests.helpers.cli import free_port
from tests.test_distributed import finetune_args, losses, ok, weights

sft_data, base_model, fsdp = td.sft_data, td.base_model, td.fsdp
WORKERS_GONE_S = 3.0  # the bound stated in docs/design.md: jobwatch polls the launcher every 0.5 s

# entrenar with each step slowed by SLOW_S (so a signal lands mid-run); with LOSE_RANK set, that rank
# SIGKILLs itself after step 7 of a run that is not a resume
JOB = """
import os, signal, sys, threading, time
from entrenar.train import metrics
orig = metrics.Progress.update
def update(self, step, *a, **k):
    orig(self, step, *a, **k)
    if step == 7 and "--resume" not in sys.argv and os.environ.get("RANK") == os.environ.get("LOSE_RANK"):
        for t in threading.enumerate():  # the checkpoint written in the background is complete first
            if t.name.startswith("entrenar-checkpoint-"):
                t.join()
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(float(os.environ.get("SLOW_S", "0")))
metrics.Progress.update = update
from pathlib import Path
from entrenar import cli
code = cli.main(sys.argv[1:])
Path(__file__).with_name(f"exit-rank{os.environ['RANK']}").write_text(str(code))  # what each rank returned
sys.exit(code)
"""


def _env(**extra: str) -> dict[str, str]:
    # `torchrun` on PATH: the printed resume command is run as printed
    return {**td._env(), "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""), **extra}


def torchrun(tmp_path: Path, argv: list[str]) -> list[str]:
    """The torchrun command of JOB with `argv`."""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()), str(script), *argv]


def launch(cmd: list[str], logs: Path, **env: str) -> subprocess.Popen:
    """`cmd` in the background, its output to LOGS.out / LOGS.err (read with `outputs`)."""
    with open(f"{logs}.out", "w") as out, open(f"{logs}.err", "w") as err:
        return subprocess.Popen(cmd, stdout=out, stderr=err, env=_env(**env))


def outputs(proc: subprocess.Popen, logs: Path) -> tuple[list[dict], str]:
    proc.wait(timeout=td.TIMEOUT)
    out, err = Path(f"{logs}.out").read_text(), Path(f"{logs}.err").read_text()
    return [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")], err


def wait_for_step(proc: subprocess.Popen, logs: Path, step: int) -> None:
    """Until rank 0's progress line of `step` (this job's own, unlike a resumed run's metrics.jsonl) shows."""
    t0 = time.monotonic()
    while f"step {step}/{td.STEPS} loss" not in Path(f"{logs}.err").read_text():
        assert proc.poll() is None and time.monotonic() - t0 < td.TIMEOUT, f"the job ended before step {step}"
        time.sleep(0.05)


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def one_json(records: list[dict], err: str) -> dict:
    assert len(records) == 1, (records, err[-3000:])  # one JSON object per job, not one per rank
    return records[0]


def run_printed(command: str, **env: str) -> subprocess.CompletedProcess:
    assert command.startswith("torchrun "), command
    return subprocess.run(shlex.split(command), capture_output=True, text=True, timeout=td.TIMEOUT, env=_env(**env),
                          check=False)


def test_launcher_killed_then_resume_then_ctrl_c_then_the_printed_command(tmp_path, fsdp, base_model, sft_data,
                                                                          capsys):
    run = tmp_path / "run"
    argv = finetune_args(base_model, sft_data, run, 2)

    # while the job runs, a second writer is refused, naming rank 0 and how to stop the job (its launcher)
    logs = tmp_path / "killed"
    proc = launch(torchrun(tmp_path, argv), logs, SLOW_S="0.5")
    wait_for_step(proc, logs, 2)
    holder = json.loads((run / LOCK_FILE).read_text())
    assert cli.main([*argv, "--resume", "auto"]) == 2
    err = capsys.readouterr().err
    assert f"pid {holder['pid']} " in err and f"kill {proc.pid} (its torchrun launcher)" in err, err

    # the launcher SIGKILLed after step 6 (checkpoint 5 complete): its workers must not run on
    wait_for_step(proc, logs, 6)
    workers = children(proc.pid)
    assert len(workers) == 2
    proc.kill()
    t0 = time.monotonic()
    while any(running(w) for w in workers) and time.monotonic() - t0 < 30:
        time.sleep(0.02)
    gone_after = time.monotonic() - t0
    assert gone_after < WORKERS_GONE_S, f"workers still running {gone_after:.1f} s after their launcher died"
    assert "the launcher (pid" in Path(f"{logs}.err").read_text()

    # --resume auto at once (the lock died with rank 0), then Ctrl-C as a terminal sends it: to the launcher
    logs = tmp_path / "resumed"
    proc = launch(torchrun(tmp_path, [*argv, "--resume", "auto"]), logs, SLOW_S="0.3")
    wait_for_step(proc, logs, 7)
    proc.send_signal(signal.SIGINT)
    records, err = outputs(proc, logs)
    result = one_json(records, err)
    assert result["exit_code"] == 130 and result["checkpoint"].endswith("step-0000005"), err[-3000:]
    assert err.count("entrenar finetune: interrupted: during step") == 1 and "internal error" not in err
    assert [(tmp_path / f"exit-rank{r}").read_text() for r in (0, 1)] == ["130", "130"]  # rank 1 quietly

    # the printed command is the torchrun one, and it finishes the run as if it had never stopped
    done = ok(run_printed(result["resume_command"]))
    assert done["start_step"] == 5
    assert losses(run) == losses(fsdp)
    a, b = weights(run / "final/model.safetensors"), weights(fsdp / "final/model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_a_survivor_whose_launcher_is_gone_says_so_not_that_its_peer_died(monkeypatch):
    """The race behind a flaky CI run: the launcher SIGKILLed, rank 1's watcher saw it first and stopped itself; rank
    0's collective then failed and it named rank 1 as killed by the OS (exit 4), with no word of the launcher (rank
    1's line had gone to the /dev/null that sys.stderr is on ranks other than 0 while they train). Now the survivor
    checks its own launcher first, and the line goes to the process's real stderr whatever sys.stderr is."""
    import contextlib
    import io

    from entrenar.train import jobwatch
    from entrenar.train.distributed import DistContext

    class Killed(Exception):
        pass

    def kill(pid, sig):
        raise Killed(pid, sig)

    real = io.StringIO()
    ctx = DistContext(rank=0, world=2, node=0, nodes=1, local_world=2)
    monkeypatch.setattr(jobwatch, "current", lambda: ctx)
    monkeypatch.setattr(ctx.__class__, "active", property(lambda self: True))
    monkeypatch.setattr(jobwatch, "lost_ranks", lambda wait_s=0.0: [1])  # rank 1 is gone: it saw the launcher first
    monkeypatch.setattr(jobwatch.os, "kill", kill)
    monkeypatch.setattr(jobwatch.sys, "__stderr__", real)
    monkeypatch.setattr(jobwatch, "_launcher", os.getppid())  # the launcher is alive: rank 1's death is named
    lost = jobwatch.judge_failure(RuntimeError("Connection reset by peer"), None, None)
    assert isinstance(lost, jobwatch.RankLost) and lost.lost_ranks == [1]
    monkeypatch.setattr(jobwatch, "_launcher", os.getppid() + 100000)  # re-parented: the launcher is gone
    with contextlib.redirect_stderr(io.StringIO()) as devnull, pytest.raises(Killed) as stopped:
        jobwatch.judge_failure(RuntimeError("Connection reset by peer"), None, None)
    assert stopped.value.args == (os.getpid(), signal.SIGKILL)
    assert real.getvalue() == f"entrenar: rank 0: the launcher (pid {os.getppid() + 100000}) is gone; this worker " \
                              f"stops\n" and devnull.getvalue() == ""


@pytest.mark.parametrize("lost", [1, 0])
def test_a_rank_killed_is_named_by_the_survivor(lost, tmp_path, base_model, sft_data):
    run = tmp_path / "run"
    logs = tmp_path / "lost"
    proc = launch(torchrun(tmp_path, finetune_args(base_model, sft_data, run, 2)), logs, LOSE_RANK=str(lost))
    records, err = outputs(proc, logs)
    result = one_json(records, err)
    assert result["exit_code"] == 4 and result["lost_ranks"] == [lost], err[-3000:]
    assert result["checkpoint"].endswith("step-0000005") and result["resume_command"].startswith("torchrun ")
    assert f"rank {lost} of this 2-rank job died" in err and "Connection reset" not in result["error"]
    assert (tmp_path / f"exit-rank{1 - lost}").read_text() == "4"  # the survivor's own exit code
    assert "internal error" not in err
    if lost == 0:
        return
    # SIGTERM (docker stop, SLURM preemption) to the launcher of the printed resume: as Ctrl-C, exit 143
    script = tmp_path / "job.py"
    assert str(script) in result["resume_command"]  # the entry as launched (here the test's wrapper)
    logs = tmp_path / "terminated"
    proc = launch(shlex.split(result["resume_command"]), logs, SLOW_S="0.3")
    wait_for_step(proc, logs, 7)
    proc.send_signal(signal.SIGTERM)
    records, err = outputs(proc, logs)
    result = one_json(records, err)
    assert result["exit_code"] == 143 and result["checkpoint"].endswith("step-0000005"), err[-3000:]
    assert [(tmp_path / f"exit-rank{r}").read_text() for r in (0, 1)] == ["143", "143"]  # rank 1 quietly
    assert "stopped by SIGTERM" in result["error"] and result["resume_command"].startswith("torchrun ")


# A guard fires on every rank at step 3 while checkpoint 2 is written in the background, and rank 0's writer never
# gets past the start of its shard files (a disk that hangs), so rank 1's writer waits for it in a collective of the
# writers' gloo group. Then the exits are ordered as the race goes when it goes wrong: rank 0's process ends while
# rank 1's interpreter is being torn down (past its atexit handlers; `Teardown` holds it there), so rank 1's
# collective fails only then. torchrun's SIGTERM to the other worker once one has exited is ignored after
# cli.main (the rank exits on its own). ABANDON_WAIT_S is cut to 1 s here (the writers are not coming back).
HELD_WRITE = """
import os, signal, sys, threading, time
from pathlib import Path
from entrenar.errors import GuardError
from entrenar.train import checkpoint, loop
rank = os.environ["RANK"]
here = Path(__file__).parent
(here / f"pid-rank{rank}").write_text(str(os.getpid()))
def ended(rank, bound_s, also=None, sleep=time.sleep, monotonic=time.monotonic, exists=os.path.exists,
          open=open, OSError=OSError, IndexError=IndexError, stat=None):
    # until process RANK has ended (or the file `also` exists), at most bound_s; usable in a teardown
    stat = stat or f"/proc/{(here / f'pid-rank{rank}').read_text()}/stat"
    deadline = monotonic() + bound_s
    while monotonic() < deadline and not (also and exists(also)):
        try:
            with open(stat) as f:
                if f.read().rsplit(")", 1)[1].split()[0] in "ZX":
                    return
        except (OSError, IndexError):
            return
        sleep(0.05)
class Teardown:  # rank 1's interpreter teardown, past the atexit handlers, waits here for rank 0 to exit
    def __init__(self):
        self.stat0, self.mark = f"/proc/{(here / 'pid-rank0').read_text()}/stat", str(here / "rank1-teardown")
    def __del__(self, ended=ended, sleep=time.sleep, open=open):
        open(self.mark, "w").close()
        ended(0, 10, stat=self.stat0)
        sleep(1.0)  # rank 1's writer learns that its collective failed
started = threading.Event()
def hook(stage, where):
    if stage == "start" and checkpoint.step_dir_name(2) in where.name:
        started.set()
        if rank == "0":
            threading.Event().wait()
checkpoint.WRITE_HOOK, checkpoint.ABANDON_WAIT_S = hook, 1.0
orig = loop.Trainer.after_step
def after_step(self, step):
    if step == 3:
        assert started.wait(120) and self.checkpointer.in_flight == 2
        (here / f"stop-rank{rank}").write_text(str(time.time()))
        raise GuardError("GUARD-TEST", "planted while checkpoint 2 is being written")
    orig(self, step)
loop.Trainer.after_step = after_step
from entrenar import cli
code = cli.main(sys.argv[1:])
(here / f"exit-rank{rank}").write_text(str(code))  # what each rank returned
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if rank == "0":
    ended(1, 25, also=str(here / "rank1-teardown"))
else:
    teardown = Teardown()
sys.exit(code)
"""
EXIT_BOUND_S = 20.0  # from the guard to the launcher's end: well under torchrun's 30 s before it SIGKILLs a worker


def test_an_error_exit_while_a_checkpoint_write_is_stuck_exits_every_rank_with_its_code(tmp_path, base_model,
                                                                                         sft_data):
    """Every rank's process ends with the guard's exit 3 (as torchrun reports them) soon after the guard, and the
    abandoned checkpoint never becomes COMPLETE. Before checkpoint.leave_past_writers rank 1, its writer inside the
    gloo collective, aborted at exit instead ("terminate called without an active exception", exit -6)."""
    run = tmp_path / "run"
    script = tmp_path / "job.py"
    script.write_text(HELD_WRITE)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(script),
           *finetune_args(base_model, sft_data, run, 2, ("--save-every", "2"))]
    logs = tmp_path / "job"
    proc = launch(cmd, logs)
    records, err = outputs(proc, logs)
    took = time.time() - min(float((tmp_path / f"stop-rank{r}").read_text()) for r in (0, 1))
    result = one_json(records, err)
    assert result["exit_code"] == 3 and result["guard"] == "GUARD-TEST", err[-3000:]
    assert [(tmp_path / f"exit-rank{r}").read_text() for r in (0, 1)] == ["3", "3"], err[-3000:]
    codes = re.findall(r"^ +exitcode +: (-?\d+)", err, re.MULTILINE)  # the launcher's summary: every process
    assert codes == ["3", "3"] and "terminate called" not in err, err[-3000:]
    assert took < EXIT_BOUND_S, f"the job took {took:.1f} s to end after the guard"
    assert err.count("a checkpoint write abandoned by this error exit did not stop") == 2, err[-3000:]
    root = run / "checkpoints"
    assert C.complete_checkpoints(root) == [] and not (root / "step-0000002").exists()
    assert not (root / "latest").exists()
