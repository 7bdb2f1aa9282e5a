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

`"auto"` is the planner's choice for the strategy's hardware (`tpu_scale.plan.choice`, attached by
`create_strategy`): on one CPU host `"flat"`, the in-graph sum on one device.

Each gradient keeps its dtype: float32, bfloat16 and float16 travel as themselves.
`tf.IndexedSlices` (embedding gradients) are densified before packing: every replica then
contributes a dense buffer of the variable's shape, which is exact, and cheap whenever the embedding
table is small next to the rest of the model. Very large, sparsely touched tables are better left to
TensorFlow's gather-based reduction (`gradient_reduction="native"`).

The schedule's names (`build_schedule`, `ALGORITHMS`, `Phase`, ...) are re-exported here, so
`tpu_scale.torus` is the one name a user needs.

Reference:
  Ying et al., "Image Classification at Supercomputer Scale", 2018 (arXiv:1811.06992), section 3.3.
"""

import numpy as np
import tensorflow as tf

from tpu_scale import collectives, context
from tpu_scale.torus_schedule import (  # noqa: F401  (re-exported: the public torus names)
    ALGORITHMS,
    ALL_GATHER,
    ALL_REDUCE,
    DEFAULT_ALGORITHM,
    DEFAULT_PACK_BYTES,
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
CHOICES = ALGORITHMS + ("native",)


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
        all-reduce) or `"auto"`: the planner's choice for the strategy's hardware and these
        gradients when the strategy carries one (`create_strategy` attaches it, see
        `tpu_scale.plan.choose_algorithm`), else the fixed rule of `resolve_algorithm`.
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
        planner = getattr(strategy, "gradient_planner", None)
        sizes = [
            (g.shape.num_elements() * g.dtype.size, g.dtype.name) for g in dense if g is not None
        ]
        algorithm = planner(mesh, sizes) if planner is not None else resolve_algorithm("auto", mesh)
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
    if context.backend() != "collective":
        return
    rows, cols = mesh.shape
    if not np.array_equal(mesh.grid, np.arange(rows * cols).reshape(rows, cols)):
        raise ValueError(f"The torus sum on CPU/GPU needs a mesh numbered row-major (replica r * cols + c at (r, c)), so that collective ranks match mesh columns; got {mesh.grid.tolist()}. Use ReplicaMesh.from_shape.")


def _sum_packs(packs, mesh, algorithm, transport):
    """Fuses each pack (same-dtype tensors) into a buffer, sums them all over the mesh, cuts them
    back.

    Every pack meets the phases in the same order, phase by phase: a phase's primitive gets the list
    of all packs' buffers, so on the in-graph path one merge call builds the phase for every buffer.
    """
    buffers, lengths = [], []
    for tensors in packs:
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
        shares = [
            b // itemsize for b in stream_sizes(build_schedule(mesh, padded * itemsize, algorithm))
        ]
        buffers.append(tf.split(flat, shares) if len(shares) > 1 else [flat])
        lengths.append((length, padded))
    run_streams(build_schedule(mesh, 0, algorithm).streams, buffers, transport)
    summed = []
    for tensors, parts, (length, padded) in zip(packs, buffers, lengths):
        flat = tf.concat(parts, axis=0) if len(parts) > 1 else parts[0]
        flat = flat[:length] if padded != length else flat
        if len(tensors) == 1:
            summed.append([tf.reshape(flat, tensors[0].shape)])
        else:
            pieces = tf.split(flat, [t.shape.num_elements() for t in tensors])
            summed.append([tf.reshape(p, t.shape) for p, t in zip(pieces, tensors)])
    return summed


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
