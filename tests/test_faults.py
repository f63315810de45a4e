"""Faults during training, in real ``pretrain/main.py`` processes: non-finite steps, crashes in
the middle of a checkpoint save, hung and killed ranks.

The runs reuse the tiny model and corpus of ``test_train_launch.py``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from launch_helpers import MAIN, common_args, job_env, metrics, popen_job, reseal

from tapered_megatron.parallel.host import free_port
from tapered_megatron.training.heartbeat import Heartbeat, period_for
from tapered_megatron.training.monitor import Health

pytestmark = pytest.mark.distributed


def start(
    corpus: str, out: Path, extra: list[str], env: dict[str, str] | None = None, n: int = 1
) -> list[subprocess.Popen]:
    """Start ``n`` ranks of ``pretrain/main.py`` (ZeRO-0 for one rank, else ZeRO-2)."""
    port = str(free_port())
    procs = []
    for r in range(n):
        e = dict(job_env(), **(env or {}))
        if n > 1:
            e.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(n))
            e.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        ds = "zero0.json" if n == 1 else "zero2.json"
        procs.append(
            popen_job([sys.executable, "-u", MAIN, *common_args(corpus, out, ds, extra)], e)
        )
    return procs


def finish(procs: list[subprocess.Popen], out: Path) -> tuple[list[int], str]:
    """Wait for the ranks of :func:`start`; their exit codes and log (also in ``out/log.txt``)."""
    try:
        logs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    (out / "log.txt").write_text("\n".join(logs))
    return [p.returncode for p in procs], "\n".join(logs)


def run_once(
    corpus: str, out: Path, extra: list[str], env: dict[str, str] | None = None, n: int = 1
) -> tuple[list[int], str]:
    """``n`` ranks of ``pretrain/main.py`` run to the end; their exit codes and log."""
    return finish(start(corpus, out, extra, env, n), out)


def test_loss_spike_and_skip_bookkeeping():
    h = Health(max_skipped=2, spike_factor=3.0)
    for it in range(1, 11):
        assert h.update(it, 2.0, False, it * 8, 8) == ("", "")
    note, stop = h.update(11, 7.0, False, 88, 8)
    assert "loss spike" in note and "running mean 2" in note and not stop
    note, stop = h.update(12, float("nan"), True, 96, 8)
    assert "samples 88-95" in note and "step skipped" in note and not stop
    assert h.update(13, 2.0, False, 104, 8) == ("", "")  # a good step resets the count
    h.update(14, float("nan"), True, 112, 8)
    note, stop = h.update(15, float("nan"), True, 120, 8)
    assert "2 consecutive steps" in stop and "without saving" in stop


def _bump_consumed(tag_dir: Path, by: int) -> None:
    """Mark one more global batch as consumed in a saved checkpoint (a dropped batch)."""
    (f,) = tag_dir.glob("mp_rank_*_model_states.pt")
    state = torch.load(f, weights_only=False)
    state["consumed_samples"] += by
    torch.save(state, f)
    reseal(tag_dir)  # as if saved so


def test_nan_step_is_skipped_withheld_from_saving_and_equals_a_dropped_batch(corpus, tmp_path):
    """A NaN loss at iteration 4 skips the step and withholds its save (saves every iteration,
    the newest 5 kept): no global_step4 is ever written, so nothing is pruned for it. The curve
    from then on is that of a run that never saw batch 4: global_step3 of the same run, its
    consumed samples advanced by one batch, resumed (skip-run iteration j+1 equals the dropped
    run's iteration j, bitwise)."""
    skip, drop = tmp_path / "skip", tmp_path / "drop"
    extra = ["--train.iters", "8", "--train.save_interval", "1", "--train.keep_last", "5"]
    extra += ["--eval.interval", "0", "--logging.interval", "1"]
    rc, log = run_once(corpus, skip, extra, {"TAPERED_MEGATRON_INJECT_NAN": "4"})
    assert rc == [0], log[-3000:]
    assert "iteration 4: loss nan or gradients not finite: step skipped" in log
    assert "samples 24-31 are consumed and not trained on" in log
    assert "iteration 4: checkpoint withheld (the last 1 step(s) were skipped" in log
    got = metrics(skip)
    assert [r.get("skipped", False) for r in got] == [i == 4 for i in range(1, 9)]
    ckpt = skip / "ckpt"
    assert sorted(p.name for p in ckpt.glob("global_step*")) == [
        f"global_step{i}" for i in (3, 5, 6, 7, 8)
    ]
    assert (ckpt / "latest").read_text() == "global_step8"
    assert '"consumed_samples": 64' in (ckpt / "global_step8" / "complete").read_text()

    shutil.copytree(ckpt / "global_step3", drop / "ckpt" / "global_step3")
    (drop / "ckpt" / "latest").write_text("global_step3")
    _bump_consumed(drop / "ckpt" / "global_step3", 8)
    rc, log = run_once(corpus, drop, [*extra, "--train.exit_interval", "7", "--resume", "auto"])
    assert rc == [0], log[-3000:]
    assert "resumed from" in log and "at iteration 3" in log
    ref = metrics(drop)
    assert [r["iteration"] for r in ref] == [4, 5, 6, 7]
    # skip-run iteration j+1 == dropped-run iteration j, bitwise (loss and lr) for j = 4..7
    assert [r["loss"] for r in got[4:8]] == [r["loss"] for r in ref]
    assert [r["lr"] for r in got[4:8]] == [r["lr"] for r in ref]


def test_persistent_nans_stop_cleanly_keeping_the_last_checkpoint(corpus, tmp_path):
    extra = ["--train.save_interval", "5", "--train.max_skipped_steps", "3"]
    rc, log = run_once(corpus, tmp_path, extra, {"TAPERED_MEGATRON_INJECT_NAN": "7-20"})
    assert rc == [1], log[-3000:]
    last = log.strip().splitlines()[-1]
    assert last.startswith("error: 3 consecutive steps with non-finite loss"), log[-2000:]
    assert "at iteration 9" in last and "Traceback" not in log
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "latest").read_text() == "global_step5"
    assert sorted(p.name for p in ckpt.glob("global_step*")) == ["global_step5"]
    assert (ckpt / "global_step5" / "complete").exists()
    assert [r["iteration"] for r in metrics(tmp_path)] == list(range(1, 10))


