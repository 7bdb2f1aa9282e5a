"""Keras's own BatchNormalization test suite, run with `DistributedBatchNormalization` in its place.

The installed Keras ships `keras/src/layers/normalization/batch_normalization_test.py`. Its tests
refer to the layer as `layers.BatchNormalization`; an autouse fixture swaps that module's `layers`
for a view of `keras.src.layers` whose `BatchNormalization` is ours, and checks that every test took
our class and that every test that trains computed its statistics in our layer.

The suite runs twice:

* `TestKerasSuiteLocal`: no strategy, so our layer must behave exactly like Keras's (it delegates
  the local moments to Keras).
* `TestKerasSuiteGrouped`: every training call is forced through our own grouped statistics (packed
  sums, moving-mean shift, mask counts, the group sum) over a one-replica group, so Keras's
  expectations about values, moving statistics, masking and renorm are checked against our
  arithmetic too.

Keras's tests draw their data from numpy's global generator without a seed; here every test starts
from seed 1, so that a run can be repeated, not so that it passes: `test_correctness` (one layer
applied three times in a row, the last moving variance, about 0.999, checked against 1 with
`atol=1e-3`) passes in all of its 16 cases for every seed from 0 to 19 in both classes. The grouped
variance combines each member's two-pass moments exactly (`sum(n_r (v_r + (m_r - mean)^2)) / N`),
so a large mean against the spread costs it nothing more than Keras's own. The same properties are
checked against plain batch normalization with real tolerances in `test_layers.py`.
"""

import functools

import numpy as np
import pytest
from keras.src import layers as keras_layers
from keras.src.layers.normalization import batch_normalization_test as keras_suite

from tpu_scale.layers import DistributedBatchNormalization

# Keras tests that call the layer in training mode; each must reach our statistics at least once.
TRAINING_TESTS = (
    "test_bn_basics",
    "test_correctness",
    "test_input_fully_masked",
    "test_bachnorm_ignore_masked_values",
    "test_trainable_behavior",
    "test_masked_broadcast_normalization",
    "test_renorm_basics",
    "test_renorm_correctness",
)


class _LayersWithOurs:
    """`keras.src.layers` with `BatchNormalization` replaced; counts the suite's uses of it."""

    def __init__(self):
        self.taken = 0

    @property
    def BatchNormalization(self):  # noqa: N802 (the name the suite looks up)
        self.taken += 1
        return DistributedBatchNormalization

    def __getattr__(self, name):
        return getattr(keras_layers, name)


def _counting(monkeypatch, cls, name, counter):
    original = getattr(cls, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        counter[name] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(cls, name, wrapper)


@pytest.fixture(autouse=True)
def ours_in_place_of_keras(request, monkeypatch):
    layers = _LayersWithOurs()
    monkeypatch.setattr(keras_suite, "layers", layers)
    counter = {"_moments": 0, "_group_moments": 0}
    for name in counter:
        _counting(monkeypatch, DistributedBatchNormalization, name, counter)
    grouped = request.cls.grouped
    np.random.seed(1)  # see the module docstring
    if grouped:
        # One replica, one group: the grouped arithmetic runs, the group sum is the identity.
        monkeypatch.setattr(
            DistributedBatchNormalization,
            "_group_assignment",
            lambda self, inputs: np.zeros((1, 1), np.int64),
        )
    yield
    test_name = request.node.name
    assert layers.taken > 0, f"{test_name} never used layers.BatchNormalization"
    if test_name.startswith(TRAINING_TESTS):
        assert counter["_moments"] > 0, (
            f"{test_name} never computed training statistics with our layer"
        )
    assert counter["_group_moments"] == (counter["_moments"] if grouped else 0)


class TestKerasSuiteLocal(keras_suite.BatchNormalizationTest):
    grouped = False


class TestKerasSuiteGrouped(keras_suite.BatchNormalizationTest):
    grouped = True
