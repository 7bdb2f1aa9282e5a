"""Tests for `tpu_scale._workarounds`: each does what it claims and is applied for the user."""

import os

import pytest
import tensorflow as tf

import tpu_scale
from tpu_scale import _workarounds
from tpu_scale._workarounds import batch_scheduling

LINUX_POLICIES = pytest.mark.skipif(
    not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies only"
)


def _policies():
    result = set()
    for thread in os.listdir("/proc/self/task"):
        try:
            result.add(os.sched_getscheduler(int(thread)))
        except OSError:
            pass  # ended meanwhile
    return result


@LINUX_POLICIES
def test_batch_scheduling_switches_every_running_thread():
    try:
        batch_scheduling(enabled=False)
        assert _policies() == {os.SCHED_OTHER}
    finally:
        batch_scheduling()
    assert _policies() == {os.SCHED_BATCH}


@LINUX_POLICIES
def test_create_strategy_applies_batch_scheduling_on_cpu_replicas():
    batch_scheduling(enabled=False)
    assert _policies() == {os.SCHED_OTHER}
    tpu_scale.create_strategy(num_cpu_replicas=8, gradient_reduction="native")
    assert _policies() == {os.SCHED_BATCH} and _workarounds.batch_scheduling_applied()


def test_each_strategy_gets_its_own_key_range():
    first, second = _workarounds.next_collective_key_base(), _workarounds.next_collective_key_base()
    assert second - first == 100_000 and first >= 100_000


def test_local_device_type_from_device_names(strategy):
    assert _workarounds.local_device_type(strategy) == "CPU"


def test_reduce_nested_maps_structures_and_reduces_scalars_over_replicas(strategy):
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: (tf.constant(float(ctx.replica_id_in_sync_group)), tf.fill([2], 1.0))
    )
    calls = []

    def reduce_one(op, value, axis):
        calls.append(axis)
        return strategy.reduce(op, value, axis=axis)

    mean, vector = _workarounds.reduce_nested(
        reduce_one, tf.distribute.ReduceOp.MEAN, values, 0, strategy.experimental_local_results
    )
    assert float(mean) == pytest.approx(3.5) and float(vector) == pytest.approx(1.0)
    assert calls == [None, 0]  # the scalar is reduced over replicas, the vector along its axis


def test_quiet_cuda_probe_drops_only_the_cuinit_line(capfd, monkeypatch):
    monkeypatch.setattr(_workarounds, "has_nvidia_driver", lambda: False)
    with _workarounds.quiet_cuda_probe():
        os.write(
            2, b"kept line\nE0000 cuda_platform.cc:52] failed call to cuInit: UNKNOWN ERROR (303)\n"
        )
        os.write(2, b"another kept line\n")
    err = capfd.readouterr().err
    assert "kept line" in err and "another kept line" in err and "cuInit" not in err


@pytest.mark.skipif(_workarounds.has_nvidia_driver(), reason="a machine without a GPU driver")
def test_create_strategy_on_a_cpu_machine_prints_no_cuda_error():
    import subprocess
    import sys

    plain = "import tpu_scale; tpu_scale.create_strategy(num_cpu_replicas=2)"
    # Under absl.app.run TensorFlow already initializes CUDA while it is imported.
    under_absl = (
        "from absl import app\n"
        "def main(argv):\n"
        "    import tpu_scale\n"
        "    tpu_scale.create_strategy(num_cpu_replicas=2)\n"
        "app.run(main)\n"
    )
    for code in (plain, under_absl):
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        assert "cuInit" not in out.stderr


def test_create_strategy_builds_replica_iterators_without_autotuning():
    from tensorflow.python.data.ops import multi_device_iterator_ops

    strategy = tpu_scale.create_strategy(num_cpu_replicas=4, gradient_reduction="native")
    devices = strategy.extended.worker_devices
    iterator = multi_device_iterator_ops.OwnedMultiDeviceIterator(tf.data.Dataset.range(8), devices)
    for replica in iterator._device_iterators:
        assert replica._dataset.options().autotune.enabled is False
    # The distributed batches are still the right ones, replica by replica, epoch after epoch.
    data = strategy.experimental_distribute_dataset(tf.data.Dataset.range(16).batch(8))
    for _ in range(2):
        local = strategy.experimental_local_results
        batches = [[t.numpy().tolist() for t in local(batch)] for batch in data]
        assert batches == [[[0, 1], [2, 3], [4, 5], [6, 7]], [[8, 9], [10, 11], [12, 13], [14, 15]]]


def test_per_replica_datasets_take_options_on_cpus_and_gpus_only():
    assert _workarounds.takes_dataset_options("/job:localhost/replica:0/task:0/device:CPU:3")
    assert _workarounds.takes_dataset_options("/job:worker/replica:0/task:1/device:GPU:0")
    assert _workarounds.takes_dataset_options("")  # no device scope: the host's CPU
    assert not _workarounds.takes_dataset_options("/job:worker/replica:0/task:0/device:TPU:7")