def test_exit_signal_on_one_rank_stops_every_rank_after_saving(corpus, tmp_path):
    """SLURM's pre-time-limit signal (``train.exit_signal``) reaching one rank of two: both
    stop at the same iteration after a complete checkpoint that ``latest`` names (what
    ``--resume auto`` continues from), exit code 75."""
    extra = ["--train.iters", "400", "--train.exit_signal", "SIGUSR1", "--eval.interval", "0"]
    extra += ["--logging.interval", "1"]
    procs = start(corpus, tmp_path, extra, n=2)
    deadline = time.time() + 240
    metrics_file = tmp_path / "metrics.jsonl"
    while time.time() < deadline and (
        not metrics_file.exists() or len(metrics_file.read_text().splitlines()) < 3
    ):
        time.sleep(0.5)
    procs[1].send_signal(signal.SIGUSR1)
    rc, log = finish(procs, tmp_path)
    assert rc == [75, 75], log[-3000:]
    it = len(metrics(tmp_path))
    assert 3 <= it < 400
    assert f"SIGUSR1 received: stopped at iteration {it} after saving" in log
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "latest").read_text() == f"global_step{it}"
    assert (ckpt / f"global_step{it}" / "complete").exists()


def slurm_script_command(name: str) -> tuple[list[str], str, int]:
    """``scripts/slurm_{name}.sbatch`` (planner-written): the arguments it passes to
    ``pretrain/main.py`` without those that size the model, batch and layout for its cluster
    (a tiny model on CPU ranks stands in), the signal its ``--signal`` line asks for, and the
    exit code on which it requeues."""
    import re
    import shlex

    text = (Path(__file__).resolve().parents[1] / "scripts" / f"slurm_{name}.sbatch").read_text()
    command = text.split("exec python pretrain/main.py", 1)[1].split('"$@"', 1)[0]
    args = shlex.split(command.replace("\\\n", " "))
    sized = ("--config", "--ds_config", "--parallel.", "--train.micro_batch_size")
    sized += ("--train.global_batch_size", "--train.checkpoint_activations", "--train.recompute")
    kept = [x for k, v in zip(args[::2], args[1::2]) if not k.startswith(sized) for x in (k, v)]
    signal_name = re.search(r"#SBATCH --signal=(?:B:)?(\w+)@\d+", text).group(1)
    requeue = int(re.search(r'if \[ "\$\{rc:-0\}" -eq (\d+) \]', text).group(1))
    return kept, f"SIG{signal_name}", requeue


