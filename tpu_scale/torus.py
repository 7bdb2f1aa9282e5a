"""The torus gradient sum's executor: runs a `torus_schedule.Schedule` with the group collectives.

`all_reduce_sum(grads)` sums gradients over all replicas in replica context (custom training loops; the
Keras hook in `tpu_scale.keras_hook` calls it from `model.fit`). It fuses the gradients into a few flat
buffers per dtype (`pack_bytes` each), pads every buffer so each stream's share splits evenly into shards,
runs the streams' phases (reduce-scatter as all-to-all plus a local sum: the CPU runtime has no
reduce-scatter kernel), and cuts the sums back into the gradients' shapes. One code path builds collective
ops on CPU/GPU (one and several hosts) and TPU ops on TPU.

Each gradient keeps its dtype: float32, bfloat16 and float16 travel as themselves. `tf.IndexedSlices`
(embedding gradients) are densified before packing: every replica then contributes a dense buffer of the
variable's shape, which is exact, and cheap whenever the embedding table is small next to the rest of the
model. Very large, sparsely touched tables are better left to TensorFlow's gather-based reduction
(`gradient_reduction="native"`).

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
    build_schedule,
    bytes_sent_between,
    pack_indices,
    padded_length,
    resolve_algorithm,
    ring_bytes_sent_between,
    stream_sizes,
)

SUPPORTED_DTYPES = ("float16", "bfloat16", "float32", "float64")


# Plain Python over static shapes: AutoGraph would only rewrite it again inside every user tf.function.
@tf.autograph.experimental.do_not_convert
def all_reduce_sum(grads, strategy=None, mesh=None, algorithm=DEFAULT_ALGORITHM, pack_bytes=DEFAULT_PACK_BYTES):
    """Sums gradients over all replicas with the 2-D torus schedule; call it in replica context.

    For custom training loops: inside `strategy.run(step)`, `grads = torus.all_reduce_sum(grads)` replaces
    `tf.distribute.get_replica_context().all_reduce("sum", grads)`. Every replica must call it with the same
    structure, shapes and dtypes.

    Args:
      grads: a tensor, `tf.IndexedSlices` or None, or a (nested) list of them. Shapes must be static.
      strategy: the strategy whose mesh to use; defaults to the current replica context's strategy.
      mesh: a `ReplicaMesh` to use instead of the strategy's.
      algorithm: `"ring"`, `"torus_2d"` or `"torus_2d_bidirectional"` (see `build_schedule`), or `"auto"`:
        bidirectional on TPU tori, `"torus_2d"` on CPU/GPU hosts (see `resolve_algorithm`).
      pack_bytes: gradients of one dtype are fused into flat buffers of about this many bytes (a larger
        tensor gets its own buffer); `None` or 0 fuses each dtype into one buffer.

    Returns:
      The same structure: each gradient summed over all replicas, in its own dtype and shape; IndexedSlices
      come back as dense tensors; None stays None.

    Reference:
      Ying et al., "Image Classification at Supercomputer Scale", 2018 (arXiv:1811.06992), section 3.3.
    """
    ambient = context.current_mesh()
    if ambient is None and tf.distribute.get_replica_context() is None:
        raise RuntimeError(
            "torus.all_reduce_sum runs in replica context: call it inside strategy.run(...) or a Keras "
            "train_step, not in cross-replica context."
        )
    if mesh is None:
        mesh = context.mesh_of(strategy) if strategy is not None else ambient
    algorithm = resolve_algorithm(algorithm, mesh)
    if pack_bytes is not None and pack_bytes < 0:
        raise ValueError(f"pack_bytes must be positive, or None / 0 for one buffer per dtype; got {pack_bytes}.")

    flat = tf.nest.flatten(grads)
    dense = [None if g is None else _densify(g) for g in flat]
    if mesh is None or mesh.num_replicas == 1:
        return tf.nest.pack_sequence_as(grads, dense)
    if ambient is not None and ambient.num_replicas != mesh.num_replicas:
        raise ValueError(
            f"The mesh {mesh} holds {mesh.num_replicas} replicas but {ambient.num_replicas} are in sync here; "
            f"pass the strategy's own mesh (tpu_scale.mesh_of(strategy))."
        )
    _check_rank_order(mesh)
    summed = list(dense)
    for pack in _packs([(i, g) for i, g in enumerate(dense) if g is not None], pack_bytes):
        for i, value in zip(pack, _sum_pack([dense[i] for i in pack], mesh, algorithm)):
            summed[i] = value
    return tf.nest.pack_sequence_as(grads, summed)


def _densify(g):
    if isinstance(g, tf.IndexedSlices):
        if tf.get_static_value(g.dense_shape) is None:
            raise ValueError(
                "An IndexedSlices gradient has no static dense_shape, so it cannot be densified for the torus "
                "sum. Give the embedding variable a static shape, or use gradient_reduction='native'."
            )
        g = tf.convert_to_tensor(g)  # unsorted segment sum into the variable's shape
    g = tf.convert_to_tensor(g)
    if not g.shape.is_fully_defined():
        raise ValueError(
            f"The torus sum needs static gradient shapes to lay out its buffers; got {g.shape}. Gradients of "
            f"variables always have one; for other tensors set the shape (tf.ensure_shape)."
        )
    if g.dtype.name not in SUPPORTED_DTYPES:
        raise ValueError(
            f"The torus sum supports {SUPPORTED_DTYPES} gradients; got {g.dtype.name}. Cast it, or use "
            f"gradient_reduction='native'."
        )
    return g


def _packs(items, pack_bytes):
    """Groups `(index, tensor)` pairs by dtype, in order, into lists of indices of about `pack_bytes` each."""
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

    After a reduce-scatter along a row, replica `(r, c)` holds the chunk of its rank in the row; the column
    all-reduce that follows only adds matching chunks if that rank is the same in every row. TPU ops rank by
    the order of each group (the mesh's columns); collective ops rank by device order, which is replica id
    order, so on CPU/GPU the mesh must number its replicas row-major (every `create_strategy` mesh does).
    """
    if context.backend() != "collective":
        return
    rows, cols = mesh.shape
    if not np.array_equal(mesh.grid, np.arange(rows * cols).reshape(rows, cols)):
        raise ValueError(
            f"The torus sum on CPU/GPU needs a mesh numbered row-major (replica r * cols + c at (r, c)), so that "
            f"collective ranks match mesh columns; got {mesh.grid.tolist()}. Use ReplicaMesh.from_shape."
        )


