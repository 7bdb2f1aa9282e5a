"""The torus gradient sum's executor: runs a `torus_schedule.Schedule` with the group collectives.

`all_reduce_sum(grads)` sums gradients over all replicas in replica context (custom training loops;
the Keras hook in `tpu_scale.keras_hook` calls it from `model.fit`). It fuses the gradients into a
few flat buffers per dtype (`pack_bytes` each), pads every buffer so each stream's share splits
evenly into shards, runs the streams' phases, and cuts the sums back into the gradients' shapes. The
executor picks the primitive per phase: a phase whose groups sit inside this process on CPU devices
(every phase on one host, the row phases of a hosts x replicas mesh) is built from plain ops in the
step graph (`collectives.in_graph_groups`: the replicas share the host's memory); every other phase
is a collective op on CPU/GPU (reduce-scatter as all-to-all plus a local sum: the CPU runtime has no
reduce-scatter kernel) and a TPU op on TPU. With `gradient_dtype`, the phases between hosts carry
bfloat16.

`"auto"` is `resolve_algorithm`'s rule for the strategy's hardware (`create_strategy` attaches
what it found): on one CPU host `"flat"`, the in-graph sum on one device.

Each gradient keeps its dtype: float32, bfloat16 and float16 travel as themselves.
`tf.IndexedSlices` (embedding gradients) are densified before packing: every replica then
contributes a dense buffer of the variable's shape, which is exact, and cheap whenever the embedding
table is small next to the rest of the model. Very large, sparsely touched tables are better left to
TensorFlow's gather-based reduction (`gradient_reduction="native"`).

The schedule's names (`build_schedule`, `ALGORITHMS`, `Phase`, ...) are re-exported here, so
this module is the one a user of the sum needs.

Reference:
  Ying et al., "Image Classification at Supercomputer Scale", 2018 (arXiv:1811.06992), section 3.3.
"""

import logging

import numpy as np
import tensorflow as tf

from tpu_scale.distribute import collectives, context
from tpu_scale.tf_seam import device_util
from tpu_scale.tf_seam import distribute_values as values_lib
from tpu_scale.torus.schedule import (  # noqa: F401  (re-exported: the public torus names)
    ALGORITHMS,
    ALGORITHMS_AND_NATIVE,
    ALL_GATHER,
    ALL_REDUCE,
    DEFAULT_ALGORITHM,
    DEFAULT_PACK_BYTES,
    GRADIENT_ALGORITHMS,
    REDUCE_SCATTER,
    Phase,
    Schedule,
    buffer_schedule,
    build_schedule,
    bytes_sent_between,
    pack_indices,
    padded_length,
    phase_within_hosts,
    resolve_algorithm,
    ring_bytes_sent_between,
    shard_position,
    sharded_streams,
    stream_sizes,
    transport_schedule,
)

SUPPORTED_DTYPES = ("float16", "bfloat16", "float32", "float64")
GRADIENT_DTYPES = (None, "float32", "bfloat16")

logger = logging.getLogger(__name__)


