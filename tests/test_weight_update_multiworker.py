"""Weight-update sharding across two localhost worker processes x 4 logical CPUs (mesh 2x4, one row
per worker): the sharded update equals the unsharded one, and each replica holds 1/4 of the
optimizer's state (each worker's replicas shard it; the workers repeat it)."""

import os

import numpy as np
import pytest

from tpu_scale.testing import run_workers

pytestmark = pytest.mark.multiprocess

# (optimizer, its options, the layers' dtype policy), as in test_weight_update_sharding.
CASES = {
    "sgd": (dict(momentum=0.9, nesterov=True, weight_decay=1e-2, clipnorm=1.0), None),
    "lars": (dict(momentum=0.9, weight_decay=1e-2), None),
    "adamw": (dict(weight_decay=1e-1), "mixed_bfloat16"),
}


def workers_main():
    """Runs in each worker: per case, a sharded fit, then an unsharded one from the same weights."""
    import keras
    from test_weight_update_sharding import BATCH, OPTIMIZERS, _data, _model

    import tpu_scale
    from tpu_scale import weight_update

    strategy = tpu_scale.create_strategy(
        num_cpu_replicas=int(os.environ["TPU_SCALE_CPUS_PER_WORKER"]), weight_update_sharding=True
    )
    x, y = _data()
    out = {"mesh": strategy.mesh.shape, "cases": {}}
    for name, (options, dtype) in CASES.items():
        runs, weights = {}, None
        for sharded in (True, False):
            (weight_update.enable if sharded else weight_update.disable)(strategy)
            keras.utils.set_random_seed(1)
            model = _model(strategy, lambda: OPTIMIZERS[name](options), weights, dtype)
            weights = model.get_weights()
            model.fit(x, y, batch_size=BATCH, shuffle=False, epochs=1, verbose=0)
            slots = weight_update.slot_shards(model.optimizer)
            runs[sharded] = {
                "initial": weights,
                "final": model.get_weights(),
                "trainable": [keras.ops.convert_to_numpy(v) for v in model.trainable_variables],
                "steps": int(model.optimizer.iterations.numpy()),
                "state": sum(int(np.prod(v.shape)) for v in slots.values()),
                "slots": sorted(slots),
                "sizes": {v.path: int(np.prod(v.shape)) for v in model.optimizer.variables},
                "trainable_dtypes": sorted({v.dtype for v in model.trainable_variables}),
            }
        out["cases"][name] = runs
    return out


@pytest.fixture(scope="module")
def cluster():
    return run_workers(
        "test_weight_update_multiworker:workers_main",
        num_workers=2,
        cpus_per_worker=4,
        timeout=600,
    )


@pytest.mark.parametrize("name", sorted(CASES))
def test_sharded_update_across_workers_equals_the_unsharded_one(cluster, name):
    assert all(worker["mesh"] == (2, 4) for worker in cluster)
    for worker in cluster:
        sharded, plain = worker["cases"][name][True], worker["cases"][name][False]
        assert sharded["steps"] == plain["steps"] == 20
        assert sharded["trainable_dtypes"] == ["float32"]  # master weights, mixed precision too
        for got, want, start in zip(sharded["final"], plain["final"], plain["initial"]):
            assert not np.allclose(want, start, atol=1e-2)
            np.testing.assert_allclose(got, want, rtol=1e-3, atol=3e-4)
        # Each of a worker's 4 replicas holds a quarter of the state (and the padding).
        full = sum(
            size
            for path, size in plain["sizes"].items()
            if any(slot in path for slot in sharded["slots"])
        )
        assert sharded["slots"] and sharded["state"] / full <= 0.3
    # Both workers end on the same trained weights (batch norm's moving statistics are each
    # worker's own).
    first, second = (worker["cases"][name][True]["trainable"] for worker in cluster)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
