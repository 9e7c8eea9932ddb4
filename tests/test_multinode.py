"""Several nodes on one CPU host (issue 37): two torchrun launchers of 2 gloo ranks each (`--nnodes 2`, c10d
rendezvous on 127.0.0.1) train what one launcher of 4 ranks and one process train.

  - HSDP (`--parallel hsdp`: a 2-D mesh, replicate across the 2 nodes x shard over each node's 2 ranks) and
    DDP over 2 nodes: per-step losses and gradient norms within 1e-5 relative of one process on the same
    global batch, final/ within 1e-5 relL2; one JSON line and one metrics line per step (rank 0 writes);
  - checkpoints reshard: the 2x2 HSDP checkpoint resumes on 1 launcher x 4 (FSDP2), whose checkpoint resumes
    in one process, the losses still one process's;
  - a run directory that is not the same on every node (here: a relative --out and launchers in different
    working directories) is refused with exit 2 naming the node that does not see it;
  - a node lost (its launcher SIGKILLed mid-run, the node on another "host" whose processes the survivors
    cannot see): the survivors exit 4 within NODE_LOST_S naming the node and its ranks, the last complete
    checkpoint and the resume command.

The tiny model and SFT data are test_distributed's (its module-scoped fixtures). A launch of 4 processes costs
tens of seconds on 2 cores: each run here serves several assertions.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from entrenar.fileio import read_jsonl
from tests import test_distributed as td
from tests.helpers.cli import ROOT, child_env, free_port, run_cli_process
from tests.test_distributed import close, finetune_args, losses, weights, worst_rel
from tests.test_distributed_stops import children

sft_data, base_model = td.sft_data, td.base_model
STEPS = 6
NODE_LOST_S = 30.0  # the bound stated in docs/design.md: from a node's launcher killed to the survivors' exit
TIMEOUT = td.TIMEOUT

# entrenar, recording each rank's exit code and its node's launcher pid; FAKE_HOST makes this launcher's
# processes report another host name (a second machine: the others cannot see its pids in /proc); SLOW_S slows
# each step so a kill lands mid-run
JOB = """
import os, socket, sys, time
from pathlib import Path
if os.environ.get("FAKE_HOST"):
    socket.gethostname = lambda: os.environ["FAKE_HOST"]
here = Path(__file__).parent
(here / f"launcher-node{os.environ['GROUP_RANK']}").write_text(str(os.getppid()))
from entrenar.train import metrics
orig = metrics.Progress.update
def update(self, step, *a, **k):
    orig(self, step, *a, **k)
    time.sleep(float(os.environ.get("SLOW_S", "0")))
metrics.Progress.update = update
from entrenar import cli
code = cli.main(sys.argv[1:])
(here / f"exit-rank{os.environ['RANK']}").write_text(str(code))
sys.exit(code)
"""


@pytest.fixture(scope="module")
def args(base_model, sft_data):
    """finetune's arguments: `args(out, batch, *extra)`; STEPS steps, a checkpoint every 2."""
    def make(out: Path | str, batch: int, *extra: str) -> list[str]:
        return finetune_args(base_model, sft_data, Path(out), batch,
                             ("--steps", str(STEPS), "--save-every", "2", "--eval-every", "3", *extra))
    return make


