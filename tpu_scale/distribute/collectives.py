"""Group collectives over the replica mesh: the only module that launches cross-replica ops.

Every function here is called in replica context (inside `strategy.run`, a Keras `train_step`, or a
layer's `call` during training) with a static `group_assignment`: an int array `[num_groups,
group_size]` of replica ids that partitions all replicas. Each replica takes part in the group that
holds its id.

One backend per platform, chosen here so that layers and the gradient aggregator never branch on it:

* TPU (`TPUStrategy`): `cross_replica_sum` and `all_to_all` with the static group assignment; XLA
  needs no keys and the replica id may be a tensor.
* CPU/GPU graphs (`MirroredStrategy`, `MultiWorkerMirroredStrategy` inside `tf.function`):
  collective V2 ops with a private group key per group, call-time instance keys and one ordering
  token per device. Without the token, automatic control dependencies chain every replica's
  collective in one sequence and the replicas wait on each other forever; without private keys, our
  groups would collide with the strategy's own.
* Latency-bound sums over groups inside one process (`group_sum(..., latency_bound=True)`, e.g.
  batch-norm statistics): plain ops in the step's graph, summed on the group's first device; no ring
  of hand-offs for a few kilobytes.
* In-graph groups (`in_graph=True` on `group_sum`, `reduce_scatter`, `all_gather`): where every
  member of a group is a CPU device of this process, inside `tf.function`, the primitive is built
  from plain ops in the step's graph (`AddN`, `Split`, `ConcatV2` placed on the members' devices;
  a sum or a gather whose result every member gets is built once, on the group's first device);
  the replicas share the host's memory, so a tensor handed from one CPU device to another is not
  copied. A group that crosses processes still runs as a collective op, so one schedule mixes both
  (`in_graph_groups` says which applies).
* Eager replica context (`run_eagerly=True`, eager `strategy.run`): replicas run one after another
  there, so a raw collective would wait for peers that never come. We place each replica's value in
  its group's slot and use the strategy's own all-reduce, which cannot deadlock.

Ranks inside a group: on TPU and eagerly they follow the order of the group's row; in collective ops
the runtime orders devices itself. Whatever the order, `all_to_all`, `reduce_scatter` and
`all_gather` over the same group agree on it, so a reduce-scatter followed by an all-gather always
restores the full sum.

No V2 collective op has a registered gradient, so each has a custom gradient here: the gradient of a
group sum is the group sum, of an all-to-all the same all-to-all, of an all-gather the
reduce-scatter.
"""

import numpy as np
import tensorflow as tf

from tpu_scale.distribute import context
from tpu_scale.distribute.collective_launch import (  # noqa: F401  (ordering_channel, timeout_seconds: public)
    PRIVATE_KEY_BASE,
    Launch,
    collective_all_gather,
    collective_all_to_all,
    collective_sum,
    local_shard_sum,
    ordering_channel,
    timeout_seconds,
)
from tpu_scale.tf_seam import device_util
from tpu_scale.tf_seam import distribute_values as values_lib


def _checked_groups(group_assignment, num_replicas):
    groups = np.asarray(group_assignment, dtype=np.int64)
    if groups.ndim != 2 or groups.size == 0:
        raise ValueError(f"group_assignment must be a 2-D [num_groups, group_size] array of replica ids, got shape {groups.shape}. Build one with mesh.group_assignment(group_size).")
    if sorted(groups.ravel().tolist()) != list(range(num_replicas)):
        raise ValueError(f"group_assignment {groups.tolist()} must hold each of the {num_replicas} replica ids exactly once. Build one with mesh.group_assignment(group_size) from this strategy's mesh.")
    return groups


def _static_replica_id(ctx):
    replica_id = tf.get_static_value(ctx.replica_id_in_sync_group)
    if replica_id is None:
        raise RuntimeError("The replica id is not known while tracing, so the replica's group cannot be chosen. This happens on TPU-like strategies; use TPUStrategy (TPU ops) or MirroredStrategy.")
    return int(replica_id)


def _my_group(groups, replica_id):
    row = int(np.argwhere(groups == replica_id)[0, 0])
    return row, groups[row]


# --------------------------------------------------------------------------- eager fallback


