"""Weight-update sharding (`DistributedOptimizer(..., weight_update_sharding=True)`): the update of every
element-wise Keras optimizer and of the package's LARS, sharded over one host's replicas, equals the
unsharded one (float32 and mixed_bfloat16), holds 1/N of the optimizer state per replica, and
checkpoints in Keras's own layout; an optimizer whose rule is not element-wise is refused by name."""

import keras
import numpy as np
import pytest

import tpu_scale
from tpu_scale.optimizers import LARS

BATCH = 16
STEPS = 20


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * BATCH, 6)).astype("float32")
    y = rng.integers(0, 3, size=(len(x),)).astype("int32")
    return x, y


def _model(strategy, optimizer, weights=None, dtype=None, sharded=False):
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(8, activation="relu", dtype=dtype),
                keras.layers.BatchNormalization(dtype=dtype),
                keras.layers.Dense(3, dtype=dtype),
            ]
        )
        if weights is not None:
            model.set_weights(weights)
        made = optimizer()
        if sharded or made.gradient_accumulation_steps:  # what a strategy needs of it, by name
            made = tpu_scale.DistributedOptimizer(made, weight_update_sharding=sharded)
        model.compile(
            optimizer=made,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    return model


def _sharded(mesh_shape):
    return tpu_scale.create_strategy(num_cpu_replicas=8, mesh_shape=mesh_shape)


OPTIMIZERS = {
    "sgd": lambda options: keras.optimizers.SGD(0.1, **options),
    "lars": lambda options: LARS(2.0, **options),
    "adam": lambda options: keras.optimizers.Adam(0.01, **options),
    "adamw": lambda options: keras.optimizers.AdamW(0.01, **options),
    "lion": lambda options: keras.optimizers.Lion(0.003, **options),
    "rmsprop": lambda options: keras.optimizers.RMSprop(0.01, **options),
    "nadam": lambda options: keras.optimizers.Nadam(0.01, **options),
    "adamax": lambda options: keras.optimizers.Adamax(0.01, **options),
    "adagrad": lambda options: keras.optimizers.Adagrad(0.05, **options),
    "adadelta": lambda options: keras.optimizers.Adadelta(10.0, **options),
    "ftrl": lambda options: keras.optimizers.Ftrl(0.5, **options),
}


@pytest.mark.parametrize(
    "mesh_shape, name, options, dtype",
    [
        ((1, 8), "sgd", dict(momentum=0.9), "float64"),
        ((2, 4), "sgd", dict(momentum=0.9, nesterov=True, weight_decay=1e-2, clipnorm=1.0), "float64"),
        ((2, 4), "lars", dict(momentum=0.9, weight_decay=1e-2), "float64"),
        ((2, 4), "adamw", dict(weight_decay=1e-1, amsgrad=True), "float64"),
        ((1, 8), "adamw", dict(weight_decay=1e-1, clipnorm=1.0), "mixed_bfloat16"),
        ((2, 4), "lion", dict(weight_decay=1e-2), "float64"),
        ((1, 8), "rmsprop", dict(momentum=0.9, centered=True), "float64"),
        ((1, 8), "nadam", {}, "float64"),
        ((2, 4), "adamax", {}, "float64"),
        ((1, 8), "adagrad", dict(initial_accumulator_value=0.3), "float64"),
        ((2, 4), "adadelta", {}, "float64"),
        ((1, 8), "ftrl", dict(l1_regularization_strength=1e-3, l2_regularization_strength=1e-3), "float64"),
    ],
)
def test_sharded_update_equals_the_unsharded_one(mesh_shape, name, options, dtype, strategy):
    def optimizer():
        return OPTIMIZERS[name](options)

    x, y = _data()
    keras.utils.set_random_seed(1)
    sharded = _model(_sharded(mesh_shape), optimizer, dtype=dtype, sharded=True)
    initial = sharded.get_weights()
    plain = _model(strategy, optimizer, weights=initial, dtype=dtype)
    for model in (sharded, plain):
        model.fit(x, y, batch_size=BATCH, shuffle=False, epochs=1, verbose=0)
        assert int(model.optimizer.iterations.numpy()) == STEPS
    # Mixed precision keeps float32 master weights, which the sharded update writes.
    assert all(v.dtype == ("float64" if dtype == "float64" else "float32") for v in sharded.trainable_variables)
    # The same arithmetic, with sums taken in another order: in float64 that is rounding far below
    # any error in the rule, even after 20 steps through batch norm amplify it (LARS's trust ratios
    # grow a float32 difference of 6e-8 after one step to 1e-3 after 20). The float32 weights under
    # mixed precision get float32's margin.
    tolerance = dict(rtol=1e-9, atol=1e-9) if dtype == "float64" else dict(rtol=1e-3, atol=3e-4)
    for got, want, start in zip(sharded.get_weights(), plain.get_weights(), initial):
        assert not np.allclose(want, start, atol=1e-2)
        np.testing.assert_allclose(got, want, **tolerance)
    # Every replica holds the same weights, and 1/8 of the optimizer's state.
    for variable in sharded.trainable_variables:
        copies = [
            c.numpy()
            for c in sharded.distribute_strategy.experimental_local_results(variable.value)
        ]
        for copy in copies[1:]:
            np.testing.assert_array_equal(copy, copies[0])
    slots = tpu_scale.torus.weight_update.slot_shards(sharded.optimizer)
    sizes = {v.path: int(np.prod(v.shape)) for v in plain.optimizer.variables}
    full = sum(n for path, n in sizes.items() if any(name in path for name in slots))
    per_replica = sum(int(np.prod(v.shape)) for v in slots.values())
    assert slots and per_replica / full <= 0.15
    trainable = {tuple(v.shape) for v in sharded.trainable_variables}
    assert not any(tuple(v.shape) in trainable for v in sharded.optimizer.variables)
    # The saved state is Keras's own: the unsharded optimizer's variables, gathered.
    state = tpu_scale.torus.weight_update.full_state(sharded.optimizer)
    assert len(state) == len(plain.optimizer.variables)
    for got, want in zip(state, plain.optimizer.variables):
        np.testing.assert_allclose(got, want.numpy(), **tolerance)


def test_checkpoints_move_between_sharded_and_unsharded(tmp_path, strategy):
    def optimizer():  # three slots per variable, two of them saved interleaved
        return keras.optimizers.Adam(0.01, amsgrad=True)

    x, y = _data()
    sharded_strategy = _sharded((1, 8))
    trained = _model(sharded_strategy, optimizer, sharded=True)
    trained.fit(x[:64], y[:64], batch_size=BATCH, shuffle=False, epochs=1, verbose=0)
    path = str(tmp_path / "sharded.weights.h5")
    trained.save_weights(path)
    expected = tpu_scale.torus.weight_update.full_state(trained.optimizer)

    plain = _model(strategy, optimizer)
    with strategy.scope():
        plain.optimizer.build(plain.trainable_variables)
    plain.load_weights(path)  # Keras's own layout
    got = [keras.ops.convert_to_numpy(v) for v in plain.optimizer.variables]
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)

    resharded = _model(sharded_strategy, optimizer, sharded=True)
    with sharded_strategy.scope():
        resharded.optimizer.build(resharded.trainable_variables)  # sharded from its build on
    plain_path = str(tmp_path / "plain.weights.h5")
    plain.save_weights(plain_path)
    resharded.load_weights(plain_path)
    for a, b in zip(tpu_scale.torus.weight_update.full_state(resharded.optimizer), expected):
        np.testing.assert_array_equal(a, b)


