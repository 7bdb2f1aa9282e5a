"""The 2-D torus gradient summation: the schedule as plain data, its executor, and the `model.fit` hook.

A 1-D ring all-reduce over N replicas takes 2(N-1) sequential steps. On an R x C mesh the sum is done along
one dimension, then the other: reduce-scatter along rows, all-reduce the 1/C shard along columns, all-gather
along rows: about 2(C-1) + 2(R-1) steps for the same bytes per replica. The bidirectional form splits the
gradient in two halves that run in opposite dimension orders at the same time, so the links of both
dimensions are busy in both phases. On several hosts (rows = hosts) only a 1/C shard crosses the host
boundary: it is a hierarchical all-reduce.

The schedule (`build_schedule`) is data: phases with their groups and bytes. `tpu_scale.plan` prices the same
objects that the executor (`all_reduce_sum`) runs with the `tpu_scale.collectives` primitives, so one code path
builds collective ops on CPU/GPU (one and several hosts) and TPU ops on TPU.

The executor fuses the gradients into a few flat buffers per dtype (`pack_bytes` each), pads every buffer so
each stream's share splits evenly into shards, runs the streams' phases (reduce-scatter as all-to-all plus a
local sum: the CPU runtime has no reduce-scatter kernel), and cuts the sums back into the gradients' shapes.
Each gradient keeps its dtype: float32, bfloat16 and float16 travel as themselves. `tf.IndexedSlices`
(embedding gradients) are densified before packing: every replica then contributes a dense buffer of the
variable's shape, which is exact, and cheap whenever the embedding table is small next to the rest of the
model. Very large, sparsely touched tables are better left to TensorFlow's gather-based reduction
(`gradient_reduction="native"`).

`install()` makes Keras `model.fit` use `all_reduce_sum` for every strategy made by
`tpu_scale.create_strategy(gradient_reduction="torus")`; every other strategy keeps TensorFlow's reduction.

Reference:
  Ying et al., "Image Classification at Supercomputer Scale", 2018 (arXiv:1811.06992), section 3.3.
"""

import dataclasses
import threading

import numpy as np

ALGORITHMS = ("ring", "torus_2d", "torus_2d_bidirectional")

REDUCE_SCATTER = "reduce_scatter"
ALL_REDUCE = "all_reduce"
ALL_GATHER = "all_gather"