def _replica_values(strategy, value):
    """Every local replica's `value` from inside a merge call, in replica id order.

    Replicas that all passed the very same tensor (e.g. a captured constant) arrive as that one
    tensor.
    """
    parts = strategy.experimental_local_results(value)
    if len(parts) == 1:
        parts = parts * len(strategy.extended.worker_devices)
    return parts


def _stack_local_results(strategy, value):
    return tf.stack(_replica_values(strategy, value))


def _all_replicas_local(ctx):
    try:
        return len(ctx.strategy.extended.worker_devices) == ctx.num_replicas_in_sync
    except (RuntimeError, NotImplementedError):
        return False


def _local_replica_ids(ctx):
    """`(first, count)`: this process's replica ids `first + i` (a worker's: `task * count + i`)."""
    local = len(ctx.strategy.extended.worker_devices)
    first = _static_replica_id(ctx) // local * local
    return first, local


def groups_in_process(group_assignment):
    """True when every group holding one of this process's replicas lies wholly in it (False on
    TPU)."""
    if context.forced_mesh() is not None or context.backend() not in ("collective", "eager"):
        return context.backend() == "single"
    first, local = _local_replica_ids(tf.distribute.get_replica_context())
    for members in np.asarray(group_assignment).tolist():
        inside = [first <= m < first + local for m in members]
        if any(inside) and not all(inside):
            return False
    return True


def groups_between_processes(group_assignment):
    """True when the group holding this replica has no other member in this process (and size > 1).

    The phases a 16-bit transport may carry: they only add values from different processes.
    """
    groups = np.asarray(group_assignment)
    if (
        groups.shape[1] < 2
        or context.forced_mesh() is not None
        or context.backend() not in ("collective", "eager")
    ):
        return False
    ctx = tf.distribute.get_replica_context()
    first, local = _local_replica_ids(ctx)
    _, members = _my_group(groups, _static_replica_id(ctx))
    return sum(first <= m < first + local for m in members.tolist()) == 1


def worker_rank(strategy):
    """This worker's rank in a collective group of one replica per worker, inside `tf.function`.

    `reduce_scatter` and `all_gather` over such a group (a mesh column across workers) keep and
    concatenate chunks in this rank order. TensorFlow's collective runtime orders a group's
    processes by their task names as text ("Connect the global rank order by the lexicographical
    order of the tasks", `EstablishGlobalRank` in
    tensorflow/core/common_runtime/collective_param_resolver_local.cc): `/job:chief/...` before
    `/job:worker/...`, and `task:10` before `task:2`. Below eleven workers that is the order of the
    workers' replica ids.

    Args:
      strategy: the strategy; a `MultiWorkerMirroredStrategy` over a cluster with a chief and/or
        workers, or any one-process strategy.

    Returns:
      The rank, from 0; 0 in one process.
    """
    return process_ranks(strategy)[process_index(strategy)]


def process_ranks(strategy):
    """Per process, in the strategy's order (its replica ids: the chief, then the workers), its rank
    in the collective runtime's order of processes (see `worker_rank`); `[0]` in one process."""
    names = [context.task_name(task) for task in context.task_of(strategy)[1]]
    return [sorted(names).index(name) for name in names] if len(names) > 1 else [0]


def process_index(strategy):
    """This process's position in the strategy's order: its replicas are `index * local + l`."""
    me, tasks = context.task_of(strategy)
    return tasks.index(me) if len(tasks) > 1 else 0


def in_graph_groups(group_assignment):
    """True when `in_graph=True` primitives over these groups are plain ops in this step's graph.

    That is: inside `tf.function` (the collective-op backend), this replica on a CPU device, and
    `groups_in_process(group_assignment)`. Every process of a symmetric mesh (a row per host)
    answers the same, so all of them build the same kind of op. GPUs keep collective ops (NCCL rings
    over NVLink).

    """
    if context.forced_mesh() is not None or context.backend() != "collective":
        return False
    if "CPU" not in device_util.canonicalize(device_util.current()).upper():
        return False
    return groups_in_process(group_assignment)


