"""examples/slurm/train_imagenet_cpu.sbatch on a real one-node Slurm cluster (munged, slurmctld,
slurmd on this host, `tests/slurm_cluster.py`): a job of two tasks, a preempted job and its
resubmission, and a task that fails.

Each job is the script as users submit it, with sbatch options that fit the one node (two tasks
of one CPU) and, after the script's name, flags that shrink the run (16-pixel images, 128 training
examples, 4 steps an epoch) and make it deterministic, so that a resumed run can be compared with
an uninterrupted one. Where Slurm cannot run (not installed, not root) the tests skip and say so;
under CI (`CI` set) that is a failure instead.
"""

import os
import re
import signal
import sys
import zipfile

import numpy as np
import pytest
import slurm_cluster as slurm_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join("examples", "slurm", "train_imagenet_cpu.sbatch")
EPOCHS = 4
FLAGS = [
    "--image_size", "16", "--synthetic_train_examples", "128", "--synthetic_validation_examples", "32",
    "--global_batch_size", "32", "--epochs", str(EPOCHS), "--num_cpu_replicas", "1",
    "--deterministic", "--seed", "1",
]  # fmt: skip
JOB_SECONDS = 240  # bounds each job; one takes about 40 s here

# One cluster and one uninterrupted job serve every test here: under pytest-xdist's
# `--dist loadgroup` they run on one worker.
pytestmark = [pytest.mark.slurm, pytest.mark.multiprocess, pytest.mark.xdist_group("slurm")]


@pytest.fixture(scope="module")
def slurm():
    reason = slurm_lib.unavailable()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the Slurm tests: {reason}")
        pytest.skip(reason)
    with slurm_lib.SlurmCluster() as cluster:
        if cluster.cpus < 2:
            pytest.skip(f"the jobs run 2 tasks of 1 CPU; node {cluster.node} has {cluster.cpus}")
        yield cluster


def submit(slurm, folder, name, *flags):
    """Submits the CPU script from the checkout as a job of 2 tasks on the one node; returns the job
    id and its output file. Its run folder is `folder/run`."""
    output = os.path.join(folder, f"{name}.out")
    env = {
        "MODEL_DIR": os.path.join(folder, "run"),
        "TPU_SCALE_SLURM_PORT_BASE": str(slurm_lib.free_port_base(2)),
        # `python` in the script is this interpreter.
        "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]),
    }
    options = ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1"]
    job = slurm.sbatch(SCRIPT, *FLAGS, *flags, options=options, output=output, env=env, cwd=ROOT)
    return job, output


def read(path):
    with open(path, errors="replace") as f:
        return f.read()


def task_lines(text, task, pattern):
    """The lines srun labelled with `task` that match `pattern`, without the label."""
    label = f"{task}: "
    lines = [line[len(label) :] for line in text.splitlines() if line.startswith(label)]
    return [line for line in lines if re.search(pattern, line)]


def epoch_lines(text, task):
    """A task's per-epoch results (loss, accuracies) and its final top-1, without timings."""
    epochs = [
        re.sub(r".*(epoch \d+/\d+): .*?(loss .*)", r"\1 \2", line)
        for line in task_lines(text, task, r"epoch \d+/\d+: ")
    ]
    return epochs + [line.split(" | ")[0] for line in task_lines(text, task, r"^top-1 ")]


def final_weights(folder):
    """The weights in `folder/run/final.keras` (a zip holding `model.weights.h5`), in file order."""
    import h5py

    with zipfile.ZipFile(os.path.join(folder, "run", "final.keras")) as archive:
        archive.extract("model.weights.h5", folder)
    weights = []
    with h5py.File(os.path.join(folder, "model.weights.h5"), "r") as f:
        f.visititems(
            lambda name, item: (
                weights.append((name, item[()])) if isinstance(item, h5py.Dataset) else None
            )
        )
    return weights


@pytest.fixture(scope="module")
def uninterrupted(slurm, tmp_path_factory):
    """One job of 2 tasks run to the end: its folder, output and final job fields."""
    folder = str(tmp_path_factory.mktemp("uninterrupted"))
    job, output = submit(slurm, folder, "job")
    state = slurm.wait(job, JOB_SECONDS)
    return folder, read(output), state