def _sum_pack(tensors, mesh, algorithm):
    """Fuses same-dtype tensors into one buffer, sums it over the mesh, and cuts it back."""
    dtype = tensors[0].dtype
    sizes = [t.shape.num_elements() for t in tensors]
    flat = tf.concat([tf.reshape(t, [-1]) for t in tensors], axis=0) if len(tensors) > 1 else \
        tf.reshape(tensors[0], [-1])
    summed = _run_schedule(flat, mesh, algorithm, dtype.size)
    return [tf.reshape(part, t.shape) for part, t in zip(tf.split(summed, sizes), tensors)]


def _run_schedule(flat, mesh, algorithm, itemsize):
    """Sums a flat buffer over the mesh by running every stream's phases, streams interleaved."""
    length = int(flat.shape[0])
    padded = padded_length(length, mesh, algorithm)
    if padded != length:
        flat = tf.pad(flat, [[0, padded - length]])
    schedule = build_schedule(mesh, padded * itemsize, algorithm)
    shares = [b // itemsize for b in stream_sizes(schedule)]
    values = tf.split(flat, shares) if len(shares) > 1 else [flat]
    for step in range(max(len(s) for s in schedule.streams)):
        for i, stream in enumerate(schedule.streams):
            if step < len(stream):
                # One ordering channel per stream: the two halves can be in flight at the same time.
                with collectives.ordering_channel(("tpu_scale.torus", i)):
                    values[i] = _run_phase(stream[step], values[i])
    out = tf.concat(values, axis=0) if len(values) > 1 else values[0]
    return out[:length] if padded != length else out


def _run_phase(phase, x):
    if phase.kind == REDUCE_SCATTER:
        return collectives.reduce_scatter(x, phase.groups)
    if phase.kind == ALL_REDUCE:
        return collectives.group_sum(x, phase.groups)
    if phase.kind == ALL_GATHER:
        return collectives.all_gather(x, phase.groups)
    raise ValueError(f"Unknown phase kind {phase.kind!r}.")