def _merged(xs, groups, ctx, build):
    """Runs `build(parts, devices) -> outputs` over every local group, for each tensor of `xs`.

    `parts` are the group members' values in the group's order and `devices` their devices; `build`
    returns one output per member. One merge call serves the whole list: it sees every local
    replica's values at trace time (each merge call stops every replica's thread once), and at run
    time only the step graph's dataflow remains.
    """
    first, _ = _local_replica_ids(ctx)

    def merge(strategy, values):
        devices = strategy.extended.worker_devices
        out = []
        for value in values:
            parts = _replica_values(strategy, value)
            results = [None] * len(parts)
            for members in groups.tolist():
                local = [m - first for m in members]
                if not 0 <= local[0] < len(parts):
                    continue  # another process's group
                outputs = build([parts[i] for i in local], [devices[i] for i in local])
                for i, result in zip(local, outputs):
                    results[i] = result
            out.append(values_lib.PerReplica(tuple(results)))
        return out

    # `groups` and `build` go in the closure: merge-call arguments that differ by identity become
    # PerReplica.
    return list(ctx.merge_call(merge, args=(list(xs),)))


def _on_each(devices, fn):
    return [_on(device, fn, rank) for rank, device in enumerate(devices)]


def _on(device, fn, rank):
    with tf.device(device):
        return fn(rank)


def _sum_on_first(parts, devices):
    with tf.device(devices[0]):
        return tf.add_n(parts)


def _build_sum_on_first(parts, devices):
    total = _sum_on_first(parts, devices)
    return _on_each(devices, lambda rank: tf.identity(total))


def _build_reduce_scatter(parts, devices):
    # Summed once on the first device (`_sum_on_first`), then cut there: each member gets
    # its chunk through one transfer, where adding each member's chunks on its own device takes one
    # per pair (the devices of one CPU process share its threads, so where the sum runs costs
    # nothing). Split as `[g, rest]`: chunks along axis 0 whose size is a multiple of 64 bytes share
    # the sum's buffer (TensorFlow's `Split` copies every other split, e.g. any of a 1-D one).
    g = len(parts)
    total = _sum_on_first(parts, devices)
    with tf.device(devices[0]):
        rest = total.shape[1:]
        if rest.is_fully_defined():
            shape = [-1] + rest.as_list()
        else:
            shape = tf.concat([[-1], tf.shape(total)[1:]], 0)
        chunks = [tf.reshape(c, shape) for c in tf.split(tf.reshape(total, [g, -1]), g, axis=0)]
    return _on_each(devices, lambda rank: tf.identity(chunks[rank]))


def _build_all_gather(parts, devices):
    # Built once, as the sum above: every member gets the same buffer (a variable assigned from it
    # shares it too, until an in-place update copies it).
    with tf.device(devices[0]):
        gathered = tf.concat(parts, axis=0)
    return _on_each(devices, lambda rank: tf.identity(gathered))


# The replica's gradient tape does not see the merge call's ops, hence custom gradients: each kind's
# is its dual. The result is built outside the custom gradient and passed in: from inside it, the
# graph-mode walk from outputs to inputs would cross into every other replica's graph at every call.
_KINDS = {
    "sum": (_build_sum_on_first, "sum"),  # kind -> (builder, the kind of its gradient)
    "reduce_scatter": (_build_reduce_scatter, "all_gather"),
    "all_gather": (_build_all_gather, "reduce_scatter"),
}


def _in_graph(xs, groups, ctx, kind):
    """`kind` over the tensors `xs` in one merge call; each result's gradient is the dual kind."""
    build, dual = _KINDS[kind]
    results = _merged(xs, groups, ctx, build)

    def one(x, result):
        @tf.custom_gradient
        def op(x, result):
            return tf.identity(result), lambda dy: (_in_graph([dy], groups, ctx, dual)[0], None)

        return op(x, result)

    return [one(x, r) for x, r in zip(xs, results)]


def _in_graph_list(x, group_assignment, kind):
    """The in-graph form of a primitive for a tensor or a list of tensors (same structure back)."""
    xs = [tf.convert_to_tensor(t) for t in (x if isinstance(x, (list, tuple)) else [x])]
    groups = _checked_groups(
        group_assignment, tf.distribute.get_replica_context().num_replicas_in_sync
    )
    if kind == "reduce_scatter":
        for t in xs:
            _check_divisible(t, groups.shape[1], "reduce_scatter")
    if groups.shape[1] == 1:
        out = [tf.identity(t) for t in xs]
    else:
        out = _in_graph(xs, groups, tf.distribute.get_replica_context(), kind)
    return out if isinstance(x, (list, tuple)) else out[0]


