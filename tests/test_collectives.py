"""Group collectives against numpy references, in graphs and eagerly, and the TPU ops they build."""

import types

import numpy as np
import pytest
import tensorflow as tf

from tpu_scale.distribute import collectives, context
from tpu_scale.distribute.mesh import ReplicaMesh

DTYPES = [tf.float32, tf.bfloat16]


def replica_inputs(shape, dtype, seed=0):
    """A different tensor per replica, exactly representable in bfloat16."""
    rng = np.random.default_rng(seed)
    values = rng.integers(-8, 8, size=(8,) + tuple(shape)).astype(np.float32) / 4
    return values, tf.convert_to_tensor(values, dtype)


def run_per_replica(strategy, fn, values, eager=False):
    """Runs `fn(x_replica)` on every replica; returns the 8 results as numpy arrays."""

    def step(all_values):
        ctx = tf.distribute.get_replica_context()
        return fn(tf.gather(all_values, ctx.replica_id_in_sync_group))

    run = (
        (lambda v: strategy.run(step, args=(v,)))
        if eager
        else tf.function(lambda v: strategy.run(step, args=(v,)))
    )
    out = run(values)
    return [np.asarray(tf.cast(t, tf.float32)) for t in strategy.experimental_local_results(out)]


GROUPINGS = {
    "pairs": np.arange(8).reshape(4, 2),
    "rows": ReplicaMesh.from_shape(2, 4).row_groups(),
    "columns": ReplicaMesh.from_shape(2, 4).column_groups(),
    "all": np.arange(8).reshape(1, 8),
    "strided": np.array([[0, 3, 5, 6], [1, 2, 4, 7]]),
}


def group_of(groups, replica):
    return groups[np.argwhere(groups == replica)[0, 0]]