def nodes_cmd(port: int, per_node: int, script: Path, argv: list[str]) -> list[str]:
    """One node's torchrun: 2 nodes, c10d rendezvous on 127.0.0.1:port (the same command on every node)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(per_node),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"test{port}",
            "--rdzv-conf", "join_timeout=120", "--max-restarts", "0", str(script), *argv]


def env(**extra: str) -> dict[str, str]:
    # `torchrun` on PATH: a printed resume command runs as printed
    return child_env(OMP_NUM_THREADS="1", ENTRENAR_DIST_TIMEOUT="90",
                     PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""), **extra)


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


class Nodes:
    """Two launchers of `per_node` ranks (their logs in `dir`/node-{i}.out/.err). The second starts once the
    first serves the rendezvous: the first hosts the rendezvous store and, with the lower pid, is node 0
    (torch's c10d rendezvous numbers nodes by (address, pid))."""

    def __init__(self, dir: Path, argv: list[str], per_node: int = 2, cwds: tuple = (None, None),
                 envs: tuple[dict, dict] = ({}, {})):
        self.dir = dir
        dir.mkdir(parents=True, exist_ok=True)
        script = dir / "job.py"
        script.write_text(JOB)
        port = free_port()
        self.cmd = nodes_cmd(port, per_node, script, argv)
        self.procs = []
        for i in range(2):
            with open(dir / f"node-{i}.out", "w") as out, open(dir / f"node-{i}.err", "w") as err:
                self.procs.append(subprocess.Popen(self.cmd, stdout=out, stderr=err, cwd=cwds[i] or ROOT,
                                                   env=env(**envs[i])))
            t0 = time.monotonic()
            while i == 0 and not listening(port):
                assert self.procs[0].poll() is None and time.monotonic() - t0 < TIMEOUT, self.stderr()[-3000:]
                time.sleep(0.1)

    def wait(self) -> list[int]:
        return [p.wait(timeout=TIMEOUT) for p in self.procs]

    def stdout(self) -> str:
        return "".join((self.dir / f"node-{i}.out").read_text() for i in range(len(self.procs)))

    def stderr(self) -> str:
        return "".join((self.dir / f"node-{i}.err").read_text() for i in range(len(self.procs)))

    def records(self) -> list[dict]:
        return [json.loads(ln) for ln in self.stdout().splitlines() if ln.startswith("{")]

    def exits(self, world: int) -> list[str]:
        return [(self.dir / f"exit-rank{r}").read_text() if (self.dir / f"exit-rank{r}").exists() else None
                for r in range(world)]


def finished(nodes: Nodes) -> dict:
    codes = nodes.wait()
    assert codes == [0, 0], nodes.stderr()[-4000:]
    records = nodes.records()
    assert len(records) == 1, nodes.stdout()  # one JSON line per job: rank 0's, on one of the launchers
    return records[0]


def grad_norms(run: Path) -> list[float]:
    return [r["grad_norm"] for _, r in read_jsonl(run / "metrics.jsonl")]


@pytest.fixture(scope="module")
def single(tmp_path_factory, args) -> Path:
    """The reference: one process, batch 4 x accumulation 2."""
    out = tmp_path_factory.mktemp("single") / "run"
    td.ok(run_cli_process(args(out, 4)))
    return out


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory, args) -> Path:
    """2 nodes x 2 ranks x batch 1 x accumulation 2: the same global batch of 8."""
    dir = tmp_path_factory.mktemp("hsdp")
    finished(Nodes(dir, args(dir / "run", 1, "--parallel", "hsdp")))
    return dir / "run"


def same_run(run: Path, ref: Path) -> None:
    a, b = losses(run), losses(ref)
    assert len(b) == STEPS and close(a, b), (a, b)
    assert close(grad_norms(run), grad_norms(ref)), (grad_norms(run), grad_norms(ref))
    assert [r["step"] for _, r in read_jsonl(run / "metrics.jsonl")] == list(range(1, STEPS + 1))  # once each
    ev = [[r["loss"] for _, r in read_jsonl(r / "eval.jsonl")] for r in (run, ref)]
    assert len(ev[1]) >= 2 and close(*ev)
    assert worst_rel(weights(run / "final/model.safetensors"), weights(ref / "final/model.safetensors")) <= 1e-5


def test_hsdp_on_two_nodes_equals_one_process(hsdp, single):
    same_run(hsdp, single)
    run = json.loads((hsdp / "run.json").read_text())
    assert run["distributed"] == {"world_size": 4, "nodes": 2, "parallel": "hsdp", "global_batch": 8,
                                  "mesh": {"dp_replicate": 2, "dp_shard": 2}}
    meta = json.loads((hsdp / "checkpoints" / "latest" / "meta.json").read_text())
    assert meta["sharded"] and meta["world_size"] == 4
    assert not (hsdp / ".nodes-check").exists()  # the shared-directory probe cleans up after itself


def _rewind(src: Path, dst: Path, step: int) -> None:
    td._rewind(src, dst, step)


def test_checkpoints_reshard_two_nodes_to_one_launcher_of_four_to_one_process(tmp_path, args, hsdp, single):
    """2x2 HSDP (checkpoint 2) -> 1 launcher x 4 ranks (FSDP2; checkpoint 4) -> one process: the same
    samples in the same order, so the losses of every step are one process's."""
    four = tmp_path / "four"
    _rewind(hsdp, four, 2)
    res = td.ok(run_cli_process([*args(four, 1), "--resume", "auto"], nproc=4))
    assert res["start_step"] == 2
    assert json.loads((four / "checkpoints" / "step-0000004" / "meta.json").read_text())["world_size"] == 4
    one = tmp_path / "one"
    _rewind(four, one, 4)
    assert td.ok(run_cli_process([*args(one, 4), "--resume", "auto"]))["start_step"] == 4
    for run in (four, one):
        same_run(run, single)