def _each(fn, x, *args):  # the non-in-graph forms, tensor by tensor
    return [fn(t, *args) for t in x]


def native_all_reduce(values):
    """The strategy's own sum of the tensors `values` over all replicas (TensorFlow's reduction)."""
    ctx = tf.distribute.get_replica_context()
    return ctx.all_reduce(tf.distribute.ReduceOp.SUM, list(values))


def _eager_slot_sum(value, groups, ctx):
    """Every member's `value`, `[group_size, ...]` in rank order, and this replica's rank in its
    group.

    On one host the replicas' values are stacked in a merge call, with plain ops: eager collective
    ops from two strategies over the same devices reuse the same keys and abort the process's
    collective runtime. Across hosts each value goes in its `[group, rank]` slot and one strategy
    all-reduce sums the slots.
    """
    replica_id = _static_replica_id(ctx)
    row, members = _my_group(groups, replica_id)
    rank = int(np.argwhere(members == replica_id)[0, 0])
    if _all_replicas_local(ctx):
        # Local results come in replica id order: one host's replicas are 0..n-1.
        everyone = ctx.merge_call(_stack_local_results, args=(value,))
        return tf.gather(everyone, members.tolist()), rank
    num_groups, group_size = groups.shape
    one_hot = tf.one_hot(row * group_size + rank, num_groups * group_size, dtype=value.dtype)
    slots = tf.tensordot(one_hot, value, axes=0)  # [groups * size, ...]
    summed = ctx.all_reduce(tf.distribute.ReduceOp.SUM, slots)
    return tf.reshape(summed, tf.concat([[num_groups, group_size], tf.shape(value)], 0))[row], rank


# --------------------------------------------------------------------------- public primitives


def _dispatch(x, group_assignment):
    """The tensor, the backend to use, and the checked group assignment."""
    x = tf.convert_to_tensor(x)
    backend = context.backend()
    forced = context.forced_mesh()
    num_replicas = (
        forced.num_replicas
        if forced is not None
        else tf.distribute.get_replica_context().num_replicas_in_sync
    )
    return x, backend, _checked_groups(group_assignment, num_replicas)


def group_sum(x, group_assignment, latency_bound=False, in_graph=False):
    """Sums `x` over the replicas of this replica's group.

    Args:
      x: a tensor, the same shape on every replica, or a list of them.
      group_assignment: int `[num_groups, group_size]` replica ids partitioning all replicas.
      latency_bound: True for a small tensor on the step's critical path, such as batch-norm
        statistics. When the group lives in this process (one host, or groups inside each host of
        several, inside `tf.function`), such a sum is then built from plain ops in the step's
        graph: each member's value goes to the group's first device, one `AddN` sums it there and
        each member reads the result back, two hops in all. A collective op would pass the data
        around a ring in `2 * (group_size - 1)` hand-offs, which for a few kilobytes costs far more
        than the data. Elsewhere (TPU, groups across hosts, eager) it changes nothing.
      in_graph: True to build the sum from plain ops (summed on the group's first device, read back
        by every member) wherever `in_graph_groups(group_assignment)` holds, for any size: on CPU
        devices of one process this is `ReductionToOneDevice`'s form. Elsewhere it changes nothing.

    Returns:
      The sum of `x` over the group, on every member of the group. A list of tensors gives the list
      of their sums (on the in-graph path all built in one merge call).
    """
    if in_graph and in_graph_groups(group_assignment):
        return _in_graph_list(x, group_assignment, "sum")
    if isinstance(x, (list, tuple)):
        return _each(group_sum, x, group_assignment, latency_bound)
    x, backend, groups = _dispatch(x, group_assignment)
    if backend == "single" or groups.shape[1] == 1:
        return tf.identity(x)
    if backend == "tpu":
        return tf.raw_ops.CrossReplicaSum(input=x, group_assignment=groups.astype(np.int32))
    ctx = tf.distribute.get_replica_context()
    if backend == "eager":
        return _eager_group_sum(x, groups, ctx)
    if latency_bound and (_all_replicas_local(ctx) or groups_in_process(groups)):
        return _in_graph([x], groups, ctx, "sum")[0]
    _, members = _my_group(groups, _static_replica_id(ctx))
    return collective_sum(x, Launch(members))