PATHS = {"collective": {}, "latency_bound": {"latency_bound": True}, "in_graph": {"in_graph": True}}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("eager", [False, True], ids=["graph", "eager"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("grouping", list(GROUPINGS))
def test_group_sum(strategy, grouping, dtype, eager, path):
    groups = GROUPINGS[grouping]
    values, tensor = replica_inputs((3, 5), dtype)
    results = run_per_replica(
        strategy, lambda x: collectives.group_sum(x, groups, **PATHS[path]), tensor, eager
    )
    for replica, result in enumerate(results):
        np.testing.assert_array_equal(result, values[group_of(groups, replica)].sum(axis=0))


def _graph_op_types(strategy, fn):
    @tf.function
    def step(x):
        return strategy.run(fn, args=(x,))

    graph = step.get_concrete_function(tf.TensorSpec([3], tf.float32)).graph
    types = [op.type for op in graph.get_operations()]
    for function in graph._functions.values():
        types += [op.type for op in function.graph.get_operations()]
    return types


def test_latency_bound_sum_on_one_host_is_plain_ops(strategy):
    """One AddN per group on the group's first device, no collective op; the default stays a
    collective."""
    groups = GROUPINGS["rows"]
    types = _graph_op_types(
        strategy, lambda x: collectives.group_sum(x, groups, latency_bound=True)
    )
    assert types.count("AddN") == len(groups)
    assert not [t for t in types if t.startswith("Collective")]
    types = _graph_op_types(strategy, lambda x: collectives.group_sum(x, groups))
    assert types.count("CollectiveReduceV2") == 8


def test_in_graph_primitives_on_one_host_are_plain_ops(strategy):
    """reduce-scatter, sum: an AddN a group (each member gets its chunk of it, or all of it);
    all-gather: a concat a group, which every member gets."""
    groups = GROUPINGS["rows"]

    def fn(x):
        x = tf.tile(x, [4])
        shard = collectives.reduce_scatter(x, groups, in_graph=True)
        return collectives.all_gather(shard, groups, in_graph=True), collectives.group_sum(
            x, groups, in_graph=True
        )

    types = _graph_op_types(strategy, fn)
    assert not [t for t in types if t.startswith("Collective")]
    assert types.count("AddN") == 2 * len(groups)
    assert types.count("ConcatV2") == len(groups)
    types = _graph_op_types(strategy, lambda x: collectives.reduce_scatter(tf.tile(x, [4]), groups))
    assert types.count("CollectiveAllToAllV2") == 8


def test_in_graph_groups_on_one_host(strategy):
    seen = run_per_replica(
        strategy,
        lambda x: (
            tf.constant(
                [
                    collectives.in_graph_groups(GROUPINGS["rows"]),
                    collectives.groups_between_processes(GROUPINGS["columns"]),
                ],
                tf.float32,
            )
            + 0 * x[0]
        ),
        tf.zeros([8, 1]),
    )
    # Every group lies in this process; none holds one member per process.
    assert all(list(s) == [1.0, 0.0] for s in seen)


@pytest.mark.parametrize("in_graph", [False, True], ids=["collective", "in_graph"])
@pytest.mark.parametrize("eager", [False, True], ids=["graph", "eager"])
@pytest.mark.parametrize("grouping", ["pairs", "rows", "columns", "all", "strided"])
def test_reduce_scatter_then_all_gather_is_the_sum(strategy, grouping, eager, in_graph):
    groups = GROUPINGS[grouping]
    size = groups.shape[1]
    values, tensor = replica_inputs((size * 3, 2), tf.float32)

    def fn(x):
        shard = collectives.reduce_scatter(x, groups, in_graph=in_graph)
        return tf.concat([collectives.all_gather(shard, groups, in_graph=in_graph), shard], axis=0)

    results = run_per_replica(strategy, fn, tensor, eager)
    shards = {}
    for replica, result in enumerate(results):
        expected = values[group_of(groups, replica)].sum(axis=0)
        np.testing.assert_allclose(result[: size * 3], expected, rtol=1e-6)
        shards[replica] = result[size * 3 :]
    # Each member holds a different third of the group sum, and together they hold all of it.
    for group in groups:
        pieces = np.concatenate(sorted((shards[r] for r in group), key=lambda s: s.tobytes()))
        total = values[group].sum(axis=0)
        chunks = np.split(total, size)
        assert sorted(p.tobytes() for p in np.split(pieces, size)) == sorted(
            c.tobytes() for c in chunks
        )


@pytest.mark.parametrize("eager", [False, True], ids=["graph", "eager"])
def test_all_to_all_is_its_own_inverse(strategy, eager):
    groups = GROUPINGS["rows"]
    values, tensor = replica_inputs((8, 3), tf.float32)
    twice = run_per_replica(
        strategy,
        lambda x: collectives.all_to_all(collectives.all_to_all(x, groups), groups),
        tensor,
        eager,
    )
    for replica, result in enumerate(twice):
        np.testing.assert_array_equal(result, values[replica])


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("grouping", ["pairs", "strided"])
def test_gradients_of_a_group_sum(strategy, grouping, path):
    groups = GROUPINGS[grouping]
    values, tensor = replica_inputs((4,), tf.float32)

    def fn(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(collectives.group_sum(x * x, groups, **PATHS[path]))
        return tape.gradient(loss, x)

    # d/dx_i of sum over the group's members' losses: every member's loss holds x_i^2.
    for replica, grad in enumerate(run_per_replica(strategy, fn, tensor)):
        np.testing.assert_allclose(grad, 2 * values[replica] * groups.shape[1], rtol=1e-6)


@pytest.mark.parametrize("in_graph", [False, True], ids=["collective", "in_graph"])
def test_gradients_of_all_gather(strategy, in_graph):
    groups = GROUPINGS["rows"]
    values, tensor = replica_inputs((2,), tf.float32)
    weights = tf.range(8, dtype=tf.float32)

    def fn(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            gathered = collectives.all_gather(x, groups, in_graph=in_graph)  # [4 * 2]
            loss = tf.reduce_sum(gathered * weights)
        return tape.gradient(loss, x)

    results = run_per_replica(strategy, fn, tensor)
    # Every member's loss weighs my slot the same way, so my gradient is 4 x my slot's weights.
    for replica, grad in enumerate(results):
        assert grad.shape == (2,)
    total = sum(results)
    np.testing.assert_allclose(total, 4 * 2 * weights.numpy().reshape(4, 2).sum(axis=0), rtol=1e-6)


@pytest.mark.parametrize("in_graph", [False, True], ids=["collective", "in_graph"])
def test_gradients_of_reduce_scatter(strategy, in_graph):
    groups = GROUPINGS["rows"]
    values, tensor = replica_inputs((8,), tf.float32)
    weights = tf.range(2, dtype=tf.float32) + 1

    def fn(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(collectives.reduce_scatter(x, groups, in_graph=in_graph) * weights)
        return tape.gradient(loss, x)

    # Member of rank r weighs chunk r of every member's x: each x's gradient is the weights, tiled.
    for grad in run_per_replica(strategy, fn, tensor):
        np.testing.assert_allclose(grad, np.tile(weights.numpy(), 4), rtol=1e-6)


def test_bad_assignment_fails_before_launching(strategy):
    for bad, message in [(np.arange(6).reshape(2, 3), "exactly once"), (np.arange(8), "2-D")]:
        with pytest.raises(ValueError, match=message):
            run_per_replica(strategy, lambda x: collectives.group_sum(x, bad), tf.zeros([8, 2]))


def test_uneven_split_fails_before_launching(strategy):
    with pytest.raises(ValueError, match=r"length 6; pad it to a multiple of 4"):
        run_per_replica(
            strategy, lambda x: collectives.all_to_all(x, GROUPINGS["rows"]), tf.zeros([8, 6])
        )


def test_cross_replica_context_is_an_error(strategy):
    with strategy.scope(), pytest.raises(RuntimeError, match="replica context"):
        collectives.group_sum(tf.ones([2]), GROUPINGS["all"])


def test_no_strategy_is_the_identity():
    np.testing.assert_array_equal(collectives.group_sum(tf.ones([2]), [[0]]), [1.0, 1.0])
    assert context.current_mesh() is None


def test_tpu_ops_carry_the_group_assignment():
    mesh = ReplicaMesh.from_shape(4, 8, cores_per_chip=2, is_torus=True)
    groups = mesh.group_assignment(8, tiled=True)
    with tf.Graph().as_default() as graph, context.tpu_graph(mesh):
        x = tf.compat.v1.placeholder(tf.float32, [16, 3])
        summed = collectives.group_sum(x, groups)
        tf.gradients(summed, x)
        collectives.reduce_scatter(x, mesh.row_groups())
        collectives.all_gather(x, mesh.column_groups())
    ops = {op.type: [] for op in graph.get_operations()}
    for op in graph.get_operations():
        ops[op.type].append(op)
    assert len(ops["CrossReplicaSum"]) == 2  # the sum and its gradient
    for op in ops["CrossReplicaSum"]:
        np.testing.assert_array_equal(tf.get_static_value(op.inputs[1]), groups)
    assignments = [tf.get_static_value(op.inputs[1]) for op in ops["AllToAll"]]
    assert len(assignments) == 2
    np.testing.assert_array_equal(assignments[0], mesh.row_groups())
    np.testing.assert_array_equal(assignments[1], mesh.column_groups())


def test_repeated_steps_do_not_grow_threads(strategy):
    """Each collective op must release its runtime thread: a training loop runs millions of them."""
    import os

    groups = GROUPINGS["rows"]

    @tf.function
    def step(x):
        def replica_fn():
            return tf.add_n([collectives.group_sum(x + i, groups) for i in range(20)])

        return strategy.run(replica_fn)

    def threads():
        return len(os.listdir("/proc/self/task"))

    step(tf.constant(1.0))
    before = threads()
    for _ in range(3):
        step(tf.constant(1.0))
    assert threads() <= before + 16


def _strategy_on(cluster, task_type, task_id):
    """A stand-in strategy whose only attribute `worker_rank` reads is TensorFlow's resolver."""
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster), task_type=task_type, task_id=task_id
    )
    return types.SimpleNamespace(cluster_resolver=resolver)


def test_worker_rank_follows_the_runtime_order_of_task_names():
    workers = {"worker": [f"host{i}:2222" for i in range(12)]}
    # The collective runtime orders tasks by name as text: task:10 and task:11 before task:2.
    ranks = [collectives.worker_rank(_strategy_on(workers, "worker", i)) for i in range(12)]
    assert ranks == [0, 1, 4, 5, 6, 7, 8, 9, 10, 11, 2, 3]
    with_chief = {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"]}
    assert [
        collectives.worker_rank(_strategy_on(with_chief, job, i))
        for job, i in (("chief", 0), ("worker", 0), ("worker", 1))
    ] == [0, 1, 2]
    assert collectives.worker_rank(types.SimpleNamespace()) == 0  # one process


def test_task_of_reads_which_task_this_process_is():
    # The chief first, then the workers by index, whatever order the spec lists them in.
    with_chief = {"worker": {3: "w3:1", 1: "w1:1"}, "chief": ["c:1"], "evaluator": ["e:1"]}
    assert context.task_of(_strategy_on(with_chief, "worker", "3")) == (
        ("worker", 3),
        (("chief", 0), ("worker", 1), ("worker", 3)),
    )
    assert context.task_of(_strategy_on(with_chief, "evaluator", 0))[0] == ("evaluator", 0)
    assert context.task_of(types.SimpleNamespace()) == (None, ())  # no resolver: one process
    assert context.task_of(_strategy_on({}, None, None)) == (None, ())  # an empty cluster
    assert context.task_name(("worker", 3)) == "/job:worker/replica:0/task:3"
    assert collectives.process_index(_strategy_on(with_chief, "worker", 3)) == 2
