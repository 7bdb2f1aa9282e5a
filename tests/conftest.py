"""Test set-up: 8 virtual CPU replicas for the tests that use TensorFlow, none for the others.

TensorFlow is configured (8 logical CPU devices, before its runtime starts) just before the first
test module that needs it is imported; the numpy-only modules in `NUMPY_ONLY` never import it, so
`pytest tests/test_mesh.py tests/test_plan.py` runs without TensorFlow.

Temporary files: the whole run writes them under one folder, removed at its end (nothing is left
in /tmp). Shared fixtures: `cpu_devices` (the 8 device names), `strategy` (8 replicas in a 1x8 mesh,
TensorFlow's gradient sum), `strategy_2x4` (the same devices in a 2x4 mesh) and `digits_records`
(scikit-learn's digits written as TFRecords once for the whole run). Markers (declared in
pyproject.toml): `multiprocess` for tests that start localhost worker processes (`-m "not
multiprocess"` leaves them out of a quick run); `slurm` for the tests that start a one-node Slurm
cluster (tests/test_slurm_cluster.py; `-m slurm` runs just them).

A watchdog bounds every test: one that runs longer than `TEST_TIMEOUT` seconds (environment
variable `TPU_SCALE_TEST_TIMEOUT` to change it) gets the Python stack of every thread printed to
the terminal and its process ended, so a hang is named and the run goes on instead of stalling.
"""

import atexit
import faulthandler
import os
import shutil
import sys
import tempfile

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Importing the package selects TensorFlow's CPU allocator; the worker processes inherit it.
import tpu_scale  # noqa: E402, F401

# Everything the suite writes to a temporary folder, TensorFlow's AutoGraph files and the worker
# processes' files included, goes to one folder that is removed when the run ends.
_SUITE_TMP = tempfile.mkdtemp(prefix="tpu_scale_tests_")
os.environ["TMPDIR"] = tempfile.tempdir = _SUITE_TMP
atexit.register(shutil.rmtree, _SUITE_TMP, ignore_errors=True)

NUM_CPU_REPLICAS = 8
NUMPY_ONLY = {"test_mesh.py", "test_plan.py", "test_torus_schedule.py"}

_tensorflow_ready = False

# The slowest test takes under a minute here (a training run killed and resumed, in subprocesses).
TEST_TIMEOUT = float(os.environ.get("TPU_SCALE_TEST_TIMEOUT", 600))
_terminal = None  # the run's real stderr, which pytest's output capturing does not swallow


def pytest_configure(config):
    global _terminal
    capture = config.pluginmanager.getplugin("capturemanager")  # None under -p no:capture
    if capture is None:
        _terminal = sys.stderr
        return
    with capture.global_and_fixture_disabled():
        _terminal = os.fdopen(os.dup(sys.stderr.fileno()), "w")


def pytest_unconfigure(config):
    if _terminal not in (None, sys.stderr):
        _terminal.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    # faulthandler's timer is a C thread: it fires even while the test is blocked in TensorFlow.
    # The report starts with "Timeout (0:10:00)!"; xdist then names the test its worker ran.
    faulthandler.dump_traceback_later(TEST_TIMEOUT, exit=True, file=_terminal)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def _start_tensorflow():
    global _tensorflow_ready
    if _tensorflow_ready:
        return
    import tensorflow as tf

    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(
        cpus[0], [tf.config.LogicalDeviceConfiguration()] * NUM_CPU_REPLICAS
    )
    _tensorflow_ready = True


def pytest_collect_file(file_path, parent):
    # Before pytest imports a module that may touch TensorFlow: the devices must exist first.
    if (
        file_path.suffix == ".py"
        and file_path.name.startswith("test_")
        and file_path.name not in NUMPY_ONLY
    ):
        _start_tensorflow()


@pytest.fixture(scope="session")
def cpu_devices():
    """The names of the 8 logical CPU devices."""
    import tensorflow as tf

    return [d.name for d in tf.config.list_logical_devices("CPU")]


@pytest.fixture(scope="session")
def strategy():
    """8 CPU replicas in a 1x8 mesh with TensorFlow's own gradient sum."""

    return tpu_scale.create_strategy(num_cpu_replicas=8, gradient_reduction="native")


@pytest.fixture(scope="session")
def strategy_2x4():
    """8 CPU replicas in a 2x4 mesh with TensorFlow's own gradient sum."""

    return tpu_scale.create_strategy(
        num_cpu_replicas=8, mesh_shape=(2, 4), gradient_reduction="native"
    )


@pytest.fixture(scope="session")
def digits_records(tmp_path_factory):
    """scikit-learn's 1,797 digits as a folder of class folders, written by `write_tfrecords`:
    the records' folder (read-only for the tests that share it)."""
    from tpu_scale.data import write_tfrecords
    from tpu_scale.testing.digits import write_digits_folder

    images = str(tmp_path_factory.mktemp("digits"))
    write_digits_folder(images)
    out = str(tmp_path_factory.mktemp("digits_records")) + "/records"
    write_tfrecords(images, out)
    return out