def test_a_sharded_run_resumes_on_another_replica_count(tmp_path):
    # 10 steps on 8 replicas, saved, then 10 more on 4 replicas from the saved file: sharded
    # throughout, and unsharded throughout, end on the same weights.
    def optimizer():
        return keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True)

    x, y = _data()
    half = len(x) // 2
    keras.utils.set_random_seed(1)
    initial = None
    final = {}
    for sharded in (True, False):
        first, second = (
            tpu_scale.create_strategy(num_cpu_replicas=n, gradient_reduction="native")
            for n in (8, 4)
        )
        model = _model(first, optimizer, initial, sharded=sharded)
        initial = model.get_weights()
        model.fit(x[:half], y[:half], batch_size=BATCH, shuffle=False, epochs=1, verbose=0)
        path = str(tmp_path / f"sharded_{sharded}.weights.h5")
        model.save_weights(path)
        resumed = _model(second, optimizer, sharded=sharded)
        with second.scope():
            resumed.optimizer.build(resumed.trainable_variables)
        resumed.load_weights(path)
        assert int(resumed.optimizer.iterations.numpy()) == STEPS // 2
        if sharded:
            assert tpu_scale.torus.weight_update.slot_shards(resumed.optimizer)["momentum"].shape == (
                -(-sum(int(np.prod(v.shape)) for v in resumed.trainable_variables) // 4),
            )
        resumed.fit(x[half:], y[half:], batch_size=BATCH, shuffle=False, epochs=1, verbose=0)
        final[sharded] = resumed.get_weights()
    for got, want in zip(final[True], final[False]):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=3e-4)