@dataclasses.dataclass(frozen=True)
class Phase:
    """One collective step of a schedule, run by every replica in its group.

    Attributes:
      kind: `"reduce_scatter"`, `"all_reduce"` or `"all_gather"`.
      dimension: `"rows"`, `"columns"` or `"all"` (the whole mesh as one ring).
      groups: int `[num_groups, group_size]` replica ids.
      bytes_in: bytes each replica holds when the phase starts (the shard for an all-gather).
    """

    kind: str
    dimension: str
    groups: np.ndarray
    bytes_in: int

    @property
    def group_size(self):
        return int(self.groups.shape[1])

    @property
    def bytes_out(self):
        if self.kind == REDUCE_SCATTER:
            return self.bytes_in // self.group_size
        if self.kind == ALL_GATHER:
            return self.bytes_in * self.group_size
        return self.bytes_in


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A gradient summation as concurrent streams of phases.

    Attributes:
      algorithm: one of `ALGORITHMS`.
      mesh: the `ReplicaMesh` it runs on.
      num_bytes: bytes of gradient each replica contributes (after padding).
      streams: tuple of phase tuples; the streams run at the same time, the phases of a stream in order.
    """

    algorithm: str
    mesh: object
    num_bytes: int
    streams: tuple


def _phases(mesh, order, num_bytes):
    """reduce-scatter along the first dimension, all-reduce the shard along the second, all-gather back."""
    groups = {"rows": mesh.row_groups(), "columns": mesh.column_groups()}
    first, second = order
    size = groups[first].shape[1]
    phases = [
        Phase(REDUCE_SCATTER, first, groups[first], num_bytes),
        Phase(ALL_REDUCE, second, groups[second], num_bytes // size),
        Phase(ALL_GATHER, first, groups[first], num_bytes // size),
    ]
    # A dimension of length 1 has nothing to do: a 1 x n or n x 1 mesh reduces to a single ring.
    return tuple(p for p in phases if p.group_size > 1)


def build_schedule(mesh, num_bytes, algorithm="torus_2d_bidirectional"):
    """The schedule that sums `num_bytes` of gradient per replica over `mesh`.

    Args:
      mesh: a `ReplicaMesh`.
      num_bytes: gradient bytes per replica; the executor pads buffers so each stream divides evenly.
      algorithm: `"ring"` (one all-reduce over every replica), `"torus_2d"` (rows then columns) or
        `"torus_2d_bidirectional"` (half rows-first, half columns-first, at the same time).

    Returns:
      A `Schedule`.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r}; choose one of {ALGORITHMS}.")
    if num_bytes < 0:
        raise ValueError(f"num_bytes must be >= 0, got {num_bytes}.")
    n = mesh.num_replicas
    if algorithm == "ring":
        everyone = np.arange(n).reshape(1, n)
        streams = ((Phase(REDUCE_SCATTER, "all", everyone, num_bytes),
                    Phase(ALL_GATHER, "all", everyone, num_bytes // n)),) if n > 1 else ((),)
    elif algorithm == "torus_2d":
        streams = (_phases(mesh, ("rows", "columns"), num_bytes),)
    else:
        half = num_bytes // 2
        streams = (_phases(mesh, ("rows", "columns"), half),
                   _phases(mesh, ("columns", "rows"), num_bytes - half))
    return Schedule(algorithm, mesh, int(num_bytes), tuple(streams))



def stream_sizes(schedule):
    """Bytes each stream of `schedule` sums (its first phase's input); they add up to `schedule.num_bytes`."""
    if not any(schedule.streams):
        return tuple(schedule.num_bytes if i == 0 else 0 for i in range(len(schedule.streams)))
    return tuple(stream[0].bytes_in if stream else 0 for stream in schedule.streams)


def bytes_sent_between(schedule, host_of):
    """Bytes a schedule sends from one host to another, summed over every replica.

    The count follows how the collective-op runtime moves data: a reduce-scatter (all-to-all) sends each
    other member of the group its `1/g` chunk directly; an all-reduce runs a ring over the group in replica
    order (reduce-scatter then all-gather around the ring: `2 (g - 1) / g` of the input on every ring edge);
    an all-gather also runs a ring (`(g - 1)` shards on every edge). Only messages whose sender and receiver
    sit on different hosts count.

    Args:
      schedule: a `Schedule`.
      host_of: callable, replica id -> host id.

    Returns:
      int bytes, over all hosts and both directions.
    """
    total = 0
    for stream in schedule.streams:
        for phase in stream:
            g = phase.group_size
            for members in phase.groups:
                hosts = [host_of(int(m)) for m in members]
                if phase.kind == REDUCE_SCATTER:
                    pairs = sum(a != b for a in hosts for b in hosts)
                    total += pairs * (phase.bytes_in // g)
                else:
                    ring_edges = sum(hosts[i] != hosts[(i + 1) % g] for i in range(g))
                    per_edge = 2 * (g - 1) * phase.bytes_in // g if phase.kind == ALL_REDUCE else \
                        (g - 1) * phase.bytes_in
                    total += ring_edges * per_edge
    return int(total)


def ring_bytes_sent_between(num_replicas, num_bytes, host_of):
    """Bytes a single ring all-reduce over replicas `0..n-1` sends between hosts (TensorFlow's default).

    Each of the `n` ring edges carries `2 (n - 1) / n` of the buffer (reduce-scatter then all-gather).
    """
    n = num_replicas
    edges = sum(host_of(i) != host_of((i + 1) % n) for i in range(n))
    return int(edges * 2 * (n - 1) * num_bytes // n) if n > 1 else 0


# --------------------------------------------------------------------------- executor
# TensorFlow is imported inside the functions below: the schedule and its byte counts above stay importable
# (and cheap) without it, for the planner.

DEFAULT_ALGORITHM = "auto"
DEFAULT_PACK_BYTES = 32 * 1024 * 1024
SUPPORTED_DTYPES = ("float16", "bfloat16", "float32", "float64")


def resolve_algorithm(algorithm, strategy=None, mesh=None):
    """The concrete algorithm for `"auto"`: bidirectional on a physical torus (TPU), `"torus_2d"` elsewhere.

    The bidirectional refinement exists to keep the links of both torus dimensions busy in both phases, so it
    is on wherever the mesh is a physical torus (`mesh.is_torus`, every TPU slice). CPU/GPU meshes are hosts x
    local devices with no such links: there rows-first (`"torus_2d"`) is the hierarchical all-reduce (only a
    `1/cols` shard leaves a host, where the columns-first half would send a whole half across the network),
    and on one host it is the faster form too (ResNet-50 on 8 CPU replicas: bidirectional ~1.3x slower, twice
    the collectives of half the size; see benchmarks/README.md).

    Args:
      algorithm: `"auto"` or one of `ALGORITHMS`.
      strategy: unused, kept so callers can pass what they have.
      mesh: the `ReplicaMesh` the sum runs on.

    Returns:
      One of `ALGORITHMS`.
    """
    del strategy
    if algorithm != "auto":
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm={algorithm!r}; choose 'auto' or one of {ALGORITHMS}.")
        return algorithm
    if mesh is not None and mesh.is_torus:
        return "torus_2d_bidirectional"
    return "torus_2d"


def _not_converted(fn):
    """Marks `fn` as `tf.autograph.experimental.do_not_convert` does, without importing TensorFlow here.

    The executor is plain Python over static shapes; AutoGraph would only rewrite it (again) inside every
    user `tf.function` that calls it.
    """
    fn.autograph_info__ = frozenset()
    return fn


@_not_converted
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
    import tensorflow as tf

    from tpu_scale import collectives

    ambient = collectives.current_mesh()
    if ambient is None and tf.distribute.get_replica_context() is None:
        raise RuntimeError(
            "torus.all_reduce_sum runs in replica context: call it inside strategy.run(...) or a Keras "
            "train_step, not in cross-replica context."
        )
    if mesh is None:
        if strategy is not None:
            from tpu_scale.strategy import mesh_of

            mesh = mesh_of(strategy)
        else:
            mesh = ambient
    if strategy is None:
        ctx = tf.distribute.get_replica_context()
        in_sync = ctx is not None and ctx.num_replicas_in_sync > 1  # not so under collectives.tpu_graph
        strategy = ctx.strategy if in_sync else None
    algorithm = resolve_algorithm(algorithm, strategy, mesh)
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
    import tensorflow as tf

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


def pack_indices(tensor_bytes, pack_bytes=DEFAULT_PACK_BYTES):
    """Splits same-dtype tensors of these byte sizes, in order, into fused buffers: lists of positions.

    A new buffer starts when the next tensor would take the current one past `pack_bytes` (a larger tensor
    gets a buffer of its own); `None` or 0 puts everything in one buffer. The executor packs with this rule and
    `tpu_scale.plan` prices the buffers it gives.
    """
    packs, current, size = [], [], 0
    for position, nbytes in enumerate(tensor_bytes):
        if current and pack_bytes and size + nbytes > pack_bytes:
            packs.append(current)
            current, size = [], 0
        current.append(position)
        size += nbytes
    packs.append(current)
    return packs


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
    from tpu_scale import collectives

    if collectives._backend() != "collective":
        return
    rows, cols = mesh.shape
    if not np.array_equal(mesh.grid, np.arange(rows * cols).reshape(rows, cols)):
        raise ValueError(
            f"The torus sum on CPU/GPU needs a mesh numbered row-major (replica r * cols + c at (r, c)), so that "
            f"collective ranks match mesh columns; got {mesh.grid.tolist()}. Use ReplicaMesh.from_shape."
        )


def _sum_pack(tensors, mesh, algorithm):
    """Fuses same-dtype tensors into one buffer, sums it over the mesh, and cuts it back."""
    import tensorflow as tf

    dtype = tensors[0].dtype
    sizes = [t.shape.num_elements() for t in tensors]
    flat = tf.concat([tf.reshape(t, [-1]) for t in tensors], axis=0) if len(tensors) > 1 else \
        tf.reshape(tensors[0], [-1])
    summed = _run_schedule(flat, mesh, algorithm, dtype.size)
    return [tf.reshape(part, t.shape) for part, t in zip(tf.split(summed, sizes), tensors)]


def _run_schedule(flat, mesh, algorithm, itemsize):
    """Sums a flat buffer over the mesh by running every stream's phases, streams interleaved."""
    import tensorflow as tf

    from tpu_scale import collectives

    length = int(flat.shape[0])
    num_streams = len(build_schedule(mesh, 0, algorithm).streams)
    # Every stream's share must split into shards for every group it meets: a multiple of all replicas does.
    quantum = mesh.num_replicas * num_streams
    padded = -(-length // quantum) * quantum
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
    from tpu_scale import collectives

    if phase.kind == REDUCE_SCATTER:
        return collectives.reduce_scatter(x, phase.groups)
    if phase.kind == ALL_REDUCE:
        return collectives.group_sum(x, phase.groups)
    if phase.kind == ALL_GATHER:
        return collectives.all_gather(x, phase.groups)
    raise ValueError(f"Unknown phase kind {phase.kind!r}.")


# --------------------------------------------------------------------------- Keras hook

_install_lock = threading.Lock()


def _keras_optimizer_class():
    from keras.src.backend.tensorflow import optimizer as tf_optimizer

    return tf_optimizer


def _torus_all_reduce_sum_gradients(self, grads_and_vars):
    """Keras's gradient sum, done by `all_reduce_sum` when the strategy asks for the torus."""
    import tensorflow as tf

    ctx = tf.distribute.get_replica_context()
    strategy = ctx.strategy if ctx is not None else None
    if getattr(strategy, "gradient_reduction", None) != "torus":
        return _torus_all_reduce_sum_gradients.original(self, grads_and_vars)
    grads_and_vars = list(grads_and_vars)
    # Keras's own filter: warns about missing gradients, raises when there are none.
    _keras_optimizer_class().filter_empty_gradients(grads_and_vars)
    summed = all_reduce_sum(
        [g for g, _ in grads_and_vars],
        strategy=strategy,
        algorithm=getattr(strategy, "torus_algorithm", DEFAULT_ALGORITHM),
        pack_bytes=getattr(strategy, "torus_pack_bytes", DEFAULT_PACK_BYTES),
    )
    return [(g, v) for g, (_, v) in zip(summed, grads_and_vars)]


def install():
    """Makes Keras `model.fit` sum gradients with `all_reduce_sum` under strategies that ask for it.

    Replaces `_all_reduce_sum_gradients` of Keras's TensorFlow optimizer base class, the one place where every
    Keras optimizer sums its gradients, in replica context, under every `tf.distribute` strategy (TPU
    included). The replacement uses the torus only when the replica context's strategy has
    `gradient_reduction == "torus"` (strategies from `tpu_scale.create_strategy`); any other strategy, and
    `gradient_reduction="native"`, run Keras's original code. A strategy may also carry `torus_algorithm`
    and `torus_pack_bytes` to override the defaults.

    Idempotent: `create_strategy` calls it; calling it again changes nothing. `uninstall()` restores Keras.
    """
    module = _keras_optimizer_class()
    with _install_lock:
        current = module.TFOptimizer._all_reduce_sum_gradients
        if current is _torus_all_reduce_sum_gradients:
            return
        _torus_all_reduce_sum_gradients.original = current
        module.TFOptimizer._all_reduce_sum_gradients = _torus_all_reduce_sum_gradients


def uninstall():
    """Restores Keras's own gradient sum (undoes `install()`)."""
    module = _keras_optimizer_class()
    with _install_lock:
        if module.TFOptimizer._all_reduce_sum_gradients is _torus_all_reduce_sum_gradients:
            module.TFOptimizer._all_reduce_sum_gradients = _torus_all_reduce_sum_gradients.original


def is_installed():
    """True when Keras optimizers route their gradient sum through `install()`'s hook."""
    return _keras_optimizer_class().TFOptimizer._all_reduce_sum_gradients is _torus_all_reduce_sum_gradients
