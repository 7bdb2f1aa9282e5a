"""Weight-update sharding across two localhost worker processes x 4 logical CPUs (mesh 2x4, one row
per worker): the sharded update equals the unsharded one, each of the 8 replicas holds 1/8 of the
optimizer's state, a save gathers the full state on every worker and a load gives each replica its
shard back, and a save on one worker alone ends in a clear error instead of a hang."""

import os
import tempfile
import time

import numpy as np
import pytest

from tpu_scale.testing import run_workers

# One cluster (the module's fixture) serves every test here: under pytest-xdist's `--dist
# loadgroup` they run on one worker, so that the cluster starts once instead of once per worker,
# two at a time.
pytestmark = [pytest.mark.multiprocess, pytest.mark.xdist_group("weight_update_multiworker")]

# (optimizer, its options, the layers' dtype policy, the strategy's settings), as in
# test_weight_update_sharding; a name ending in "_eager" trains with run_eagerly=True (the
# collectives' eager forms). The sharded step runs the settings' algorithm's phases, in buffers of
# `pack_bytes`, with `gradient_dtype` between the workers; the unsharded one sums with the same.
CASES = {
    # float64: see below
    "sgd": (dict(momentum=0.9, nesterov=True, weight_decay=1e-2, clipnorm=1.0), "float64", {}),
    "sgd_plain": (dict(), None, {}),  # no state: nothing to gather at a save
    "sgd_accumulated": (dict(momentum=0.9, gradient_accumulation_steps=2), None, {}),
    "lars": (dict(momentum=0.9, weight_decay=1e-2), None, dict(algorithm="torus_2d")),
    "lars_eager": (dict(momentum=0.9, weight_decay=1e-2), None, {}),
    # any element-wise Keras optimizer, by its own rule; one reduce-scatter over every replica
    "lion": (dict(weight_decay=1e-2), None, dict(algorithm="ring")),
    # both streams' phase between the workers in bfloat16, in buffers of 256 bytes
    "sgd_bfloat16": (
        dict(momentum=0.9),
        None,
        dict(gradient_dtype="bfloat16", algorithm="torus_2d_bidirectional", pack_bytes=256),
    ),
    # last: the final save uses it
    "adamw": (dict(weight_decay=1e-1), "mixed_bfloat16", dict(algorithm="torus_2d", pack_bytes=256)),
}
# With bfloat16 between the workers the run is not compared with the unsharded one: this small
# model amplifies rounding about a hundredfold in 20 steps (float32 sums in another order, 1e-7
# apart, end 1e-5 apart), so bfloat16's 4e-3 ends at tenths. With Nesterov momentum, clipping and
# weight decay (the "sgd" case) it amplifies float32 rounding more still: two unsharded float32
# runs that only sum in another order (the torus sum and TensorFlow's own) end up to 2e-3 apart,
# beyond float32's margin, and a one-ulp change of TensorFlow's gradient kernels (tf-nightly
# 2.23.0.dev20261026 against 2.21) moves either run by 1e-3. That case runs in float64, as in
# test_weight_update_sharding, where the sharded and unsharded runs agree to 1e-12.
FLOAT64_TOLERANCE = dict(rtol=1e-9, atol=1e-9)
FLOAT32_TOLERANCE = dict(rtol=1e-3, atol=3e-4)