# Plain Python over static shapes: AutoGraph would only rewrite it again inside every user
# tf.function.
@tf.autograph.experimental.do_not_convert
def all_reduce_sum(
    grads,
    strategy=None,
    mesh=None,
    algorithm=DEFAULT_ALGORITHM,
    pack_bytes=DEFAULT_PACK_BYTES,
    gradient_dtype=None,
):
    """Sums gradients over all replicas with the 2-D torus schedule; call it in replica context.

    For custom training loops: inside `strategy.run(step)`, `grads = torus.all_reduce_sum(grads)`
    replaces `tf.distribute.get_replica_context().all_reduce("sum", grads)`. Every replica must call
    it with the same structure, shapes and dtypes.

    Args:
      grads: a tensor, `tf.IndexedSlices` or None, or a (nested) list of them. Shapes must be
        static.
      strategy: the strategy whose mesh to use; defaults to the current replica context's strategy.
      mesh: a `ReplicaMesh` to use instead of the strategy's.
      algorithm: one of `ALGORITHMS` (see `build_schedule`), `"native"` (the strategy's own
        all-reduce) or `"auto"`: `resolve_algorithm`'s rule for the strategy's hardware
        (`create_strategy` attaches what it found; elsewhere the rule for the mesh alone).
      pack_bytes: gradients of one dtype are fused into flat buffers of about this many bytes (a
        larger tensor gets its own buffer); `None` or 0 fuses each dtype into one buffer. When every
        phase runs as plain ops in the step graph (one CPU host) nothing is fused: there is no
        launch to amortize, and fusing would copy every gradient once more.
      gradient_dtype: e.g. `tf.bfloat16`: phases whose groups hold one replica per host (the column
        all-reduce of `"torus_2d"` across hosts) carry wider gradients in this dtype (cast before
        the phase, back after it); every other phase sums in the gradient's own dtype. None: every
        phase in the gradient's dtype.

    Returns:
      The same structure: each gradient summed over all replicas, in its own dtype and shape;
      IndexedSlices come back as dense tensors; None stays None.

    Reference:
      Ying et al., "Image Classification at Supercomputer Scale", 2018 (arXiv:1811.06992), section
      3.3.
    """
    ambient = context.current_mesh()
    if ambient is None and tf.distribute.get_replica_context() is None:
        raise RuntimeError("torus.all_reduce_sum runs in replica context: call it inside strategy.run(...) or a Keras train_step, not in cross-replica context.")
    if mesh is None:
        mesh = context.mesh_of(strategy) if strategy is not None else ambient
    if pack_bytes is not None and pack_bytes < 0:
        raise ValueError(
            f"pack_bytes must be positive, or None / 0 for one buffer per dtype; got {pack_bytes}."
        )
    transport = None if gradient_dtype is None else tf.as_dtype(gradient_dtype)

    flat = tf.nest.flatten(grads)
    dense = [None if g is None else _densify(g) for g in flat]
    if mesh is None or mesh.num_replicas == 1:
        return tf.nest.pack_sequence_as(grads, dense)
    if algorithm == "auto":
        if strategy is None and tf.distribute.get_replica_context() is not None:
            strategy = tf.distribute.get_replica_context().strategy
        rule = getattr(strategy, "auto_algorithm", None)
        sizes = [
            (g.shape.num_elements() * g.dtype.size, g.dtype.name) for g in dense if g is not None
        ]
        algorithm = rule(mesh, sizes) if rule is not None else resolve_algorithm("auto", mesh)
    if algorithm == "native":
        present = [i for i, g in enumerate(dense) if g is not None]
        summed = list(dense)
        for i, value in zip(present, collectives.native_all_reduce([dense[i] for i in present])):
            summed[i] = value
        return tf.nest.pack_sequence_as(grads, summed)
    algorithm = resolve_algorithm(algorithm, mesh)
    if ambient is not None and ambient.num_replicas != mesh.num_replicas:
        raise ValueError(f"The mesh {mesh} holds {mesh.num_replicas} replicas but {ambient.num_replicas} are in sync here; pass the strategy's own mesh (tpu_scale.mesh_of(strategy)).")
    _check_rank_order(mesh)
    phases = [p for stream in build_schedule(mesh, 0, algorithm).streams for p in stream]
    if phases and all(collectives.in_graph_groups(p.groups) for p in phases):
        pack_bytes = 1  # every tensor on its own: plain ops have no launch cost to amortize
    summed = list(dense)
    packs = _packs([(i, g) for i, g in enumerate(dense) if g is not None], pack_bytes)
    for pack, values in zip(
        packs, _sum_packs([[dense[i] for i in p] for p in packs], mesh, algorithm, transport)
    ):
        for i, value in zip(pack, values):
            summed[i] = value
    return tf.nest.pack_sequence_as(grads, summed)


def _densify(g):
    if isinstance(g, tf.IndexedSlices):
        if tf.get_static_value(g.dense_shape) is None:
            raise ValueError("An IndexedSlices gradient has no static dense_shape, so it cannot be densified for the torus sum. Give the embedding variable a static shape, or use gradient_reduction='native'.")
        g = tf.convert_to_tensor(g)  # unsorted segment sum into the variable's shape
    g = tf.convert_to_tensor(g)
    if not g.shape.is_fully_defined():
        raise ValueError(f"The torus sum needs static gradient shapes to lay out its buffers; got {g.shape}. Gradients of variables always have one; for other tensors set the shape (tf.ensure_shape).")
    if g.dtype.name not in SUPPORTED_DTYPES:
        raise ValueError(f"The torus sum supports {SUPPORTED_DTYPES} gradients; got {g.dtype.name}. Cast it, or use gradient_reduction='native'.")
    return g