def _eager_group_sum(x, groups, ctx):
    # The one-host fallback stacks the replicas' values in a merge call, which the replica's
    # gradient tape does not see; without this gradient the other members' share of the gradient
    # would be lost.
    @tf.custom_gradient
    def summed(x):
        slots, _ = _eager_slot_sum(x, groups, ctx)
        return tf.reduce_sum(slots, axis=0), lambda dy: _eager_group_sum(dy, groups, ctx)

    return summed(x)


def all_to_all(x, group_assignment):
    """Exchanges chunks inside the group: chunk `i` of axis 0 goes to rank `i`.

    Args:
      x: a tensor whose axis 0 is a multiple of the group size.
      group_assignment: int `[num_groups, group_size]` replica ids partitioning all replicas.

    Returns:
      A tensor of the same shape whose chunk `j` came from rank `j` of the group.
    """
    x, backend, groups = _dispatch(x, group_assignment)
    group_size = groups.shape[1]
    _check_divisible(x, group_size, "all_to_all")
    if backend == "single" or group_size == 1:
        return tf.identity(x)
    if backend == "tpu":
        return tf.raw_ops.AllToAll(
            input=x,
            group_assignment=groups.astype(np.int32),
            concat_dimension=0,
            split_dimension=0,
            split_count=group_size,
        )
    ctx = tf.distribute.get_replica_context()
    if backend == "eager":
        slots, rank = _eager_slot_sum(x, groups, ctx)  # [size, ...]: every rank's full x
        chunk = tf.shape(x)[0] // group_size
        return tf.concat(
            [slots[j, rank * chunk : (rank + 1) * chunk] for j in range(group_size)], axis=0
        )
    _, members = _my_group(groups, _static_replica_id(ctx))
    return collective_all_to_all(x, Launch(members))


def reduce_scatter(x, group_assignment, in_graph=False):
    """Sums `x` over the group and keeps this replica's chunk of axis 0 (its rank's `1/group_size`).

    Done as an all-to-all plus a local sum: the CPU runtime has no reduce-scatter kernel, and a
    failed collective would stop the process's collective runtime for good.

    Args:
      x: a tensor whose axis 0 is a multiple of the group size, or a list of them.
      group_assignment: int `[num_groups, group_size]` replica ids partitioning all replicas.
      in_graph: True to build it from plain ops wherever `in_graph_groups(group_assignment)` holds:
        the group's sum on its first member's device, and the member of rank `r` gets its `r`-th
        chunk (ranks follow the group's order). Elsewhere it changes nothing.

    Returns:
      `[x.shape[0] // group_size, ...]`: this rank's chunk of the group sum.
    """
    if in_graph and in_graph_groups(group_assignment):
        return _in_graph_list(x, group_assignment, "reduce_scatter")
    if isinstance(x, (list, tuple)):
        return _each(reduce_scatter, x, group_assignment)
    group_size = np.asarray(group_assignment).shape[-1]
    return local_shard_sum(all_to_all(x, group_assignment), group_size)


def all_gather(x, group_assignment, in_graph=False):
    """Concatenates `x` from every rank of the group along axis 0, in rank order.

    Args:
      x: a tensor, the same shape on every replica, or a list of them.
      group_assignment: int `[num_groups, group_size]` replica ids partitioning all replicas.
      in_graph: True to build it from plain ops (one `ConcatV2` of the members' values, on the
        first member's device, handed to every member) wherever `in_graph_groups(group_assignment)` holds. Elsewhere it changes
        nothing.

    Returns:
      `[group_size * x.shape[0], ...]`.
    """
    if in_graph and in_graph_groups(group_assignment):
        return _in_graph_list(x, group_assignment, "all_gather")
    if isinstance(x, (list, tuple)):
        return _each(all_gather, x, group_assignment)
    x, backend, groups = _dispatch(x, group_assignment)
    group_size = groups.shape[1]
    if backend == "single" or group_size == 1:
        return tf.identity(x)
    if backend == "tpu":
        # Send the same tensor to every rank: an all-to-all of `group_size` copies is an all-gather.
        return all_to_all(tf.tile(x, [group_size] + [1] * (x.shape.rank - 1)), groups)
    ctx = tf.distribute.get_replica_context()
    if backend == "eager":
        slots, _ = _eager_slot_sum(x, groups, ctx)
        return tf.reshape(slots, tf.concat([[-1], tf.shape(x)[1:]], 0))
    _, members = _my_group(groups, _static_replica_id(ctx))
    return collective_all_gather(x, Launch(members))