def test_a_job_of_two_tasks_trains_one_model(uninterrupted):
    folder, text, state = uninterrupted
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), text[-4000:]
    for task in (0, 1):
        found = task_lines(text, task, "cluster from Slurm")
        assert len(found) == 1 and f"SLURM_PROCID {task}: task worker {task}" in found[0], text
        assert "2 workers x 1 CPU, 2 replicas, mesh 2x1" in found[0]
    # One synchronous run: both tasks see the same losses and accuracies, epoch by epoch.
    results = [epoch_lines(text, task) for task in (0, 1)]
    assert len(results[0]) == EPOCHS + 1 and results[0] == results[1], results
    assert os.path.exists(os.path.join(folder, "run", "final.keras"))  # the chief's


def test_a_preempted_job_saves_on_every_task_and_the_resubmitted_job_resumes(
    slurm, uninterrupted, tmp_path
):
    folder = str(tmp_path)
    job, output = submit(slurm, folder, "preempted")
    # Past the first epoch (whose backup the chief wrote before logging it) on both tasks.
    slurm_lib.wait_for_lines(output, r"^[01]: .*epoch 1/", 2, JOB_SECONDS, job, slurm)
    slurm.run("scancel", "--signal=TERM", str(job))  # as Slurm's --signal or a preemption does
    state = slurm.wait(job, JOB_SECONDS)
    text = read(output)
    assert (state["JobState"], state["ExitCode"]) == ("FAILED", "143:0"), text[-4000:]
    saved = [task_lines(text, task, r"Preempted \(SIGTERM") for task in (0, 1)]
    assert all(len(lines) == 1 for lines in saved), text[-4000:]
    where = [re.search(r"after epoch (\d+) step (\d+)", lines[0]).groups() for lines in saved]
    assert where[0] == where[1], saved  # both tasks stopped at the same step
    assert "srun: error: " in text and "Exited with exit code 143" in text
    epoch, step = int(where[0][0]), int(where[0][1])  # in epoch `epoch` (from 1), after `step`

    job, output = submit(slurm, folder, "resubmitted")
    state = slurm.wait(job, JOB_SECONDS)
    text = read(output)
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), text[-4000:]
    resumed = f"Resuming from the backup after epoch {epoch - 1} of {EPOCHS}"
    resumed += f" and {step} steps (" if step else " ("
    for task in (0, 1):
        assert task_lines(text, task, re.escape(resumed)), text[-4000:]
    # The resumed run ends on the uninterrupted run's weights, bit for bit: the same batches in the
    # same order (--deterministic), the same updates on the same 2 tasks x 1 replica, and the
    # backup holds the exact float32 state. (tests/test_checkpointing.py allows rtol 1e-5 because
    # its reference runs in another layout, one process, whose sums add in another order.)
    got, want = final_weights(folder), final_weights(uninterrupted[0])
    assert [name for name, _ in got] == [name for name, _ in want]
    for (name, a), (_, b) in zip(got, want):
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_a_failing_task_stops_the_step_and_is_named(slurm, tmp_path):
    job, output = submit(slurm, str(tmp_path), "failing")
    slurm_lib.wait_for_lines(output, r"^[01]: .*cluster from Slurm", 2, JOB_SECONDS, job, slurm)
    # Task 1 dies as the kernel's out-of-memory killer would end it; task 0 would wait for it in
    # the gradient sum, and --kill-on-bad-exit stops it.
    os.kill(slurm.task_pids(job)[1], signal.SIGKILL)
    state = slurm.wait(job, JOB_SECONDS)
    text = read(output)
    assert state["JobState"] == "FAILED", text[-4000:]
    assert f"srun: error: {slurm.node}: task 1: Killed" in text, text[-4000:]
    assert "srun: Force Terminated" in text  # --kill-on-bad-exit ended task 0
    assert not task_lines(text, 0, r"^top-1 ")