def test_ddp_on_two_nodes_equals_one_process(tmp_path, args, single):
    """Two launchers of one rank each (cheaper than 2 x 2; DDP has no second mesh dimension to exercise)."""
    finished(Nodes(tmp_path, args(tmp_path / "run", 2, "--parallel", "ddp"), per_node=1))
    same_run(tmp_path / "run", single)
    assert json.loads((tmp_path / "run" / "run.json").read_text())["distributed"] == {
        "world_size": 2, "nodes": 2, "parallel": "ddp", "global_batch": 8}


def test_a_run_directory_not_shared_by_every_node_is_exit_2(tmp_path, args):
    """Each launcher in its own working directory with a relative --out: two different directories, as on two
    hosts without a shared file system. Refused before a step, naming the node that does not see it."""
    cwds = (tmp_path / "a", tmp_path / "b")
    for d in cwds:
        d.mkdir()
    nodes = Nodes(tmp_path, args("run", 4), per_node=1, cwds=cwds)
    nodes.wait()
    err = nodes.stderr()
    assert nodes.exits(2) == ["2", "2"], err[-4000:]
    assert "is not the same directory on every node: node 1" in err, err[-4000:]
    assert err.count("is not the same directory on every node") == 1  # rank 0 alone prints the job's message
    record = nodes.records()
    assert len(record) == 1 and record[0]["exit_code"] == 2
    ran = [d / "run" for d in cwds if (d / "run").exists()]
    assert len(ran) == 1 and not (ran[0] / "metrics.jsonl").exists() and not (ran[0] / ".nodes-check").exists()


@pytest.mark.parametrize("how", ["launcher", "host", "node0"])
def test_a_node_lost_is_named_by_the_survivors_with_exit_4(tmp_path, args, how):
    """A node (on another 'host': the survivors cannot see its processes) lost after step 3 (checkpoint 2
    complete). launcher: node 1's torchrun SIGKILLed, its workers record that in the job's store as they stop;
    host: node 1's launcher and workers SIGKILLed at once (nothing recorded), the survivors' roll call finds
    them missing; node0: node 0's torchrun SIGKILLed, and with it the store it served (and the rendezvous).
    Each time the survivors exit 4 within NODE_LOST_S naming the node, its ranks, the checkpoint and the resume
    command."""
    lost = 0 if how == "node0" else 1
    run = tmp_path / "run"
    envs = [{"SLOW_S": "0.5"}, {"SLOW_S": "0.5"}]
    envs[lost]["FAKE_HOST"] = "lost-host"
    nodes = Nodes(tmp_path, args(run, 1, "--parallel", "hsdp"), envs=tuple(envs))
    t0 = time.monotonic()
    while "step 3/" not in nodes.stderr() or not (run / "checkpoints" / "step-0000002" / "COMPLETE").is_file():
        assert all(p.poll() is None for p in nodes.procs) and time.monotonic() - t0 < TIMEOUT, nodes.stderr()[-3000:]
        time.sleep(0.05)
    victim, survivor = nodes.procs[lost], nodes.procs[1 - lost]
    assert int((tmp_path / f"launcher-node{lost}").read_text()) == victim.pid  # the first launcher is node 0
    workers = children(victim.pid) if how == "host" else []
    assert len(workers) == (2 if how == "host" else 0)
    for pid in [*workers, victim.pid]:
        os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    survivor.wait(timeout=TIMEOUT)
    took = time.monotonic() - killed
    assert took < NODE_LOST_S, f"the survivors took {took:.0f} s to stop"
    err = nodes.stderr()
    records = nodes.records()
    assert len(records) == 1, (json.dumps(records), err[-4000:])
    result = records[0]
    ranks, alive = ([0, 1], [2, 3]) if lost == 0 else ([2, 3], [0, 1])
    assert result["exit_code"] == 4 and result["lost_ranks"] == ranks, err[-4000:]
    assert result["details"] == {"lost_nodes": [lost], "hosts": ["lost-host"]}
    assert f"node {lost} (host lost-host, ranks {ranks[0]}, {ranks[1]}) of this 2-node, 4-rank job was lost" \
        in result["error"]
    assert result["checkpoint"].endswith("step-0000002")
    resume = result["resume_command"]
    assert resume.startswith("torchrun ") and "--nnodes 2" in resume and "--resume auto" in resume, resume
    assert [nodes.exits(4)[r] for r in alive] == ["4", "4"], err[-4000:]  # each survivor its own exit 4
    assert err.count("job was lost") == 1  # one message: the lowest survivor's