@pytest.mark.slow
def test_a_planner_written_slurm_job_stopped_before_its_limit_continues_when_requeued(
    corpus, tmp_path
):
    """The command line of ``scripts/slurm_cluster_7b.sbatch`` run twice on two CPU ranks: the
    first run gets the script's pre-time-limit signal on every rank, saves, and exits with the
    code on which the script requeues; the second run (the requeued job, same command line)
    continues from that checkpoint to the end."""
    kept, sig, requeue = slurm_script_command("cluster_7b")
    assert kept == ["--train.resume", "auto", "--train.exit_signal", sig], kept
    extra = [*kept, "--train.iters", "12", "--eval.interval", "0", "--logging.interval", "1"]
    procs = start(corpus, tmp_path, extra, n=2)
    _wait_for_iterations(tmp_path, 3, procs)
    for p in procs:  # SLURM signals every task of the job step
        p.send_signal(getattr(signal, sig))
    rc, log = finish(procs, tmp_path)
    assert rc == [requeue, requeue], log[-3000:]
    it = len(metrics(tmp_path))
    assert 3 <= it < 12
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "latest").read_text() == f"global_step{it}"
    (tmp_path / "metrics.jsonl").write_text("")
    rc, log = run_once(corpus, tmp_path, extra, n=2)
    assert rc == [0, 0], log[-3000:]
    assert f"resumed from {ckpt / f'global_step{it}'} at iteration {it}" in log
    assert [r["iteration"] for r in metrics(tmp_path)] == list(range(it + 1, 13))
    assert (ckpt / "latest").read_text() == "global_step12"


def test_resume_restores_the_rng_dropout_bitwise(corpus, tmp_path):
    """With dropout (the model's stream draws every step) a run stopped at iteration 4 and
    resumed with ``--resume auto`` continues the uninterrupted run bitwise: loss, lr, gradient
    norm and validation loss. Removing the saved RNG files makes the resumed curve differ, so
    the restore is what makes it equal."""
    drop = ["--model.dropout", "0.2", "--train.iters", "8", "--eval.interval", "4"]
    ref, cut, bare = tmp_path / "ref", tmp_path / "cut", tmp_path / "bare"
    runs = [start(corpus, ref, drop), start(corpus, cut, [*drop, "--train.exit_interval", "4"])]
    for procs, out in zip(runs, (ref, cut)):
        rc, log = finish(procs, out)
        assert rc == [0], log[-3000:]
    shutil.copytree(cut, bare)
    rng_files = sorted((bare / "ckpt" / "global_step4").glob("rng_rank*.pt"))
    assert [f.name for f in rng_files] == ["rng_rank00000.pt"]
    rng_files[0].unlink()
    reseal(bare / "ckpt" / "global_step4")  # as saved without RNG files
    runs = [start(corpus, out, [*drop, "--resume", "auto"]) for out in (cut, bare)]
    for procs, out in zip(runs, (cut, bare)):
        rc, log = finish(procs, out)
        assert rc == [0], log[-3000:]
        assert "resumed from" in log and "at iteration 4" in log
    assert "rng_rank00000.pt is missing: random streams start fresh" in log

    keys = ("iteration", "loss", "lr", "grad_norm", "val_loss")
    want = [[r.get(k) for k in keys] for r in metrics(ref)]
    assert [r["iteration"] for r in metrics(ref)] == list(range(1, 9))
    assert [[r.get(k) for k in keys] for r in metrics(cut)] == want  # bitwise
    fresh = [r["loss"] for r in metrics(bare)]
    assert fresh[:4] == [w[1] for w in want[:4]]
    assert all(a != b[1] for a, b in zip(fresh[4:], want[4:])), (fresh, want)


@pytest.fixture(scope="module")
def saved_at_5(corpus, tmp_path_factory) -> Path:
    """A run stopped after its complete checkpoint at iteration 5."""
    out = tmp_path_factory.mktemp("at5")
    rc, log = run_once(corpus, out, ["--train.exit_interval", "5"])
    assert rc == [0], log[-3000:]
    return out