@pytest.mark.parametrize("name", ["Lamb", "Adafactor"])
def test_an_optimizer_it_cannot_shard_is_named(name):
    x, y = _data()
    model = _model(_sharded((1, 8)), lambda: getattr(keras.optimizers, name)(), sharded=True)
    with pytest.raises(ValueError, match="not known to be element-wise") as raised:
        model.fit(x[:32], y[:32], batch_size=BATCH, epochs=1, verbose=0)
    message = str(raised.value)
    assert f"{name}'s rule" in message and "weight_update_sharding=False" in message


def test_a_subclass_with_its_own_rule_is_refused():
    class Scaled(keras.optimizers.Adam):
        def update_step(self, gradient, variable, learning_rate):
            super().update_step(gradient / keras.ops.norm(gradient), variable, learning_rate)

    x, y = _data()
    model = _model(_sharded((1, 8)), Scaled, sharded=True)
    with pytest.raises(ValueError, match="Scaled's rule is not known to be element-wise"):
        model.fit(x[:32], y[:32], batch_size=BATCH, epochs=1, verbose=0)


def test_sharding_composes_with_gradient_accumulation(strategy):
    def optimizer():
        return keras.optimizers.SGD(0.1, momentum=0.9, gradient_accumulation_steps=2)

    x, y = _data()
    keras.utils.set_random_seed(1)
    sharded = _model(_sharded((1, 8)), optimizer, sharded=True)
    plain = _model(strategy, optimizer, weights=sharded.get_weights())
    for model in (sharded, plain):
        model.fit(x, y, batch_size=BATCH, shuffle=False, epochs=1, verbose=0)
        assert int(model.optimizer.iterations.numpy()) == STEPS // 2
    for got, want in zip(sharded.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=3e-4)


def test_sharding_composes_with_the_moving_average(strategy):
    """Keras's `use_ema` (the recipe's momentum SGD) runs after the sharded update: the averaged
    weights `fit` ends with equal the unsharded run's."""

    def optimizer():
        return keras.optimizers.SGD(0.1, momentum=0.9, use_ema=True, ema_momentum=0.9)

    x, y = _data()
    keras.utils.set_random_seed(1)
    sharded = _model(_sharded((2, 4)), optimizer, dtype="float64", sharded=True)
    initial = sharded.get_weights()
    plain = _model(strategy, optimizer, weights=initial, dtype="float64")
    averages = []
    for model in (sharded, plain):
        record = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs, model=model: averages.append(
                [v.numpy() for v in tpu_scale.torus.weight_update.unwrapped(model.optimizer)._model_variables_moving_average]
            )
            if batch == STEPS - 1
            else None
        )
        model.fit(x, y, batch_size=BATCH, shuffle=False, epochs=1, verbose=0, callbacks=[record])
    for got, want, start in zip(sharded.get_weights(), plain.get_weights(), initial):
        assert not np.allclose(want, start, atol=1e-2)
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)
    # fit ended with the last step's averages in the model, sharded and not.
    for model, last in zip((sharded, plain), averages):
        assert len(last) == len(model.trainable_weights)
        for variable, average in zip(model.trainable_weights, last):
            np.testing.assert_array_equal(variable.numpy(), average)