def workers_main():
    """Runs in each worker: per case, a sharded fit, its save and reload, then an unsharded fit
    from the same weights; last, a save on the chief alone."""
    import dataclasses

    import keras
    import tensorflow as tf
    from test_weight_update_sharding import BATCH, OPTIMIZERS, _data, _model

    import tpu_scale
    from tpu_scale import checkpointing, keras_hook, training
    from tpu_scale.distribute import collectives
    from tpu_scale.testing.graphs import collective_ops, train_graphs
    from tpu_scale.torus import weight_update

    strategy = tpu_scale.create_strategy(
        num_cpu_replicas=int(os.environ["TPU_SCALE_CPUS_PER_WORKER"])
    )

    def install(settings):  # the strategy's gradient sum, as create_strategy would declare it
        strategy.settings = settings
        ops = strategy.cross_device_ops
        ops.algorithm = settings.algorithm if settings.torus_sum else "native"
        ops.pack_bytes, ops.gradient_dtype = settings.pack_bytes, settings.gradient_dtype

    # Each fit ends by deleting its data iterator, which on CPU hosts can stall one worker for
    # tens of seconds (_workarounds.batch_scheduling), more under CI's load: these worker
    # processes take the package's opt-in fix, and the saves wait for a late worker up to 300 s.
    # A worker that does not save still fails the test, not hangs it (the cluster's limit is 600 s;
    # the chief's save alone, last, waits 5 s).
    tpu_scale.process.avoid_iterator_stalls()
    weight_update.SAVE_WAIT_SECONDS = 300
    x, y = _data()
    scratch = tempfile.mkdtemp(prefix="tpu_scale_test_")  # each worker's own
    out = {"mesh": strategy.mesh.shape, "cases": {}}
    settings = keras_hook.settings_for(strategy)
    for name, (options, dtype, overrides) in CASES.items():
        runs, weights = {}, None
        install(dataclasses.replace(settings, **overrides))
        for sharded in (True, False):
            keras.utils.set_random_seed(1)
            optimizer = OPTIMIZERS[name.split("_")[0]]
            model = _model(strategy, lambda: optimizer(options), weights, dtype, sharded=sharded)
            model.run_eagerly = name.endswith("_eager")
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
                "optimizer": [keras.ops.convert_to_numpy(v) for v in model.optimizer.variables],
                "collectives": None  # no traced step to look into
                if model.run_eagerly
                else sorted(
                    {
                        (op.type, tf.as_dtype(op.get_attr("T")).name)
                        for graph in train_graphs(model)
                        for op in collective_ops(graph)
                    }
                ),
            }
            if sharded:  # every worker saves (the state is gathered), then reloads into a new model
                sharded_model = model
                path = os.path.join(scratch, f"{name}.weights.h5")
                model.save_weights(path)
                runs[sharded]["saved"] = weight_update.full_state(model.optimizer)
                again = _model(strategy, lambda: optimizer(options), None, dtype, sharded=True)
                with strategy.scope():
                    again.optimizer.build(again.trainable_variables)
                again.load_weights(path)
                runs[sharded]["reloaded"] = weight_update.full_state(again.optimizer)
        out["cases"][name] = runs
    install(settings)
    # The package's end-of-run save: the chief writes final.keras, the other worker joins the
    # gather with a save to scratch.
    outputs = training.save_run(scratch, sharded_model, {"epochs": 1, "top_1": 0.0}, strategy)
    out["outputs"] = sorted(outputs)
    if outputs:
        final = keras.models.load_model(outputs["final model"])
        out["final_optimizer"] = [keras.ops.convert_to_numpy(v) for v in final.optimizer.variables]
    # Were the collective ops to order the workers otherwise than the shards assume, building the
    # optimizer says so (here the package's ranks are made the reverse of the runtime's).
    runtime_ranks = collectives.process_ranks
    collectives.process_ranks = lambda s: [1 - r for r in runtime_ranks(s)]
    try:
        install(dataclasses.replace(settings, algorithm="torus_2d"))
        misordered = _model(
            strategy, lambda: OPTIMIZERS["sgd"](dict(momentum=0.9)), None, None, sharded=True
        )
        with strategy.scope():
            misordered.optimizer.build(misordered.trainable_variables)
    except RuntimeError as e:
        out["misordered"] = str(e)
    finally:
        collectives.process_ranks = runtime_ranks
        install(settings)
    # A save on the chief alone: the other worker never comes, and the chief gets a clear error.
    weight_update.SAVE_WAIT_SECONDS = 5
    if checkpointing.is_chief(strategy):
        start = time.monotonic()
        try:
            sharded_model.save_weights(os.path.join(scratch, "alone.weights.h5"))
        except RuntimeError as e:
            out["alone"] = str(e)
        out["alone_seconds"] = time.monotonic() - start
    out["finished"] = True
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
        updates = 20 // CASES[name][0].get("gradient_accumulation_steps", 1)
        assert sharded["steps"] == plain["steps"] == updates
        wide = CASES[name][1] == "float64"
        # master weights, mixed precision too
        assert sharded["trainable_dtypes"] == ["float64" if wide else "float32"]
        narrow = CASES[name][2].get("gradient_dtype") == "bfloat16"
        tolerance = FLOAT64_TOLERANCE if wide else FLOAT32_TOLERANCE
        for got, want, start in zip(sharded["final"], plain["final"], plain["initial"]):
            assert np.all(np.isfinite(got)) and not np.allclose(got, start, atol=1e-2)
            if not narrow:
                np.testing.assert_allclose(got, want, **tolerance)
        # Only with gradient_dtype="bfloat16" does a collective op carry bfloat16: the gradient's
        # reduce-scatters between the workers (all-to-alls); the weights' all-gathers stay float32.
        if sharded["collectives"] is not None:
            carried = {dtype for _, dtype in sharded["collectives"]}
            assert ("CollectiveAllToAllV2", "bfloat16") in sharded["collectives"] or not narrow
            assert ("bfloat16" in carried) == narrow
            assert ("CollectiveGatherV2", "bfloat16") not in sharded["collectives"]
        # Each of the 8 replicas holds an eighth of the state (and the padding); plain SGD has
        # none.
        full = sum(
            size
            for path, size in plain["sizes"].items()
            if any(slot in path for slot in sharded["slots"])
        )
        if name == "sgd_plain":
            assert sharded["slots"] == [] and sharded["state"] == 0
        else:
            assert sharded["slots"] and sharded["state"] / full <= 0.15
        # The save gathers Keras's unsharded layout: the unsharded run's state, on every worker
        # (LARS's momentum carries its learning rate of 2, so the sums' rounding shows more there
        # than in the weights; a shard in the wrong place would be off by its whole size);
        # a sharded model loads it back, each replica its own shard.
        assert len(sharded["saved"]) == len(plain["optimizer"])
        for got, want in zip(sharded["saved"], plain["optimizer"]):
            if not narrow:
                np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-3)
        for got, want in zip(sharded["reloaded"], sharded["saved"]):
            np.testing.assert_array_equal(got, want)
    # Both workers end on the same trained weights (batch norm's moving statistics are each
    # worker's own).
    first, second = (worker["cases"][name][True]["trainable"] for worker in cluster)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


def test_the_final_model_holds_the_gathered_state(cluster):
    chief, other = cluster
    assert "final model" in chief["outputs"] and other["outputs"] == []
    saved = chief["cases"]["adamw"][True]["saved"]  # the last sharded model's state
    assert len(chief["final_optimizer"]) == len(saved)
    for got, want in zip(chief["final_optimizer"], saved):
        np.testing.assert_array_equal(got, want)


def test_workers_in_another_collective_order_are_an_error_at_build(cluster):
    for worker in cluster:
        assert "order them [1, 0], not by collectives.worker_rank" in worker["misordered"]
        assert "weight_update_sharding=False" in worker["misordered"]


def test_a_save_on_one_worker_alone_fails_clearly(cluster):
    chief, other = cluster
    assert other["finished"]  # the other worker went on and ended, never saving
    assert 5 <= chief["alone_seconds"] < 60  # the barrier's 5 s, then the error
    assert "every worker must save at the same point" in chief["alone"]
    assert "not all of them came within 5 s" in chief["alone"]
    assert "weight_update_sharding=False" in chief["alone"]