# ---- the pieces, in one process (fast) ------------------------------------------------------------------
HSDP_PLACEMENT = """
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())  # no peers: placements only
from torch.distributed.device_mesh import init_device_mesh
from entrenar.train.distributed import DistContext
from entrenar.train.parallel import apply_parallel
from tests.helpers.models import tiny_causal_lm, tiny_config
mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
for nodes, mode in ((2, "auto"), (2, "hsdp"), (1, "hsdp")):
    ctx = DistContext(rank=0, world=4, mesh=mesh, nodes=nodes, local_world=4 // nodes)
    model = tiny_causal_lm(tiny_config(), 1)
    strategy = apply_parallel(model, ctx, mode)
    p = model.model.layers[0].self_attn.q_proj.weight
    print(nodes, mode, strategy.kind, p.device_mesh.mesh_dim_names, tuple(p.device_mesh.shape), p.placements)
"""


def test_hsdp_shards_inside_a_node_and_replicates_across_nodes(tmp_path):
    """apply_parallel on 2 nodes x 2 (a fake process group: no communication, the placements only): HSDP's
    parameters live on the 2-D (dp_replicate=2, dp_shard=2) mesh, replicated over nodes and sharded inside one;
    auto picks it on the CPU (no card memory to fit DDP's rule); hsdp on one node is FSDP2's flat mesh."""
    proc = subprocess.run([sys.executable, "-c", HSDP_PLACEMENT], capture_output=True, text=True, timeout=TIMEOUT,
                          env=env(), check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [
        "2 auto hsdp ('dp_replicate', 'dp_shard') (2, 2) (Replicate(), Shard(dim=0))",
        "2 hsdp hsdp ('dp_replicate', 'dp_shard') (2, 2) (Replicate(), Shard(dim=0))",
        "1 hsdp fsdp ('dp',) (4,) (Shard(dim=0),)"], proc.stdout


def test_auto_picks_hsdp_on_several_nodes_only_when_ddp_does_not_fit():
    from entrenar.errors import InputError
    from entrenar.train.parallel import DDP_BYTES_PER_PARAM, DDP_STATE_FRACTION, resolve_parallel

    gib80 = 80 * 2**30
    small = int(DDP_STATE_FRACTION * gib80 / DDP_BYTES_PER_PARAM)  # the largest model DDP's rule admits
    assert resolve_parallel("auto", False, small, gib80, nodes=2) == "ddp"
    assert resolve_parallel("auto", False, small + 1, gib80, nodes=2) == "hsdp"
    assert resolve_parallel("auto", False, small + 1, gib80, nodes=1) == "fsdp"
    assert resolve_parallel("auto", True, 10**10, gib80, nodes=2) == "ddp"  # adapters: DDP
    assert resolve_parallel("hsdp", False, nodes=1) == "fsdp"  # one node: one replica is FSDP2
    with pytest.raises(InputError, match="--parallel hsdp with --mode lora/qlora"):
        resolve_parallel("hsdp", True, nodes=2)


def test_torchruns_node_variables_are_read_and_checked(monkeypatch):
    from entrenar.errors import InputError
    from entrenar.train.distributed import DistContext, env_nodes

    for k, v in {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2",
                 "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    assert env_nodes() == (1, 2, 2)
    monkeypatch.setenv("GROUP_RANK", "2")
    with pytest.raises(InputError, match="GROUP_RANK=2, GROUP_WORLD_SIZE=2"):
        env_nodes()
    monkeypatch.setenv("GROUP_RANK", "x")
    with pytest.raises(InputError, match="GROUP_RANK='x' is not an integer"):
        env_nodes()
    for k in ("GROUP_RANK", "GROUP_WORLD_SIZE", "LOCAL_WORLD_SIZE"):  # an older launcher: one node of WORLD_SIZE
        monkeypatch.delenv(k)
    assert env_nodes() == (0, 1, 4)
    # 2 + 3 processes: each rank gathers every rank's (node, processes on it), so every rank decides alike
    uneven = DistContext(rank=3, world=5, local_rank=1, node=1, nodes=2, local_world=3)
    uneven.all_gather_object = lambda mine: [(0, 2), (0, 2), mine, mine, mine]
    with pytest.raises(InputError, match=r"same number of processes on every node, got node 0: 2, node 1: 3 \(5 "):
        uneven.hsdp_mesh()


class _TwoNodes:
    """A DistContext stand-in for check_shared: this process is node 1's first rank, in its own working
    directory; rank 0 (node 0) runs its part in `rank0_cwd`, so a relative run directory is another one there
    (as in the CLI test), and the same one when both are the same directory."""

    active, nodes, node, local_rank, rank = True, 2, 1, 0, 2

    def __init__(self, rank0_cwd: Path):
        self.rank0_cwd = rank0_cwd

    def run_on_main(self, fn):
        here = os.getcwd()
        os.chdir(self.rank0_cwd)
        try:
            return fn()
        finally:
            os.chdir(here)

    def all_gather_object(self, obj):
        return [(0, "host0", True, str(self.rank0_cwd / "run")), obj]


def test_a_node_that_does_not_see_rank_0s_file_is_refused(tmp_path, monkeypatch):
    from entrenar.errors import InputError
    from entrenar.train.runlock import SHARED_CHECK, check_shared

    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    for d in (node0, node1):
        (d / "run").mkdir(parents=True)
    monkeypatch.chdir(node1)
    check_shared(Path("run"), _TwoNodes(node1))  # shared: node 1 reads what rank 0 wrote
    assert not (node1 / "run" / SHARED_CHECK).exists()  # removed again
    with pytest.raises(InputError, match=r"not the same directory on every node: node 1 \(host ") as e:
        check_shared(Path("run"), _TwoNodes(node0))
    assert f"--out resolved to {node1 / 'run'}" in str(e.value) and "node 0, host host0" in str(e.value)
    assert "every node mounts at the same path" in str(e.value)
    assert getattr(e.value, "job_wide", False)  # every rank raises it, rank 0 alone prints it
    assert not (node0 / "run" / SHARED_CHECK).exists()


def test_the_gpu_measurements_pieces(tmp_path):
    """bench/multinode.py (run on a 4-GPU host by bench/multinode.sh): two launchers of 2 GPUs each on disjoint
    CUDA_VISIBLE_DEVICES with one c10d rendezvous; the NCCL collectives' ms/step by kind from profile.json's
    kernels; per-GPU tok/s from metrics.jsonl without the profiled steps."""
    from bench import multinode as mn

    hsdp2x2 = next(x for x in mn.LAYOUTS if x.name == "hsdp-2x2")
    cmds = mn.launcher_commands(hsdp2x2, ["pretrain", "--parallel", "hsdp"], 29400, "cuda", python="py")
    assert [env for _, env in cmds] == [{"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "2,3"}]
    assert cmds[0][0] == cmds[1][0]  # the same command on every node
    words = " ".join(cmds[0][0])
    assert ("--nproc-per-node 2 --nnodes 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29400" in words
            and words.endswith("-m entrenar pretrain --parallel hsdp"))
    one = mn.launcher_commands(next(x for x in mn.LAYOUTS if x.name == "fsdp-1x4"), ["pretrain"], 29400, "cuda")
    assert len(one) == 1 and "--nproc-per-node 4" in " ".join(one[0][0]) and one[0][1] == {}
    profile = {"top_kernels_ms": [["ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 3.5],
                                  ["ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 2.0],
                                  ["ncclDevKernel_AllGather_RING_LL", 1.25], ["ncclDevKernel_AllReduce_Sum_bf16", 0.5],
                                  ["sm90_xmma_gemm_bf16", 40.0]], "communication_ms_per_step": 7.25}
    assert mn.collectives_ms(profile) == {"all_reduce": 4.0, "reduce_scatter": 2.0, "all_gather": 1.25}
    cpu = {"top_kernels_ms": [["c10d::allreduce_", 2.5], ["c10d::_reduce_scatter_base_", 1.0],
                              ["FSDP::all_gather", 9.0], ["c10d::_allgather_base_", 0.5]]}  # FSDP's span: not a kernel
    assert mn.collectives_ms(cpu) == {"all_reduce": 2.5, "reduce_scatter": 1.0, "all_gather": 0.5}
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "loss": 5.0, "tok_s": 4000.0 if s < 6 else 1000.0, "profiled": s >= 6, "mem_mb": 100}
            for s in range(1, 8)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "profile.json").write_text(json.dumps(profile))
    row = mn.summarize_run(run, warmup=2, tokens_per_step=8 * 2048 * 4, gpus=4)
    assert row["tokens_per_s_per_gpu"] == 1000.0 and row["steps_logged"] == 7  # 4000 job tok/s over 4 GPUs
    assert row["collectives_ms_per_step"]["all_reduce"] == 4.0
    log = tmp_path / "node0.err"
    log.write_text("h:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read\n"
                   "h:1:2 [1] NCCL INFO Channel 00/0 : 1[1] -> 2[0] via SHM/direct/direct\n"
                   "h:1:2 [1] NCCL INFO Channel 01/0 : 1[1] -> 2[0] via SHM/direct/direct\n")
    assert mn.nccl_transports([log, tmp_path / "absent.err"]) == {"P2P/CUMEM/read": 1, "SHM/direct/direct": 2}
    md = mn.table([{"model": "qwen2.5-0.5b", "layout": "hsdp-2x2", "exit": [0, 0], **row}])
    assert "| qwen2.5-0.5b | hsdp-2x2 | [0, 0] | 1,000 | 4.0 | 2.0 | 1.25 |" in md


def test_a_survivor_signalled_before_its_own_roll_call_reads_the_finished_one(monkeypatch):
    """The race of the 'host' loss: on the surviving node, rank 1's collective fails first, its roll call finds
    node 1's ranks missing and it exits 4; its launcher then SIGTERMs rank 0, whose own collective has not failed
    yet. Rank 0 must read rank 1's verdict from the store (exit 4, node 1 named), not report a plain stop (143)."""
    import torch.distributed as dist

    from entrenar.train import jobwatch
    from entrenar.train.distributed import DistContext

    store = dist.HashStore()
    monkeypatch.setattr(jobwatch, "_store", lambda: store)
    monkeypatch.setattr(jobwatch, "_peers", [("a", 10, 0), ("a", 11, 0), ("b", 12, 1), ("b", 13, 1)])
    monkeypatch.setattr(jobwatch, "ROLL_CALL_S", 0.3)
    monkeypatch.setattr(jobwatch, "lost_ranks", lambda wait_s=0.0: [])  # host b's pids cannot be seen from host a
    monkeypatch.setattr(jobwatch, "GONE_WAIT_S", 0.1)
    rank0, rank1 = (DistContext(rank=r, world=4, node=0, nodes=2, local_world=2) for r in (0, 1))
    store.set(f"{jobwatch.ALIVE_KEY}/0", "1")  # rank 0's watcher thread answers the roll call
    assert jobwatch.roll_call(rank1, wait_s=0.3) == [2, 3]
    monkeypatch.setattr(jobwatch, "roll_call", lambda ctx, wait_s=0: pytest.fail("the verdict is there to read"))
    assert jobwatch._lost_across_nodes(rank0, signalled=True) == [2, 3]
    lost = jobwatch.RankLost([2, 3], None, None, speaks=True)
    assert lost.exit_code == 4 and lost.details == {"lost_nodes": [1], "hosts": ["b"]}


def test_a_signalled_survivor_without_any_record_calls_the_roll(monkeypatch):
    """The launcher SIGTERMs its workers as soon as its rendezvous loses the other node, before any collective
    failed and before any record exists: the signalled survivor calls the roll itself (the lost node's ranks do
    not answer: exit 4 naming them); a whole job stopped by the user answers it (every watcher thread alive):
    nothing lost, a plain stop."""
    import torch.distributed as dist

    from entrenar.train import jobwatch
    from entrenar.train.distributed import DistContext

    monkeypatch.setattr(jobwatch, "_peers", [("a", 10, 0), ("a", 11, 0), ("b", 12, 1), ("b", 13, 1)])
    monkeypatch.setattr(jobwatch, "ROLL_CALL_S", 0.3)
    monkeypatch.setattr(jobwatch, "GONE_WAIT_S", 0.1)
    monkeypatch.setattr(jobwatch, "lost_ranks", lambda wait_s=0.0: [])
    rank0 = DistContext(rank=0, world=4, node=0, nodes=2, local_world=2)
    for alive, lost in (([1], [2, 3]), ([1, 2, 3], [])):
        store = dist.HashStore()
        monkeypatch.setattr(jobwatch, "_store", lambda store=store: store)
        for r in alive:  # the live processes' watcher threads answer
            store.set(f"{jobwatch.ALIVE_KEY}/{r}", "1")
        assert jobwatch._lost_across_nodes(rank0, signalled=True) == lost