def test_kill_inside_a_real_save_never_resumes_a_partial_checkpoint(corpus, saved_at_5, tmp_path):
    """SIGKILL at each point inside DeepSpeed's save of global_step10 in turn (rank files
    written, before the ``complete`` marker, before ``latest`` moves), each run resuming from the
    last: ``--resume auto`` loads global_step5 every time (reporting the partial global_step10
    while it is partial) and replays iterations 6-10 bitwise; a last run without a crash
    completes global_step10."""
    shutil.copytree(saved_at_5, tmp_path, dirs_exist_ok=True)
    extra = ["--train.exit_interval", "10", "--resume", "auto"]
    tag10 = tmp_path / "ckpt" / "global_step10"
    curves, partial = [], False
    for point in ("rank_files", "complete", "latest", None):
        (tmp_path / "metrics.jsonl").write_text("")
        env = {"TAPERED_MEGATRON_CRASH_IN_SAVE": point} if point else None
        rc, log = run_once(corpus, tmp_path, extra, env)
        assert rc == ([-signal.SIGKILL] if point else [0]), (point, log[-3000:])
        assert f"resumed from {tmp_path / 'ckpt' / 'global_step5'} at iteration 5" in log, point
        assert (f"{tag10} is partial" in log) == partial, (point, log[-3000:])
        curves.append([r["loss"] for r in metrics(tmp_path)])
        assert len(curves[-1]) == 5 and curves[-1] == curves[0], point
        assert tag10.is_dir()
        latest = (tmp_path / "ckpt" / "latest").read_text()
        assert latest == ("global_step5" if point else "global_step10"), point
        # before "latest" moves, global_step10 is already complete
        partial = point in ("rank_files", "complete")
        assert (tag10 / "complete").exists() != partial, point