# --------------------------------------------------------------------------- cross-replica form


def _collective_reduce_scatter(x, launch):
    return local_shard_sum(collective_all_to_all(x, launch), launch.group_size)


# kind -> (the in-graph builder over a group's members, the collective op one member launches)
_ACROSS_DEVICES = {
    "sum": (_build_sum_on_first, collective_sum),
    "reduce_scatter": (_build_reduce_scatter, _collective_reduce_scatter),
    "all_gather": (_build_all_gather, collective_all_gather),
}


def local_groups_in_graph(devices):
    """True when a group wholly on `devices` (this process's replicas) is built from plain ops
    by `across_devices`: eagerly (replicas run one after another there), or on CPU devices (they
    share the host's memory). GPUs keep collective ops (NCCL rings over NVLink)."""
    if tf.executing_eagerly():
        return True
    return all(tf.DeviceSpec.from_string(d).device_type in (None, "CPU") for d in devices)


def across_devices(kind, xs, group_assignment, devices, first_replica):
    """One primitive over every local replica's tensors at once, in cross-replica context.

    The form a `tf.distribute.CrossDeviceOps` needs: it receives every local replica's values
    together (a merge call's `PerReplica`), not one replica's. Each group wholly on this process's
    devices is built as `in_graph=True` builds it in replica context, where
    `local_groups_in_graph(devices)` holds; every other group runs one collective op per local
    member, launched on that member's device with the same private keys and ordering tokens as in
    replica context, so the two forms can meet in one step.

    Args:
      kind: `"sum"`, `"reduce_scatter"` (this rank's chunk of axis 0 of the group sum) or
        `"all_gather"` (every rank's tensor along axis 0, in rank order).
      xs: per local replica `l` (replica id `first_replica + l`), a list of tensors; every
        replica's list has the same length, shapes and dtypes.
      group_assignment: int `[num_groups, group_size]` replica ids partitioning all replicas.
      devices: the local replicas' devices, by `l`.
      first_replica: the replica id of `devices[0]`.

    Returns:
      Per local replica, the list of its results.

    Raises:
      ValueError: for a group that leaves this process eagerly (collective ops launched one device
        after another would wait for each other forever); run it inside `tf.function`.
    """
    build, launch_one = _ACROSS_DEVICES[kind]
    groups = np.asarray(group_assignment, dtype=np.int64)
    count = len(devices)
    in_graph = local_groups_in_graph(devices)
    out = [[None] * len(x) for x in xs]
    for members in groups.tolist():
        local = [m - first_replica for m in members]
        mine = [i for i in local if 0 <= i < count]
        if not mine:
            continue  # another process's group
        if len(members) == 1:
            out[mine[0]] = [tf.identity(x) for x in xs[mine[0]]]
        elif len(mine) == len(members) and in_graph:
            for j in range(len(xs[mine[0]])):
                if kind == "reduce_scatter":
                    for i in mine:
                        _check_divisible(xs[i][j], len(members), kind)
                for i, result in zip(mine, build([xs[i][j] for i in mine], [devices[i] for i in mine])):
                    out[i][j] = result
        elif tf.executing_eagerly():
            raise ValueError(f"The group {members} spans processes, and a collective op per device cannot run eagerly here (each would wait for the next). Sum inside tf.function.")
        else:
            for i in mine:
                with tf.device(devices[i]):
                    launch = Launch(members)
                    out[i] = [launch_one(x, launch) for x in xs[i]]
    return out


def _check_divisible(x, group_size, name):
    first = x.shape[0] if x.shape.rank else None
    if x.shape.rank == 0:
        raise ValueError(f"{name} needs a tensor with a leading axis to split; got a scalar.")
    if first is not None and first % group_size:
        raise ValueError(f"{name} splits axis 0 into {group_size} equal chunks, but it has length {first}; pad it to a multiple of {group_size}.")