@pytest.mark.parametrize(
    "shape, algorithm, pack_bytes",
    [
        ((1, 8), "flat", 256 * 1024),
        ((2, 4), "torus_2d", None),
        ((2, 4), "torus_2d_bidirectional", 4096),
        ((4, 2), "ring", 1),
    ],
)
def test_the_layout_gives_every_element_to_one_replica(shape, algorithm, pack_bytes):
    from tpu_scale.distribute.mesh import ReplicaMesh
    from tpu_scale.torus.weight_update import Layout

    shapes = [(3, 3, 16, 32), (32,), (32,), (1000,), (7,), (64, 10), (), (10,)]
    layout = Layout(shapes, 4, ReplicaMesh.from_shape(*shape), algorithm, pack_bytes)
    held = [np.zeros(int(np.prod(s))) for s in shapes]
    for k in range(8):
        used = np.zeros(layout.shard, int)
        for var, a, b, offset in layout.pieces(k):
            held[var][a:b] += 1
            used[offset : offset + b - a] += 1
        assert used.max() <= 1  # no two pieces of a shard overlap
    assert all(np.all(h == 1) for h in held)  # every element of every variable, exactly once
    # Padding is small: at most a chunk per buffer and stream, and alignment's 1%.
    assert layout.shard * 8 <= layout.total
    if pack_bytes != 1:
        assert layout.total <= 1.01 * sum(int(np.prod(s)) for s in shapes) + 8 * 16 * 2 * len(layout.buffers)
    # Large variables start on 64 bytes, so slicing them shares their buffer.
    assert layout.starts[0] % 16 == 0
    # The shards put back together give the flat space back.
    flat = np.arange(layout.total, dtype=np.float32)
    again = layout.flat([layout.shard_of(flat, k) for k in range(8)])
    for part, want in zip(layout.split(again), layout.split(flat)):
        np.testing.assert_array_equal(part, want)


@pytest.mark.parametrize("algorithm", ["ring", "torus_2d", "torus_2d_bidirectional"])
@pytest.mark.parametrize("name", ["sgd", "lars"])
def test_the_sharded_step_runs_the_strategys_algorithm(algorithm, name, strategy):
    """The sharded step's phases are the strategy's gradient sum's: any algorithm gives the
    unsharded update (in float64: the same arithmetic, sums in another order)."""
    options = dict(momentum=0.9, weight_decay=1e-2)
    x, y = _data()
    keras.utils.set_random_seed(1)
    sharded_strategy = tpu_scale.create_strategy(
        num_cpu_replicas=8, mesh_shape=(2, 4), gradient_algorithm=algorithm
    )
    sharded = _model(
        sharded_strategy, lambda: OPTIMIZERS[name](options), dtype="float64", sharded=True
    )
    plain = _model(strategy, lambda: OPTIMIZERS[name](options), sharded.get_weights(), "float64")
    for model in (sharded, plain):
        model.fit(x, y, batch_size=BATCH, shuffle=False, epochs=1, verbose=0)
    assert tpu_scale.torus.weight_update.layout(sharded.optimizer).algorithm == algorithm
    for got, want in zip(sharded.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)


def test_the_strategy_names_the_wrapper_for_sharding():
    with pytest.raises(ValueError, match=r"tpu_scale.DistributedOptimizer\(optimizer, weight_update_sharding=True\)"):
        tpu_scale.create_strategy(num_cpu_replicas=8, weight_update_sharding=True)


def test_the_wrapper_saves_and_reloads_as_itself(tmp_path, strategy):
    """A sharded model saved whole (`.keras`) reloads, in a process that imports the package, with
    its wrapper and Keras's unsharded state; its optimizer's class is the one constructed."""
    x, y = _data()
    model = _model(_sharded((1, 8)), lambda: keras.optimizers.Adam(0.01), sharded=True)
    inner = model.optimizer.inner_optimizer
    model.fit(x[:64], y[:64], batch_size=BATCH, shuffle=False, epochs=1, verbose=0)
    assert type(inner) is keras.optimizers.Adam and type(model.optimizer) is tpu_scale.DistributedOptimizer
    path = str(tmp_path / "sharded.keras")
    model.save(path)
    with strategy.scope():
        again = keras.models.load_model(path)
    assert isinstance(again.optimizer, tpu_scale.DistributedOptimizer)
    assert again.optimizer.weight_update_sharding
    assert type(again.optimizer.inner_optimizer) is keras.optimizers.Adam
    assert int(again.optimizer.iterations.numpy()) == 64 // BATCH
    saved = tpu_scale.torus.weight_update.full_state(model.optimizer)
    loaded = tpu_scale.torus.weight_update.full_state(again.optimizer)  # sharded again on reload
    assert len(saved) == len(loaded)
    for a, b in zip(saved, loaded):
        np.testing.assert_array_equal(a, b)