@pytest.fixture(scope="module")
def disk_full_library(tmp_path_factory) -> Path:
    """``tests/disk_full.c`` built: LD_PRELOAD it to fill a directory's disk at a byte count."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build tests/disk_full.c")
    lib = tmp_path_factory.mktemp("disk_full") / "disk_full.so"
    src = Path(__file__).with_name("disk_full.c")
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src), "-ldl"], check=True)
    return lib


@pytest.mark.slow
def test_a_full_disk_inside_a_real_save_ends_in_one_line_and_keeps_latest(
    corpus, saved_at_5, disk_full_library, tmp_path
):
    """The disk fills halfway through the save of global_step10 (writes into its directory
    fail with ENOSPC at the OS boundary, in DeepSpeed's torch.save and ours alike): one line
    naming the directory, the free bytes and those a checkpoint needs (global_step5's size on
    disk), the partial global_step10 removed, ``latest`` still global_step5, nothing else left
    behind; a resume with room continues from global_step5."""
    from tapered_megatron.checkpoint.manifest import saved_bytes
    from tapered_megatron.checkpoint.save import size_text

    shutil.copytree(saved_at_5, tmp_path, dirs_exist_ok=True)
    ckpt = tmp_path / "ckpt"
    before = sorted(p.name for p in ckpt.iterdir())
    need = saved_bytes(ckpt)
    env = {"LD_PRELOAD": str(disk_full_library), "DISK_FULL_DIR": str(ckpt / "global_step10")}
    env["DISK_FULL_AFTER"] = str(need // 2)
    extra = ["--train.exit_interval", "10", "--resume", "auto"]
    rc, log = run_once(corpus, tmp_path, extra, env)
    assert rc == [1], log[-3000:]
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in log, log[-3000:]
    assert errors[0].startswith(f"error: {ckpt}: writing checkpoint global_step10 failed ("), errors
    assert f"a checkpoint needs about {size_text(need)}" in errors[0], errors
    assert "latest still names global_step5" in errors[0], errors
    assert sorted(p.name for p in ckpt.iterdir()) == before
    assert sorted(p.name for p in ckpt.glob("*latest*")) == ["latest"]
    assert (ckpt / "latest").read_text() == "global_step5"
    rc, log = run_once(corpus, tmp_path, extra)
    assert rc == [0], log[-3000:]
    assert f"resumed from {ckpt / 'global_step5'} at iteration 5" in log
    assert (ckpt / "latest").read_text() == "global_step10"


@pytest.mark.slow
def test_a_full_disk_on_one_rank_ends_every_rank_promptly_in_one_line(
    corpus, disk_full_library, tmp_path
):
    """Two ranks; only rank 1's writes into global_step4 fail with ENOSPC (inside DeepSpeed's
    save of its optimizer states): both ranks end at once (well inside the heartbeat's window and
    the collective timeout) with exit code 1 and one line naming the directory, the failing
    rank and the bytes a checkpoint needs; global_step4 is gone and ``latest`` still names
    global_step2."""
    from tapered_megatron.checkpoint.manifest import saved_bytes
    from tapered_megatron.checkpoint.save import size_text

    ckpt = tmp_path / "ckpt"
    env = {"LD_PRELOAD": str(disk_full_library), "DISK_FULL_DIR": str(ckpt / "global_step4")}
    env.update(DISK_FULL_AFTER="0", DISK_FULL_RANK="1")
    extra = ["--train.save_interval", "2", "--train.exit_interval", "4", "--eval.interval", "0"]
    procs = start(corpus, tmp_path, extra, env, n=2)
    deadline = time.time() + 240
    while not (ckpt / "global_step4").exists() and time.time() < deadline:
        if any(p.poll() is not None for p in procs):  # the save began and one rank ended
            break
        time.sleep(0.05)
    saving = time.time()
    rc, log = finish(procs, tmp_path)
    took = time.time() - saving
    assert rc == [1, 1], log[-3000:]
    assert took < 10, (took, log[-3000:])
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in log, log[-3000:]
    need = saved_bytes(ckpt)
    assert errors[0].startswith(
        f"error: {ckpt}: writing checkpoint global_step4 failed (rank 1: "
    ), errors
    assert f"a checkpoint needs about {size_text(need)}" in errors[0], errors
    assert "latest still names global_step2" in errors[0], errors
    assert sorted(p.name for p in ckpt.glob("global_step*")) == ["global_step2"]
    assert sorted(p.name for p in ckpt.glob("*latest*")) == ["latest"]
    assert (ckpt / "latest").read_text() == "global_step2"


def _start_dp2(corpus: str, out: Path, extra: list[str]) -> list:
    port = str(free_port())
    procs = []
    for r in range(2):
        env = dict(job_env(), RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2")
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        cmd = [sys.executable, "-u", MAIN, *common_args(corpus, out, "zero2.json", extra)]
        procs.append(popen_job(cmd, env))
    return procs


def _wait_for_iterations(out: Path, n: int, procs: list, limit: float = 300) -> None:
    deadline = time.time() + limit
    f = out / "metrics.jsonl"
    while time.time() < deadline:
        if f.exists() and len(f.read_text().splitlines()) >= n:
            return
        assert all(p.poll() is None for p in procs), "a rank ended before the fault"
        time.sleep(0.2)
    raise AssertionError("training did not reach the fault point")


@pytest.mark.parametrize(
    "sig", [pytest.param(signal.SIGSTOP, marks=pytest.mark.slow), signal.SIGKILL]
)
def test_a_stopped_or_killed_rank_ends_the_job(sig, corpus, tmp_path):
    """Rank 1 stopped (SIGSTOP: collective timeout 20 s) or killed (kill -9) after iteration 2:
    rank 0 exits non-zero within the timeout plus a margin, naming rank 1, and no process is
    left behind."""
    extra = ["--train.iters", "2000", "--train.collective_timeout_s", "20"]
    extra += ["--eval.interval", "0", "--logging.interval", "1"]
    procs = _start_dp2(corpus, tmp_path, extra)
    try:
        _wait_for_iterations(tmp_path, 2, procs)
        t = time.time()
        os.kill(procs[1].pid, sig)
        log = procs[0].communicate(timeout=60 + (20 if sig == signal.SIGSTOP else 0))[0]
        took = time.time() - t
        (tmp_path / "log.txt").write_text(log)
        print(f"{signal.Signals(sig).name}: rank 0 exited after {took:.1f} s: {log[-400:]}")
        assert procs[0].returncode == 1, log[-3000:]
        assert took < (80 if sig == signal.SIGSTOP else 60), took
        last = log.strip().splitlines()[-1]
        assert last.startswith("error: rank 0: rank 1 stopped responding"), log[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    assert all(p.poll() is not None for p in procs)


def test_heartbeat_names_the_rank_that_stopped():
    """Three ranks' heartbeats in one store: the rank whose beating stops is named, the live
    ones are not."""
    store = torch.distributed.HashStore()
    beats = [Heartbeat(store, r, 3, period=0.5).start() for r in range(3)]
    try:
        assert beats[0].unresponsive() == []
        beats[2].stop()
        time.sleep(0.6)  # its thread ends within one period
        assert beats[0].unresponsive() == [2]
        assert "rank 2 stopped responding" in beats[1].describe()
        assert beats[2].describe() == ""  # the others still beat
    finally:
        for b in beats:
            b.stop()
    assert period_for(20) == 2.0 and period_for(600) == 10.0 and period_for(1) == 1.0


def test_heartbeat_thread_names_a_stopped_rank_once(capsys):
    """The heartbeat's own thread names a rank whose counter stands still (rank 0 watches every
    rank, the others watch rank 0), once; a later failed collective does not repeat the line."""
    store = torch.distributed.HashStore()
    beats = [Heartbeat(store, r, 3, period=0.4).start() for r in range(3)]
    try:
        time.sleep(2.0)
        assert capsys.readouterr().err == ""  # every rank beats: nothing said
        beats[2].stop()
        time.sleep(2.5)  # its last beat, then 2.5 periods standing still, then a check
        err = capsys.readouterr().err.splitlines()
        assert err == [
            "error: rank 0: rank 2 stopped responding (no heartbeat for 1 s: stopped, killed or "
            "stuck holding the interpreter)"
        ]
        # main.py's path once the collective fails: rank 0's thread already named rank 2
        assert beats[0].explain(RuntimeError("timed out\nmore")) is True
        assert capsys.readouterr().err == ""
        assert beats[1].explain(RuntimeError("timed out\nmore")) is True  # its thread watches 0
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith("error: rank 1: rank 2 stopped responding")
        assert err[0].endswith("; stopping (RuntimeError: timed out)")
        beats[0].stop()
        time.sleep(2.5)
        err = capsys.readouterr().err
        assert err.startswith("error: rank 1: rank 0 stopped responding") and err.count("\n") == 1
    finally:
        for b in beats:
            b.stop()


# Two gloo ranks whose collective never returns (the hour-long timeout stands in for a backend
# that aborts the process instead of raising, as NCCL's watchdog does): one rank stops itself.
_HANG = """
import os, signal, sys
from datetime import timedelta
import torch, torch.distributed as dist
from torch.distributed import distributed_c10d
from tapered_megatron.training.heartbeat import Heartbeat, period_for
dist.init_process_group("gloo", timeout=timedelta(hours=1))
store, rank = distributed_c10d._get_default_store(), dist.get_rank()
beat = Heartbeat(store, rank, 2, period_for(float(sys.argv[1]))).start()
dist.barrier()
if rank == int(sys.argv[2]):
    os.kill(os.getpid(), signal.SIGSTOP)