def _packs(items, pack_bytes):
    """Groups `(index, tensor)` pairs by dtype, in order, into lists of indices of about
    `pack_bytes` each."""
    by_dtype = {}
    for i, g in items:
        by_dtype.setdefault(g.dtype, []).append((i, g))
    packs = []
    for members in by_dtype.values():
        sizes = [g.shape.num_elements() * g.dtype.size for _, g in members]
        packs.extend([members[p][0] for p in pack] for pack in pack_indices(sizes, pack_bytes))
    return packs


def _check_rank_order(mesh):
    """Fails unless every replica keeps the same shard in both dimensions' collectives.

    After a reduce-scatter along a row, replica `(r, c)` holds the chunk of its rank in the row; the
    column all-reduce that follows only adds matching chunks if that rank is the same in every row.
    TPU ops rank by the order of each group (the mesh's columns); collective ops rank by device
    order, which is replica id order, so on CPU/GPU the mesh must number its replicas row-major
    (every `create_strategy` mesh does).
    """
    if context.backend() == "collective":
        _check_row_major(mesh)


def _check_row_major(mesh):
    rows, cols = mesh.shape
    if not np.array_equal(mesh.grid, np.arange(rows * cols).reshape(rows, cols)):
        raise ValueError(f"The torus sum on CPU/GPU needs a mesh numbered row-major (replica r * cols + c at (r, c)), so that collective ranks match mesh columns; got {mesh.grid.tolist()}. Use ReplicaMesh.from_shape.")


def _sum_packs(packs, mesh, algorithm, transport):
    """Fuses each pack (same-dtype tensors) into a buffer, sums them all over the mesh, cuts them
    back.

    Every pack meets the phases in the same order, phase by phase: a phase's primitive gets the list
    of all packs' buffers, so on the in-graph path one merge call builds the phase for every buffer.
    """
    buffers = [_to_buffer(tensors, mesh, algorithm) for tensors in packs]
    run_streams(build_schedule(mesh, 0, algorithm).streams, [b for b, _ in buffers], transport)
    return [_from_buffer(tensors, *b) for tensors, b in zip(packs, buffers)]


