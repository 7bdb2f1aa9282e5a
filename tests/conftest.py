"""Test set-up: 8 virtual CPU replicas, configured before TensorFlow starts.

Every test process sees the same 8 logical CPU devices, so `create_strategy(num_cpu_replicas=8)` (or any
smaller `MirroredStrategy` over the first devices) can be used from any test module.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# Before TensorFlow starts its threads: SCHED_BATCH keeps tf.data iterator deletion from stalling for up to
# a minute per per-replica iterator (see `tpu_scale.strategy.batch_scheduling`).
from tpu_scale.strategy import batch_scheduling  # noqa: E402

batch_scheduling()

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

NUM_CPU_REPLICAS = 8

_cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(
    _cpus[0], [tf.config.LogicalDeviceConfiguration()] * NUM_CPU_REPLICAS
)


@pytest.fixture(scope="session")
def cpu_devices():
    """The names of the 8 logical CPU devices."""
    return [d.name for d in tf.config.list_logical_devices("CPU")]
