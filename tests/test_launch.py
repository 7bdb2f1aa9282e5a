"""`python -m tpu_scale.launch` and Slurm job steps: real worker processes on localhost.

This file is also the workers' script (`python tests/test_launch.py fit FOLDER`): a small
`model.fit` under `tpu_scale.create_strategy()` with no arguments, so the cluster and the CPUs per
worker come from the environment the launcher or Slurm set. It prints `resumed <epoch> <step>`,
`step <epoch> <step>` after each step and `saved <epoch>` after each epoch, and writes its final
weights and its strategy's cluster to `FOLDER/worker<task>.npz` / `.json`. While `FOLDER/slow`
exists, each step sleeps, so that a signal lands in the middle of the run.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from slurm_cluster import free_port_base

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THIS = os.path.abspath(__file__)
EPOCHS, STEPS = 6, 5


def fit(folder):
    """The workers' script: trains, resuming from `folder/backup`; see the module docstring."""
    import tpu_scale

    strategy = tpu_scale.create_strategy(gradient_reduction="native")
    import keras
    import tensorflow as tf

    from tpu_scale import checkpointing

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 1))).astype("float32")
    backup_dir = os.path.join(folder, "backup")
    resume = checkpointing.latest_backup(backup_dir)
    steps_done = resume.epoch * STEPS if resume else 0

    def dataset_fn(context):
        # Every pipeline reads the same stream, continued where the backup's epoch began.
        replicas_fed = context.num_replicas_in_sync // context.num_input_pipelines
        per_replica = context.get_per_replica_batch_size(16)
        stream = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(per_replica)
        return stream.skip(steps_done * replicas_fed)

    dataset = strategy.distribute_datasets_from_function(dataset_fn)
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential(
            [keras.Input((5,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)]
        )
        model.compile(optimizer=keras.optimizers.SGD(0.02, momentum=0.9), loss="mse")
    backup = checkpointing.BackupAndRestore(backup_dir)

    class Report(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            done = backup.restored
            print("resumed", done.epoch if done else 0, done.step if done else 0, flush=True)

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            print("step", self.epoch, batch + 1, flush=True)
            if os.path.exists(os.path.join(folder, "slow")):
                time.sleep(0.2)

        def on_epoch_end(self, epoch, logs=None):
            print("saved", epoch + 1, flush=True)

    with checkpointing.peer_failures_explained(strategy):
        model.fit(
            dataset,
            epochs=EPOCHS,
            steps_per_epoch=STEPS,
            callbacks=[backup, Report()],
            verbose=0,
            shuffle=False,
        )
    resolver = strategy.cluster_resolver
    task = resolver.task_id
    np.savez(os.path.join(folder, f"worker{task}.npz"), *[w.numpy() for w in model.weights])
    with open(os.path.join(folder, f"worker{task}.json"), "w") as f:
        json.dump(
            {
                "workers": resolver.cluster_spec().as_dict()["worker"],
                "task": [resolver.task_type, task],
                "mesh": list(strategy.mesh.shape),
                "resolver": type(resolver).__name__,
            },
            f,
        )


def fail(seconds):
    """A worker script without TensorFlow: worker 1 prints and fails; the others wait."""
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    print(f"worker {index} started", flush=True)
    if index == 1:
        print("reading the records", flush=True)
        print("the last words of worker 1", flush=True)
        sys.exit(3)
    time.sleep(float(seconds))
    print(f"worker {index} was not stopped", flush=True)


def listen(folder):
    """A worker script: starts the cluster's servers (a strategy), then writes where its process
    listens (the TCP ports of its network namespace) and which namespace that is."""
    import tpu_scale

    strategy = tpu_scale.create_strategy(gradient_reduction="native")
    task = strategy.cluster_resolver.task_id
    with open(os.path.join(folder, f"worker{task}.json"), "w") as f:
        json.dump(
            {
                "namespace": os.readlink("/proc/self/ns/net"),
                "listening": _listening_ports(),
                "devices": _network_devices(),
                "address": strategy.cluster_resolver.cluster_spec().as_dict()["worker"][task],
            },
            f,
        )


def _network_devices():
    """The network devices of this process's namespace (`ip link` lists them), from /proc."""
    with open("/proc/self/net/dev") as f:
        return sorted(line.split(":")[0].strip() for line in f.read().splitlines()[2:])


def _listening_ports():
    """`{port: local address}` of the TCP sockets listening in this process's network namespace
    (what `ss -ltn` lists), from /proc; the ports as text, as JSON keeps them."""
    found = {}
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A":  # LISTEN
                    address, port = local.rsplit(":", 1)
                    found[str(int(port, 16))] = address
    return found


# --------------------------------------------------------------------------- the tests


def _env():
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG" and not k.startswith("SLURM")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    return env


def _launch(*args):
    """The launcher, started on this file; its output (stdout and stderr) goes to a pipe."""
    command = [sys.executable, "-m", "tpu_scale.launch", *args]
    return subprocess.Popen(
        command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )




def _slurm_step(folder, tasks=2):
    """Two processes as `srun --ntasks 2` on one node would start them, without TF_CONFIG."""
    from tpu_scale.launch import Workers

    base = free_port_base(tasks)
    step = {
        "SLURM_JOB_ID": "4242",
        "SLURM_NTASKS": str(tasks),
        "SLURM_STEP_NUM_TASKS": str(tasks),
        "SLURM_STEP_NODELIST": "localhost",
        "SLURM_STEP_TASKS_PER_NODE": str(tasks),
        "TPU_SCALE_SLURM_PORT_BASE": str(base),
        "TPU_SCALE_CPUS_PER_WORKER": "2",
        "TF_CPP_MIN_LOG_LEVEL": "2",
    }
    envs = [dict(_env(), **step, SLURM_PROCID=str(i), SLURM_LOCALID=str(i)) for i in range(tasks)]
    command = [sys.executable, THIS, "fit", folder]
    return Workers([command] * tasks, envs), [f"localhost:{base + i}" for i in range(tasks)]


def _wait_for_line(proc, pattern, timeout, seen):
    """Reads `proc`'s stdout until a line matches; `seen` collects the lines read."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if re.search(pattern, line):
            return
    raise AssertionError(f"no line matching {pattern!r}:\n{''.join(seen)[-4000:]}")


def _result(folder, task):
    with np.load(os.path.join(folder, f"worker{task}.npz")) as f:
        weights = [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]
    with open(os.path.join(folder, f"worker{task}.json")) as f:
        return weights, json.load(f)


@pytest.mark.multiprocess
def test_launcher_preempts_and_resumes_and_slurm_builds_the_same_cluster(tmp_path):
    launched, slurm = str(tmp_path / "launched"), str(tmp_path / "slurm")
    os.makedirs(launched)
    os.makedirs(slurm)
    open(os.path.join(launched, "slow"), "w").close()
    command = ["--num_workers", "2", "--num_cpu_replicas", "2", "--", THIS, "fit", launched]

    # The launcher's cluster and a Slurm step of two tasks train side by side.
    step, slurm_addresses = _slurm_step(slurm)
    try:
        first = _launch(*command)
        seen = []
        _wait_for_line(first, r"^\[worker 0\] saved 1$", 240, seen)
        first.send_signal(signal.SIGTERM)
        out, err = first.communicate(timeout=120)
        seen.append(out)
        out = "".join(seen)
        assert first.returncode == 143, out[-3000:] + err[-3000:]
        assert "SIGTERM forwarded to every worker; exit codes [143, 143]" in err
        for task in (0, 1):
            assert re.search(rf"^\[worker {task}\] .*Preempted \(SIGTERM", out, re.M), out[-3000:]
        step.wait(timeout=240)
        assert step.returncodes() == [0, 0], [step.tail(i) for i in (0, 1)]
    finally:
        step.kill()

    # The same command resumes where the preempted run saved, and finishes.
    os.remove(os.path.join(launched, "slow"))
    second = _launch(*command)
    out, err = second.communicate(timeout=240)
    assert second.returncode == 0, out[-3000:] + err[-3000:]
    resumed = re.findall(r"^\[worker (\d)\] resumed (\d+) (\d+)$", out, re.M)
    assert sorted(t for t, _, _ in resumed) == ["0", "1"]
    assert len({(e, s) for _, e, s in resumed}) == 1 and resumed[0][1:] != ("0", "0")

    runs = {
        name: [_result(folder, t) for t in (0, 1)]
        for name, folder in (("launched", launched), ("slurm", slurm))
    }
    for name, ((weights0, info0), (weights1, info1)) in runs.items():
        # Both workers end with the same weights: one synchronous run over 2 workers x 2 CPUs.
        for a, b in zip(weights0, weights1):
            np.testing.assert_array_equal(a, b, err_msg=name)
        assert info0["mesh"] == info1["mesh"] == [2, 2], name
        assert [info0["task"], info1["task"]] == [["worker", 0], ["worker", 1]], name
    assert runs["slurm"][0][1]["workers"] == slurm_addresses
    assert runs["slurm"][0][1]["resolver"] == "SlurmClusterResolver"
    assert runs["launched"][0][1]["resolver"] == "TFConfigClusterResolver"
    # The preempted-and-resumed run computes what the uninterrupted Slurm run computes.
    for got, want in zip(runs["launched"][0][0], runs["slurm"][0][0]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_the_example_trains_on_two_launched_workers(tmp_path):
    # The README's two-worker command, shrunk: both workers train the same model on the generated
    # data and log the same losses, and the chief saves the final model.
    example = os.path.join(ROOT, "examples", "train_imagenet.py")
    proc = _launch(
        "--num_workers", "2", "--", example, "--image_size", "16", "--epochs", "2",
        "--synthetic_train_examples", "128", "--synthetic_validation_examples", "32",
        "--global_batch_size", "32", "--num_cpu_replicas", "1", "--noprogress",
        "--model_dir", str(tmp_path / "run"),
    )  # fmt: skip
    out, err = proc.communicate(timeout=400)
    text = out + err
    assert proc.returncode == 0, text[-4000:]
    losses = {}
    for worker, epoch, loss in re.findall(r"\[worker (\d)\].*epoch (\d)/2:.*loss ([0-9.]+)", text):
        losses.setdefault(epoch, {})[worker] = loss
    assert set(losses) == {"1", "2"}, text[-4000:]
    assert all(set(by_worker) == {"0", "1"} for by_worker in losses.values()), losses
    assert all(len(set(by_worker.values())) == 1 for by_worker in losses.values()), losses
    assert os.path.exists(tmp_path / "run" / "final.keras")


def test_the_workers_servers_are_reachable_from_this_host_only_through_the_job(tmp_path):
    """TensorFlow's servers bind every interface: the launcher's workers run in a network
    namespace of their own, holding only the loopback device, so no other host can reach them."""
    proc = _launch("--num_workers", "2", "--", THIS, "listen", str(tmp_path))
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert "cannot give the workers a network of their own" not in err
    workers = [json.load(open(tmp_path / f"worker{t}.json")) for t in (0, 1)]
    mine = os.readlink("/proc/self/ns/net")
    assert workers[0]["namespace"] == workers[1]["namespace"] != mine  # one network, not the host's
    assert workers[0]["devices"] == ["lo"]
    for worker in workers:
        port = worker["address"].rsplit(":", 1)[1]
        assert port in worker["listening"]  # the server listens, inside the job's network only


def test_the_host_network_is_asked_for_by_name(tmp_path):
    proc = _launch("--num_workers", "2", "--network", "host", "--", THIS, "listen", str(tmp_path))
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    workers = [json.load(open(tmp_path / f"worker{t}.json")) for t in (0, 1)]
    assert workers[0]["namespace"] == os.readlink("/proc/self/ns/net")
    # On the host's network it listens on every interface: what the default keeps from other hosts.
    port = workers[0]["address"].rsplit(":", 1)[1]
    assert workers[0]["listening"][port] in ("00000000", "00000000000000000000000000000000")


def test_a_failing_worker_stops_the_others_and_is_named():
    proc = _launch("--num_workers", "3", "--grace_seconds", "5", "--", THIS, "fail", "120")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3
    # Workers 0 and 2 wait 120 s unless stopped (they may be stopped before they print anything).
    assert "[worker 1] reading the records" in out and "was not stopped" not in out
    assert "worker 1 failed with exit code 3; stopped the other 2. Its last lines:" in err
    assert err.rstrip().endswith("the last words of worker 1")


@pytest.mark.parametrize(
    "args,message",
    [
        (["--num_workers", "2"], "name the script after --"),
        (["--num_workers", "0", "--", "x.py"], "give 1 or more workers"),
        (["--num_workers", "2", "--num_cpu_replicas", "0", "--", "x.py"], "give 1 or more"),
        (["--num_workers", "2", "--", "no_such_script.py"], "no script 'no_such_script.py'"),
        (["--num_workers", "2", "--", "no-such-program"], "neither a .py script nor a program"),
    ],
)
def test_bad_launcher_arguments_are_named(args, message, capsys):
    from tpu_scale import launch

    with pytest.raises(SystemExit) as stopped:
        launch.main(args)
    assert stopped.value.code == 2 and message in capsys.readouterr().err


def test_worker_environments_name_every_worker_and_their_own_task():
    from tpu_scale import launch

    envs = launch.worker_environments(3, cpus_per_worker=2, base={})
    configs = [json.loads(env["TF_CONFIG"]) for env in envs]
    workers = configs[0]["cluster"]["worker"]
    assert len(set(workers)) == 3 and all(w.startswith("localhost:") for w in workers)
    assert [c["cluster"]["worker"] for c in configs] == [workers] * 3
    assert [c["task"] for c in configs] == [{"type": "worker", "index": i} for i in range(3)]
    assert {env["TPU_SCALE_CPUS_PER_WORKER"] for env in envs} == {"2"}


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    {"fit": fit, "fail": fail, "listen": listen}[sys.argv[1]](*sys.argv[2:])
