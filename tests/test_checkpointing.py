"""checkpointing: kills at any instant, damaged backups, preemption, and dead or frozen peers.

The training runs are real processes (tests/checkpointing_child.py), killed by the tests that start
them; every process is killed at teardown if still running, and every file lives under `tmp_path`.
"""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import types

import keras
import numpy as np
import pytest

from tpu_scale import checkpointing
from tpu_scale.testing.multiworker import free_ports, tf_config

TESTS = os.path.dirname(os.path.abspath(__file__))
CHILD = os.path.join(TESTS, "checkpointing_child.py")
sys.path.insert(0, TESTS)
import checkpointing_child  # noqa: E402


class Processes:
    """Starts the child training runs and kills whichever still runs at the end of a test."""

    def __init__(self, folder):
        self.folder = folder
        self.started = []
        self.env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TPU_SCALE_CPUS_PER_WORKER="2")
        self.env["PYTHONPATH"] = os.pathsep.join(
            [os.path.dirname(TESTS), self.env.get("PYTHONPATH", "")]
        )
        self.env.pop("TF_CONFIG", None)
        # The children's temporary files (TensorFlow's, a worker's private save) stay in the test's.
        self.env["TMPDIR"] = os.path.join(folder, "tmp")
        os.makedirs(self.env["TMPDIR"])

    def start(self, options, name, tf_config_json=None):
        log_path = os.path.join(self.folder, f"{name}.log")
        env = dict(self.env, TF_CONFIG=tf_config_json) if tf_config_json else self.env
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [sys.executable, CHILD, json.dumps(options)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        proc.log_path = log_path
        self.started.append(proc)
        return proc

    def cluster(self, options_per_worker, name):
        ports = free_ports(len(options_per_worker))
        return [
            self.start(options, f"{name}_worker{i}", tf_config(ports, i))
            for i, options in enumerate(options_per_worker)
        ]

    def kill_all(self):
        for proc in self.started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture
def processes(tmp_path):
    started = Processes(str(tmp_path))
    yield started
    started.kill_all()


def output(proc):
    with open(proc.log_path, errors="replace") as f:
        return f.read()


def wait_for(proc, pattern, timeout):
    """Waits until `proc` prints a line matching `pattern`; returns the match."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        matches = list(re.finditer(pattern, output(proc), re.MULTILINE))
        if matches:
            return matches[-1]
        if proc.poll() is not None:
            break
        time.sleep(0.02)
    raise AssertionError(
        f"No line matching {pattern!r} within {timeout} s (exit code "
        f"{proc.poll()}):\n{output(proc)[-4000:]}"
    )


def wait_exit(proc, timeout):
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"Still running after {timeout} s:\n{output(proc)[-4000:]}") from None


def resumed_at(proc):
    match = re.search(r"^resumed (\d+) (\d+)$", output(proc), re.MULTILINE)
    assert match, output(proc)[-4000:]
    return int(match.group(1)), int(match.group(2))


def last_saved_epoch(proc):
    saved = re.findall(r"^saved (\d+)$", output(proc), re.MULTILINE)
    return int(saved[-1]) if saved else 0


def load_weights(path):
    with np.load(path) as f:
        return [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]


# --------------------------------------------------------------------------- one process


def test_kill_at_any_moment_loses_at_most_an_epoch(processes, tmp_path):
    """SIGKILL inside and between backup writes, and one SIGTERM; the last rerun ends exactly."""
    options = {
        "backup_dir": str(tmp_path / "backup"),
        "epochs": 10,
        "steps": 4,
        "slow_save": 0.15,
        "global_batch": 8,
    }
    rng = random.Random(0)
    killed_in_writes = 0
    plan = [
        ("SIGKILL", "wrote", 2),
        ("SIGKILL", "wrote", 3),
        ("SIGTERM", "step", 5),
        ("SIGKILL", "step", 3),
    ]
    for attempt, (signal_name, event, nth) in enumerate(plan):
        proc = processes.start(options, f"run{attempt}")
        wait_for(proc, r"^resumed", 90)
        before = output(proc).count(f"\n{event} ")
        deadline = time.monotonic() + 60
        while output(proc).count(f"\n{event} ") < before + nth and proc.poll() is None:
            assert time.monotonic() < deadline, output(proc)[-4000:]
            time.sleep(0.01)
        # Inside the write (the slow save sleeps after the weights file is written, before the
        # folder is complete) or anywhere in the next steps.
        time.sleep(rng.uniform(0.0, 0.2))
        saved_before_kill = last_saved_epoch(proc)
        proc.send_signal(getattr(signal, signal_name))
        code = wait_exit(proc, 30)
        if signal_name == "SIGTERM":
            assert code == checkpointing.PREEMPTED_EXIT_CODE, output(proc)[-4000:]
            assert "Preempted (SIGTERM on this process): saved the training state" in output(proc)
        else:
            assert code == -signal.SIGKILL
        killed_in_writes += any(
            name.startswith(".tmp-backup-") for name in os.listdir(options["backup_dir"])
        )
        backup = checkpointing.latest_backup(options["backup_dir"])
        assert backup is not None and backup.epoch >= saved_before_kill, (backup, saved_before_kill)
        if signal_name == "SIGTERM":
            assert backup.reason == "preemption" and backup.step > 0
    assert killed_in_writes >= 1  # at least one kill left a half-written backup folder behind
    final = processes.start(dict(options, out=str(tmp_path / "final.npz")), "final")
    assert wait_exit(final, 120) == 0, output(final)[-4000:]
    assert resumed_at(final) == (backup.epoch, backup.step)
    assert "damaged" not in output(final)
    names = sorted(os.listdir(options["backup_dir"]))
    assert len(names) == 2 and all(n.startswith("backup-") for n in names), names

    # The same run without interruptions, here: 2 CPU replicas as in the child.
    reference = checkpointing_child.main(
        {"backup_dir": str(tmp_path / "reference"), "epochs": 10, "steps": 4, "global_batch": 8}
    )
    for got, want in zip(load_weights(tmp_path / "final.npz"), reference):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _tiny_model():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    return model


def _tiny_fit(model, callback, epochs):
    x = np.linspace(-1, 1, 24, dtype="float32").reshape(8, 3)
    return model.fit(
        x, x[:, :2], batch_size=4, epochs=epochs, shuffle=False, verbose=0, callbacks=[callback]
    )


def test_damaged_newest_backup_falls_back_with_a_warning(tmp_path, caplog):
    backup_dir = str(tmp_path / "backup")
    _tiny_fit(_tiny_model(), checkpointing.BackupAndRestore(backup_dir, delete_checkpoint=False), 2)
    newest = checkpointing.latest_backup(backup_dir)
    assert (newest.epoch, newest.step, newest.reason) == (2, 0, "epoch")
    weights = os.path.join(newest.path, checkpointing.WEIGHTS_FILE)
    with open(weights, "r+b") as f:
        f.truncate(96)  # as a kill during Keras's own in-place write leaves it

    callback = checkpointing.BackupAndRestore(backup_dir, delete_checkpoint=False)
    with caplog.at_level("WARNING"):
        history = _tiny_fit(_tiny_model(), callback, 3)
    assert callback.restored.epoch == 1 and len(history.history["loss"]) == 2
    message = "\n".join(r.getMessage() for r in caplog.records)
    assert f"Backup {newest.path} is damaged: {weights} holds 96 bytes" in message
    assert "restoring the previous backup" in message

    # Nothing complete left: the warning says training starts over.
    for _, path in checkpointing.backups._sequences(backup_dir):
        with open(os.path.join(path, checkpointing.METADATA_FILE), "w") as f:
            f.write('{"epoch": ')
    caplog.clear()
    callback = checkpointing.BackupAndRestore(backup_dir)
    with caplog.at_level("WARNING"):
        history = _tiny_fit(_tiny_model(), callback, 2)
    assert callback.restored is None and len(history.history["loss"]) == 2
    assert "training starts over from epoch 0" in caplog.text
    assert not os.path.exists(backup_dir)  # delete_checkpoint after a complete fit


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MB tmpfs (a real filesystem that fills up); mounting needs root, as CI runs."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    folder = tmp_path / "small_disk"
    folder.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], check=True)
    try:
        yield folder
    finally:
        # Lazily: a file something still holds open must not leave the mount behind.
        subprocess.run(["umount", "--lazy", str(folder)], check=True)


def test_a_full_disk_names_the_folder_and_the_last_good_backup(small_disk):
    # 100,000 weights and an SGD momentum of as many: one backup (800 KB) fits, a second does not.
    model = keras.Sequential([keras.Input((1000,)), keras.layers.Dense(100, use_bias=False)])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    model.fit(np.ones((4, 1000), "float32"), np.zeros((4, 100), "float32"), verbose=0)
    backup_dir = str(small_disk / "backup")
    first = checkpointing.backups.write_backup(model, backup_dir, 1, 0, "epoch", keep=3)
    with pytest.raises(checkpointing.BackupWriteError) as raised:
        checkpointing.backups.write_backup(model, backup_dir, 2, 0, "epoch", keep=3)
    message = str(raised.value)
    assert f"Could not write a backup to {backup_dir!r}" in message
    assert "MB is free there" in message and "a backup of this model takes about 0.8 MB" in message
    assert f"The last good backup, {first.path} (epoch 1, step 0), is intact" in message
    # The partial save is gone, and the run resumes from the last good backup.
    assert os.listdir(backup_dir) == [os.path.basename(first.path)]
    assert checkpointing.latest_backup(backup_dir).path == first.path


def test_a_full_disk_at_the_final_save_leaves_the_backup_to_resume_from(small_disk):
    import tensorflow as tf

    from tpu_scale import training

    model = keras.Sequential([keras.Input((1000,)), keras.layers.Dense(100, use_bias=False)])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    model.fit(np.ones((4, 1000), "float32"), np.zeros((4, 100), "float32"), verbose=0)
    model_dir = str(small_disk)
    backup_dir = os.path.join(model_dir, training.BACKUP_DIR)
    last = checkpointing.backups.write_backup(model, backup_dir, 3, 0, "epoch", keep=3)
    with pytest.raises(training.FinalSaveError) as raised:
        training.save_run(model_dir, model, {"epochs": 3}, tf.distribute.get_strategy())
    message = str(raised.value)
    final = os.path.join(model_dir, training.FINAL_MODEL)
    assert f"Could not write the final model to {final!r}" in message
    assert "MB is free there" in message
    assert f"The last good backup, {last.path} (epoch 3, step 0), is intact" in message
    # Nothing half-written where the next run reads: no final model, no run record, no temp file.
    assert sorted(os.listdir(model_dir)) == [training.BACKUP_DIR]
    assert checkpointing.latest_backup(backup_dir).path == last.path


def test_backup_of_another_model_is_an_error_naming_it(tmp_path):
    backup_dir = str(tmp_path / "backup")
    _tiny_fit(_tiny_model(), checkpointing.BackupAndRestore(backup_dir, delete_checkpoint=False), 1)
    keras.utils.set_random_seed(3)
    other = keras.Sequential([keras.Input((3,)), keras.layers.Dense(5), keras.layers.Dense(2)])
    other.compile(optimizer="sgd", loss="mse")
    with pytest.raises(
        ValueError,
        match=r"backup-000001 \(epoch 2, step 0\) is complete but does "
        r"not fit this model",
    ):
        _tiny_fit(other, checkpointing.BackupAndRestore(backup_dir), 2)


def test_bad_arguments():
    with pytest.raises(ValueError, match="needs a backup_dir"):
        checkpointing.BackupAndRestore("")
    with pytest.raises(ValueError, match="save_freq=0"):
        checkpointing.BackupAndRestore("x", save_freq=0)


# --------------------------------------------------------------------------- two workers


@pytest.mark.multiprocess
@pytest.mark.parametrize("sharded", [False, True], ids=["replicated", "sharded_update"])
def test_sigterm_to_one_worker_saves_everywhere_and_the_relaunch_resumes(
    processes, tmp_path, sharded
):
    # Sharded, each worker's backup gathers the momentum's shards from both workers, and each
    # relaunched replica takes its shard back from the chief's file.
    options = {"backup_dir": str(tmp_path / "backup"), "epochs": 5, "steps": 5}
    if sharded:
        options["weight_update_sharding"] = True
    workers = processes.cluster([dict(options, step_sleep=0.05)] * 2, "preempted")
    wait_for(workers[0], r"^saved 2$", 150)
    workers[1].send_signal(signal.SIGTERM)
    codes = [wait_exit(w, 60) for w in workers]  # the bound only guards against a hang
    assert codes == [checkpointing.PREEMPTED_EXIT_CODE] * 2, [output(w)[-3000:] for w in workers]
    for w in workers:
        assert "Preempted (SIGTERM on /job:worker/replica:0/task:1): saved" in output(w)
    saved = checkpointing.latest_backup(options["backup_dir"])
    assert saved.reason == "preemption" and saved.epoch >= 2
    assert not [n for n in os.listdir(options["backup_dir"]) if not n.startswith("backup-")]

    outs = [str(tmp_path / f"final{i}.npz") for i in range(2)]
    workers = processes.cluster([dict(options, out=out) for out in outs], "relaunched")
    assert [wait_exit(w, 150) for w in workers] == [0, 0], [output(w)[-3000:] for w in workers]
    assert [resumed_at(w) for w in workers] == [(saved.epoch, saved.step)] * 2
    slots = "sharded slots momentum" if sharded else "sharded slots\n"
    assert all(slots in output(w) for w in workers)
    finals = [load_weights(out) for out in outs]
    for a, b in zip(*finals):
        np.testing.assert_array_equal(a, b)
    # Two workers x 2 replicas, each worker's pipeline the same stream of 4-example batches, compute
    # what 2 replicas with a global batch of 8 compute: the uninterrupted (unsharded) run, here.
    reference = checkpointing_child.main(
        {"backup_dir": str(tmp_path / "reference"), "epochs": 5, "steps": 5, "global_batch": 8}
    )
    for got, want in zip(finals[0], reference):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.multiprocess
def test_worker_that_cannot_see_the_chiefs_backup_stops_everyone(processes, tmp_path):
    chief_dir, private_dir = str(tmp_path / "chief_backup"), str(tmp_path / "private_backup")
    checkpointing_child.main({"backup_dir": chief_dir, "epochs": 1, "steps": 2})
    assert checkpointing.latest_backup(chief_dir).epoch == 1
    options = {
        "backup_dir": chief_dir,
        "backup_dirs": [chief_dir, private_dir],
        "epochs": 3,
        "steps": 2,
    }
    workers = processes.cluster([options] * 2, "unshared")
    codes = [wait_exit(w, 120) for w in workers]  # the bound only guards against a hang
    assert codes[0] != 0 and codes[1] != 0
    expected = (
        f"/job:worker/replica:0/task:1 cannot read {private_dir}/backup-000001: its "
        f"metadata {private_dir}/backup-000001/backup.json is unreadable"
    )
    for w in workers:
        text = output(w)
        assert "Resuming failed on /job:worker/replica:0/task:1, so no worker starts" in text
        assert expected in text
        assert "must be on a filesystem every worker reads" in text
        assert "step 0 1" not in text  # no training step ran


@pytest.mark.multiprocess
@pytest.mark.parametrize("signal_name,victim,bound", [("SIGKILL", 1, 120), ("SIGSTOP", 0, 150)])
def test_dead_or_frozen_peer_is_named(processes, tmp_path, signal_name, victim, bound):
    # SIGSTOP of task 0 freezes the coordination service too: the other worker's heartbeats to it
    # time out (about 10 s here).
    options = {
        "backup_dir": str(tmp_path / "backup"),
        "epochs": 100,
        "steps": 5,
        "step_sleep": 0.02,
    }
    workers = processes.cluster([options] * 2, signal_name.lower())
    survivor = workers[1 - victim]
    wait_for(survivor, r"^saved 1$", 150)
    workers[victim].send_signal(getattr(signal, signal_name))
    code = wait_exit(survivor, bound)  # the bound only guards against a hang
    text = output(survivor)
    assert code == 1
    peer = f"/job:worker/replica:0/task:{victim}"
    assert re.search(
        r"PeerFailureError: Training on /job:worker/replica:0/task:\d stopped because "
        r"a peer failed:\n  " + re.escape(peer) + r" \(localhost:\d+\): ",
        text,
    ), text[-3000:]
    why = "is not running" if signal_name == "SIGKILL" else "does not answer: frozen"
    assert why in text, text[-3000:]
    assert "relaunch every worker with the same command" in text


def test_a_dying_peer_is_called_not_running_after_a_second_look(monkeypatch):
    # A killed process's port accepts connections, unanswered, until its sockets close: the first
    # probe finds it silent; the second look, after the socket closed, finds it not running.
    import socket

    import tensorflow as tf

    from tpu_scale.checkpointing import peers
    from tpu_scale.checkpointing.preemption import PreemptionCluster

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # the kernel accepts; nobody answers
    address = "127.0.0.1:%d" % listener.getsockname()[1]
    me, peer = "/job:worker/replica:0/task:0", "/job:worker/replica:0/task:1"
    cluster = PreemptionCluster((me, peer), {me: "127.0.0.1:1", peer: address}, me)
    error = tf.errors.UnavailableError(None, None, "Collective ops is aborted by: socket closed")

    sleep = time.sleep
    monkeypatch.setattr(peers.time, "sleep", lambda seconds: (listener.close(), sleep(0.05)))
    explained = peers.explain_peer_failure(error, cluster, probe_timeout=0.5)
    assert explained.tasks == (peer,)
    assert f"{peer} ({address}): is not running" in str(explained)

    # A peer that stays silent is frozen.
    frozen = socket.socket()
    frozen.bind(("127.0.0.1", 0))
    frozen.listen(8)
    address = "127.0.0.1:%d" % frozen.getsockname()[1]
    cluster = PreemptionCluster((me, peer), {me: "127.0.0.1:1", peer: address}, me)
    monkeypatch.setattr(peers.time, "sleep", lambda seconds: None)
    with frozen:
        assert "does not answer: frozen" in str(peers.explain_peer_failure(error, cluster, 0.5))


def test_the_preemption_cluster_is_the_chief_and_the_workers():
    import tensorflow as tf

    from tpu_scale.checkpointing.preemption import PreemptionCluster

    def of(jobs, task_type, task_id):
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(jobs), task_type=task_type, task_id=task_id
        )
        return PreemptionCluster.of(types.SimpleNamespace(cluster_resolver=resolver))

    jobs = {"chief": ["c:1"], "worker": ["a:1", "b:1"], "evaluator": ["e:1"]}
    cluster = of(jobs, "worker", 1)
    assert cluster.tasks == (
        "/job:chief/replica:0/task:0",
        "/job:worker/replica:0/task:0",
        "/job:worker/replica:0/task:1",
    )
    assert cluster.me == "/job:worker/replica:0/task:1" and not cluster.is_chief
    assert cluster.describe(cluster.chief) == "/job:chief/replica:0/task:0 (c:1)"
    assert of(jobs, "chief", 0).is_chief
    assert of(jobs, "evaluator", 0) is None  # not one of the training tasks
    assert of({"worker": ["a:1"]}, "worker", 0) is None  # a single process


def test_a_port_that_resets_connections_is_named_not_running():
    import socket
    import struct
    import threading

    from tpu_scale.checkpointing import peers

    server = socket.socket()
    server.bind(("localhost", 0))
    server.listen(1)

    def reset():
        # An exiting process: the connection is accepted, then reset.
        connection, _ = server.accept()
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        connection.close()

    thread = threading.Thread(target=reset)
    thread.start()
    try:
        state = peers.probe_task(f"localhost:{server.getsockname()[1]}", 5.0)
    finally:
        thread.join()
        server.close()
    assert state == "reset"
    assert peers._PROBE_WORDS[state].startswith("is not running")