print("in the collective", flush=True)
dist.all_reduce(torch.ones(1))
"""


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.mark.parametrize("stopped", [1, pytest.param(0, marks=pytest.mark.slow)])
def test_a_stopped_rank_is_named_when_the_backend_aborts_instead_of_raising(stopped, tmp_path):
    """One rank stops (SIGSTOP) while the other waits in a collective that never returns; the
    waiting rank is SIGKILLed from outside after the collective timeout (10 s), as an aborting
    backend would end it. Its heartbeat thread has named the stopped rank on stderr by then,
    once. Rank 1 stopped: rank 0 reads its counter; rank 0 stopped: the store it hosts does not
    answer rank 1."""
    timeout, port, waiting = 10, str(free_port()), 1 - stopped
    procs, errs = [], []
    for r in range(2):
        env = dict(
            job_env(), RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port
        )
        errs.append(open(tmp_path / f"err{r}.txt", "w"))  # noqa: SIM115 (closed below)
        cmd = [sys.executable, "-c", _HANG, str(timeout), str(stopped)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=errs[r]))
    try:
        assert procs[waiting].stdout.readline() == b"in the collective\n"
        deadline = time.time() + 60
        while _state(procs[stopped].pid) != "T":
            assert time.time() < deadline and procs[stopped].poll() is None, "no rank stopped"
            time.sleep(0.1)
        time.sleep(timeout)
        assert procs[waiting].poll() is None, "the collective returned"
        procs[waiting].kill()
        assert procs[waiting].wait() == -signal.SIGKILL
    finally:
        for p, f in zip(procs, errs):
            p.kill()
            p.wait()
            f.close()
    err = (tmp_path / f"err{waiting}.txt").read_text()
    named = [x for x in err.splitlines() if "stopped responding" in x]
    assert named == [
        f"error: rank {waiting}: rank {stopped} stopped responding (no heartbeat for 2.5 s: "
        "stopped, killed or stuck holding the interpreter)"
    ], err[-2000:]