def _to_buffer(tensors, mesh, algorithm):
    """Same-dtype tensors as one flat buffer, padded so each stream's share splits evenly: the list
    of the streams' shares and `(length, padded length)`."""
    flat = (
        tf.concat([tf.reshape(t, [-1]) for t in tensors], axis=0)
        if len(tensors) > 1
        else tf.reshape(tensors[0], [-1])
    )
    length = int(flat.shape[0])
    padded = padded_length(length, mesh, algorithm)
    if padded != length:
        flat = tf.pad(flat, [[0, padded - length]])
    itemsize = tensors[0].dtype.size
    shares = [b // itemsize for b in stream_sizes(build_schedule(mesh, padded * itemsize, algorithm))]
    return (tf.split(flat, shares) if len(shares) > 1 else [flat]), (length, padded)


def _from_buffer(tensors, parts, lengths):
    """The summed buffer's shares cut back into tensors of `tensors`' shapes."""
    length, padded = lengths
    flat = tf.concat(parts, axis=0) if len(parts) > 1 else parts[0]
    flat = flat[:length] if padded != length else flat
    if len(tensors) == 1:
        return [tf.reshape(flat, tensors[0].shape)]
    pieces = tf.split(flat, [t.shape.num_elements() for t in tensors])
    return [tf.reshape(p, t.shape) for p, t in zip(pieces, tensors)]


_PRIMITIVES = {
    REDUCE_SCATTER: collectives.reduce_scatter,
    ALL_REDUCE: collectives.group_sum,
    ALL_GATHER: collectives.all_gather,
}


def run_streams(streams, buffers, transport=None, channel="tpu_scale.torus"):
    """Runs each stream's phases, in order, over that stream's share of every buffer.

    Args:
      streams: per stream, a sequence of `Phase` (a `Schedule`'s streams, or the halves of
        `sharded_streams`).
      buffers: per buffer, a list with one tensor per stream (the buffer's share for it); each
        share is replaced by the result of its stream's last phase.
      transport: as for `run_phase`.
      channel: names the ordering channels: one per stream, so that the streams can be in flight
        at the same time.

    Returns:
      `buffers`.
    """
    for step in range(max((len(s) for s in streams), default=0)):
        for i, stream in enumerate(streams):
            if step < len(stream):
                with collectives.ordering_channel((channel, i)):
                    out = run_phase(stream[step], [b[i] for b in buffers], transport)
                for b, value in zip(buffers, out):
                    b[i] = value
    return buffers


def run_phase(phase, xs, transport=None):
    """One phase over the buffers `xs`: plain ops where its groups sit in this CPU process, else a
    collective op per buffer.

    A phase whose groups hold one member per process carries wider float buffers in `transport`
    (cast there and back); sums within a process stay in the buffer's dtype.
    """
    if phase.kind not in _PRIMITIVES:
        raise ValueError(f"Unknown phase kind {phase.kind!r}.")
    primitive = _PRIMITIVES[phase.kind]
    if transport is not None and collectives.groups_between_processes(phase.groups):
        wide = [x.dtype.size > transport.size for x in xs]
        out = primitive(
            [tf.cast(x, transport) if w else x for x, w in zip(xs, wide)],
            phase.groups,
            in_graph=True,
        )
        return [tf.cast(y, x.dtype) if w else y for x, y, w in zip(xs, out, wide)]
    return primitive(list(xs), phase.groups, in_graph=True)


# --------------------------------------------------------------------------- the sum as
# TensorFlow's seam


class TorusAllReduce(tf.distribute.CrossDeviceOps):
    """The torus gradient sum as a `tf.distribute.CrossDeviceOps`: every sum a strategy makes.

    TensorFlow hands a strategy's sums to its cross-device ops: Keras's gradient sum in `fit`, a
    custom loop's `optimizer.apply_gradients`, `ReplicaContext.all_reduce` and
    `strategy.extended.batch_reduce_to`. With this class there, all of them run the torus schedule
    of `build_schedule` over the replica mesh, with no change to the program:

        strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=TorusAllReduce())

    `tpu_scale.create_strategy()` puts it in place on every CPU/GPU strategy it makes (several
    workers too) unless `gradient_reduction="native"`. On a TPU the TPU runtime sums (XLA's
    all-reduce, already in two phases on the torus), and no cross-device ops is involved.

    TensorFlow gives it every local replica's values together, in cross-replica context; each
    phase's groups that stay on this process's CPU devices are plain ops in the step's graph,
    every other group one collective op per device (`collectives.across_devices`). What the torus
    does not sum goes to `fallback`, as TensorFlow's strategy would have summed it: values that
    are not floating point, sparse or ragged (an embedding's `tf.IndexedSlices` is densified, as
    `all_reduce_sum` densifies it), reductions to other devices than the
    replicas' (`strategy.reduce` to the host), sums across processes outside `tf.function`, and
    every sum when the algorithm is `"native"`. Broadcasts and gathers go there too. Which
    algorithm summed, and anything handed to the fallback, is logged once (Python's `tpu_scale`
    logger, INFO). `ReduceOp.MEAN` is the sum divided by the number of replicas.

    Args:
      mesh: the `ReplicaMesh` to sum over; default: the strategy's (`tpu_scale.mesh_of`: the one
        `create_strategy` attached, else one row per worker).
      algorithm: `"auto"` (`resolve_algorithm`'s rule for the hardware `create_strategy` found,
        else for the mesh alone), `"native"` (every sum to `fallback`) or one of `ALGORITHMS`.
      pack_bytes: gradients of one dtype are fused into buffers of about this many bytes; `None` or
        0: one buffer per dtype. On one CPU host nothing is fused (no launch to amortize).
      gradient_dtype: `"bfloat16"` carries the phases between processes in bfloat16; None or
        `"float32"`: every phase in the values' own dtype.
      fallback: the `tf.distribute.CrossDeviceOps` for everything else; default
        `tf.distribute.ReductionToOneDevice()` (one process). With several workers, TensorFlow's
        own collective ops, which `create_strategy`'s strategy passes.

    Reference:
      Ying et al., "Image Classification at Supercomputer Scale", 2018 (arXiv:1811.06992),
      section 3.3.
    """

    def __init__(
        self,
        mesh=None,
        algorithm=DEFAULT_ALGORITHM,
        pack_bytes=DEFAULT_PACK_BYTES,
        gradient_dtype=None,
        fallback=None,
    ):
        super().__init__()
        if algorithm not in GRADIENT_ALGORITHMS:
            raise ValueError(f"algorithm={algorithm!r}; choose one of {GRADIENT_ALGORITHMS}.")
        if pack_bytes is not None and pack_bytes < 0:
            raise ValueError(f"pack_bytes must be positive, or None / 0 for one buffer per dtype; got {pack_bytes}.")
        if gradient_dtype not in GRADIENT_DTYPES:
            raise ValueError(f"gradient_dtype={gradient_dtype!r}; choose one of {GRADIENT_DTYPES} (bfloat16 halves the bytes between hosts).")
        self.mesh = mesh
        self.algorithm = algorithm
        self.pack_bytes = pack_bytes
        self.gradient_dtype = None if gradient_dtype == "float32" else gradient_dtype
        self.fallback = fallback if fallback is not None else tf.distribute.ReductionToOneDevice()
        # The strategy it sums for: set by the package's strategies, which also reduce outside
        # their scope (`strategy.reduce`); a plain strategy's sums arrive inside its scope.
        self.strategy = None
        self._said = set()  # what was logged, so each thing is said once

    def __repr__(self):
        mesh = "the strategy's mesh" if self.mesh is None else self.mesh
        return f"TorusAllReduce({mesh}, algorithm={self.algorithm!r})"

    # ------------------------------------------------------------------ TensorFlow's contract

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        return self.batch_reduce_implementation(
            reduce_op, [(per_replica_value, destinations)], options
        )[0]

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        pairs = list(value_destination_pairs)
        strategy = self.strategy if self.strategy is not None else tf.distribute.get_strategy()
        if not tf.distribute.has_strategy() and self.strategy is None:
            return self.fallback.batch_reduce(reduce_op, pairs, options)
        devices = [device_util.canonicalize(d) for d in strategy.extended.worker_devices]
        results = [None] * len(pairs)
        mine, reasons = [], {}
        for i, (value, destinations) in enumerate(pairs):
            reason = self._reason_not_to_sum(strategy, devices, value, destinations)
            if reason is None:
                mine.append(i)
            else:
                reasons.setdefault(reason, []).append(i)
        if mine:
            mesh = self.mesh if self.mesh is not None else context.mesh_of(strategy)
            algorithm = self._algorithm(strategy, mesh, [pairs[i][0] for i in mine])
            if algorithm == "native":
                reasons.setdefault("the algorithm is 'native'", []).extend(mine)
            else:
                summed = self._sum(strategy, devices, mesh, algorithm, [pairs[i][0] for i in mine])
                for i, values in zip(mine, summed):
                    if reduce_op == tf.distribute.ReduceOp.MEAN:
                        values = [v / strategy.num_replicas_in_sync for v in values]
                    results[i] = values_lib.Mirrored(tuple(values))
        for reason, indices in reasons.items():
            self._say(("fallback", reason), "tpu_scale: TorusAllReduce hands %d value(s) to %s: %s", len(indices), type(self.fallback).__name__, reason)
            handed = self.fallback.batch_reduce(reduce_op, [pairs[i] for i in indices], options)
            for i, value in zip(indices, handed):
                results[i] = value
        return results

    def broadcast_implementation(self, tensor, destinations):
        return self.fallback.broadcast_implementation(tensor, destinations)

    # TensorFlow's strategies call these private methods of their cross-device ops (listed in
    # tpu_scale.tf_seam): gathers, and the XLA-on-GPU path that sums without a merge call.
    @property
    def _num_between_graph_workers(self):
        return self.fallback._num_between_graph_workers

    def _gather_implementation(self, per_replica_value, destinations, axis, options):
        return self.fallback._gather_implementation(per_replica_value, destinations, axis, options)

    def _all_reduce(self, reduce_op, value, replica_id, options):
        self._say("xla", "tpu_scale: under XLA on GPUs TensorFlow sums without a merge call: %s sums there, not the torus", type(self.fallback).__name__)
        return self.fallback._all_reduce(reduce_op, value, replica_id, options)

    # ------------------------------------------------------------------ the torus

    def _reason_not_to_sum(self, strategy, devices, value, destinations):
        """Why the torus does not sum `value` (None when it does)."""
        if not isinstance(value, tf.distribute.DistributedValues):
            return "a value that is not per replica"
        parts = strategy.experimental_local_results(value)
        if len(parts) != len(devices):
            return "values on other devices than the replicas'"
        # An embedding's gradient (`tf.IndexedSlices`) is densified, as `all_reduce_sum` does.
        if all(isinstance(p, tf.IndexedSlices) for p in parts):
            if tf.get_static_value(parts[0].dense_shape) is None:
                return "tf.IndexedSlices without a static dense shape"
        elif not all(isinstance(p, tf.Tensor) for p in parts):
            return "composite values (sparse or ragged tensors)"
        elif not parts[0].shape.is_fully_defined():
            return "values without a static shape"
        if parts[0].dtype.name not in SUPPORTED_DTYPES:
            return f"{parts[0].dtype.name} values (the torus sums {', '.join(SUPPORTED_DTYPES)})"
        if destinations is not value and not _on_the_replicas(strategy, devices, destinations):
            return "reductions to other devices than the replicas' (e.g. strategy.reduce)"
        if tf.executing_eagerly() and len(devices) != strategy.num_replicas_in_sync:
            return "sums across processes outside tf.function"
        return None

    def _algorithm(self, strategy, mesh, values):
        if mesh.num_replicas != strategy.num_replicas_in_sync:
            raise ValueError(f"TorusAllReduce's mesh {mesh} holds {mesh.num_replicas} replicas but the strategy has {strategy.num_replicas_in_sync}. Pass the strategy's own mesh (ReplicaMesh.for_devices(n) or ReplicaMesh.for_workers(workers, local)), or none.")
        if self.algorithm != "auto":
            return self.algorithm
        rule = getattr(strategy, "auto_algorithm", None)
        if rule is None:
            return resolve_algorithm("auto", mesh)
        parts = [strategy.experimental_local_results(v)[0] for v in values]
        return rule(mesh, [(p.shape.num_elements() * p.dtype.size, p.dtype.name) for p in parts])

    def _sum(self, strategy, devices, mesh, algorithm, values):
        """Per value, the sum on every local device (`sum_across_devices`), logged once."""
        per_device = [list(p) for p in zip(*(strategy.experimental_local_results(v) for v in values))]
        for device, parts in zip(devices, per_device):
            with tf.device(device):
                parts[:] = [_densify(p) for p in parts]
        first = collectives.process_index(strategy) * len(devices)
        summed = sum_across_devices(per_device, devices, first, mesh, algorithm, self.pack_bytes, self.gradient_dtype)
        size = sum(t.shape.num_elements() * t.dtype.size for t in per_device[0])
        self._say(("sum", algorithm, mesh), "tpu_scale: gradient sum by TorusAllReduce: %s over mesh %dx%d (%d tensors, %.1f MB at its first use)", algorithm, mesh.shape[0], mesh.shape[1], len(values), size / 1e6)
        return [list(v) for v in zip(*summed)]

    def _say(self, key, message, *args):
        if key not in self._said:
            self._said.add(key)
            logger.info(message, *args)


def _on_the_replicas(strategy, devices, destinations):
    """Whether `destinations` (a device string, a variable or a tensor, a distributed value) are
    the replicas' own devices, one each, in order: an all-reduce. A tensor placed nowhere yet (a
    function's input) counts as on its replica's device."""
    if isinstance(destinations, tf.distribute.DistributedValues):
        found = [p.device for p in strategy.experimental_local_results(destinations)]
    else:
        found = [destinations if isinstance(destinations, str) else destinations.device]
    return len(found) == len(devices) and all(
        not d or device_util.canonicalize(d) == mine for d, mine in zip(found, devices)
    )


@tf.autograph.experimental.do_not_convert
def sum_across_devices(
    per_device, devices, first_replica, mesh, algorithm, pack_bytes=DEFAULT_PACK_BYTES, gradient_dtype=None
):
    """Sums tensors over all replicas of `mesh`, given every local replica's at once.

    The cross-replica form of `all_reduce_sum`, for a `tf.distribute.CrossDeviceOps`: the same
    schedule, buffers and phases, with each phase run over all local replicas at once
    (`collectives.across_devices`).

    Args:
      per_device: per local replica `l` (replica id `first_replica + l`), its list of dense
        tensors; every replica's list has the same shapes and dtypes.
      devices: the local replicas' devices.
      first_replica: the replica id of `devices[0]`.
      mesh: the `ReplicaMesh` over every replica.
      algorithm: one of `ALGORITHMS`.
      pack_bytes: as for `all_reduce_sum`.
      gradient_dtype: as for `all_reduce_sum`.

    Returns:
      Per local replica, the list of summed tensors, on its device.
    """
    algorithm = resolve_algorithm(algorithm, mesh)
    transport = None if gradient_dtype is None else tf.as_dtype(gradient_dtype)
    streams = build_schedule(mesh, 0, algorithm).streams
    count = len(devices)
    local = set(range(first_replica, first_replica + count))
    phases = [p for stream in streams for p in stream]
    if any(not _within(p.groups, local) for p in phases):
        _check_row_major(mesh)
    if collectives.local_groups_in_graph(devices) and all(_within(p.groups, local) for p in phases):
        pack_bytes = 1  # every tensor on its own: plain ops have no launch cost to amortize
    packs = _packs(list(enumerate(per_device[0])), pack_bytes)
    buffers, lengths = [], None
    for device, tensors in zip(devices, per_device):
        with tf.device(device):
            made = [_to_buffer([tensors[i] for i in pack], mesh, algorithm) for pack in packs]
        buffers.append([parts for parts, _ in made])
        lengths = [n for _, n in made]
    for step in range(max((len(s) for s in streams), default=0)):
        for i, stream in enumerate(streams):
            if step < len(stream):
                phase = stream[step]
                xs = [[parts[i] for parts in mine] for mine in buffers]
                with collectives.ordering_channel(("tpu_scale.torus.all_reduce", i)):
                    out = _phase_across_devices(phase, xs, devices, first_replica, local, transport)
                for mine, results in zip(buffers, out):
                    for parts, value in zip(mine, results):
                        parts[i] = value
    summed = []
    for device, tensors, mine in zip(devices, per_device, buffers):
        result = [None] * len(tensors)
        with tf.device(device):
            for pack, parts, n in zip(packs, mine, lengths):
                for i, value in zip(pack, _from_buffer([tensors[i] for i in pack], parts, n)):
                    result[i] = value
        summed.append(result)
    return summed


def _within(groups, local):
    """True when every group holding one of the `local` replica ids lies wholly in them."""
    for members in np.asarray(groups).tolist():
        inside = [m in local for m in members]
        if any(inside) and not all(inside):
            return False
    return True


def _phase_across_devices(phase, xs, devices, first_replica, local, transport):
    if phase.kind not in _PRIMITIVES:
        raise ValueError(f"Unknown phase kind {phase.kind!r}.")
    kind = "sum" if phase.kind == ALL_REDUCE else phase.kind
    groups = np.asarray(phase.groups)
    mine = next(g for g in groups.tolist() if first_replica in g)
    between = transport is not None and len(mine) > 1 and sum(m in local for m in mine) == 1
    if not between:
        return collectives.across_devices(kind, xs, groups, devices, first_replica)
    wide = [x.dtype.size > transport.size for x in xs[0]]
    cast = [[tf.cast(x, transport) if w else x for x, w in zip(row, wide)] for row in xs]
    out = collectives.across_devices(kind, cast, groups, devices, first_replica)
    return [[tf.cast(y, x.dtype) if w else y for x, y, w in zip(row, ys, wide)] for row, ys in zip(xs, out)]
