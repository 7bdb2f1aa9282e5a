"""Weight-update sharding: each of the N replicas updates 1/N of the weights and holds 1/N of the
optimizer state.

`tpu_scale.DistributedOptimizer(optimizer, weight_update_sharding=True)` runs the update this way,
with no change to the model or to the optimizer it wraps, for every Keras optimizer whose update rule is element-wise
(`ELEMENTWISE`: SGD, Adam, AdamW, Adamax, Nadam, RMSprop, Adagrad, Adadelta, Lion, Ftrl) and for
layer-wise ones that state their rule in two parts (`tpu_scale.optimizers.LARS`, see
`is_layerwise`). Any other optimizer is refused by name when it is built.

1. the optimizer's variables, flattened, are fused into buffers as the gradient sum fuses them
   (`pack_bytes`; on one CPU host `IN_GRAPH_PACK_BYTES`), and each buffer is cut where the
   strategy's gradient-sum schedule cuts it (`Layout`);
2. reduce-scatter: the schedule's phases with its all-reduce cut in two
   (`torus_schedule.sharded_streams`) leave each replica the sum of its 1/N of every buffer;
3. each replica runs the optimizer's own `update_step` on its shard: an inner optimizer of the same
   class and configuration, built by Keras on one variable of `Layout.shard` (about
   `parameters / N`) elements per replica, holds the state (so each replica holds 1/N of every
   slot). An element-wise rule on a flat shard is the rule on each of its pieces. A layer-wise rule
   takes each variable's weight and gradient norms as the sums of its pieces' parts, summed over
   the shards;
4. all-gather: the schedule's all-gather phases, in reverse, bring every replica the updated
   buffers, and each replica writes its copy of the variables from them.

`tpu_scale.torus.sharded_update` builds steps 2-4, with the torus sum's executor (`torus.run_streams`:
plain ops where a phase stays in one CPU process, collective ops elsewhere), so the strategy's
`algorithm`, `pack_bytes` and `gradient_dtype` apply as they do to the unsharded sum. The optimizer's own `build` runs as Keras wrote it: its slots are recorded
(`record_slot`) instead of made, which gives Keras's saved layout; its scalar state (the step
counter, Nadam's `u_product`, ...) is shared with the inner optimizer. Clipping, Keras's decoupled
weight decay (`weight_decay`, with its exclusions) and the moving average (`use_ema`) run as Keras
runs them, on each replica's full copy; gradient accumulation composes with it. Under mixed
precision the variables and the state are float32 (Keras's master weights). The result equals
Keras's unsharded update up to float rounding (the same arithmetic; the sums in another order).

Checkpoints hold the full state in Keras's own layout (one slot per variable, gathered from the
replicas), so a backup, `final.keras` and `keras.models.load_model` are the same as without
sharding, and a run resumes on any replica count, sharded or not; a load gives each replica its
shard. Across workers the gather is a collective: every worker saves at the same point, as
`MultiWorkerMirroredStrategy` asks of `model.save` (the chief to its path, the others to scratch,
as `checkpointing.BackupAndRestore`, `training.run_callbacks`' checkpoints and `training.save_run`
do). A save meets the other workers at a barrier of TensorFlow's coordination service first, so a
save on some workers only fails with an error naming this after `SAVE_WAIT_SECONDS` instead of
waiting forever. When an optimizer is built across workers, one all-gather per phase checks that
the collective ops order the workers as the layout assumes.

Scope: the strategies of `create_strategy` on CPUs or GPUs, every trainable variable of one
floating dtype with a gradient at each step. Anything else is a clear error; TPUs are not sharded
yet.

Reference:
  Ying et al., "Image Classification at Supercomputer Scale", 2018 (arXiv:1811.06992), section 3.2
  (distributed weight update: each core updates a shard of the weights, then an all-gather).
"""

import bisect
import collections
import itertools

import keras
import numpy as np
import tensorflow as tf

from tpu_scale.distribute import collectives, context
from tpu_scale.tf_seam import eager_context as tf_context
from tpu_scale.torus import schedule as torus_schedule
from tpu_scale.torus import sharded_update

# Keras's element-wise optimizers, by name (those this Keras has): their `update_step` on a flat
# shard is their `update_step` on each piece of it.
ELEMENTWISE = (
    "SGD", "Adam", "AdamW", "Adamax", "Nadam", "RMSprop", "Adagrad", "Adadelta", "Lion", "Ftrl"
)
# The slots Keras's base optimizer makes for every optimizer (the moving average, the gradient
# accumulators): full size, made by Keras, never sharded.
KERAS_BASE_SLOTS = ("average", "gradient_accumulator")


def check_strategy(strategy):
    """Raises a clear error when `strategy` cannot shard an update: a TPU, or several workers
    whose replicas are not one mesh row each (the shards then span every worker's replicas).

    Args:
      strategy: the strategy a `tpu_scale.DistributedOptimizer(..., weight_update_sharding=True)`
        is built under.
    """
    if context.is_tpu_strategy(strategy):
        raise ValueError("weight_update_sharding=True works on CPU and GPU hosts; not on a TPU yet. Use tpu_scale.DistributedOptimizer(optimizer) without it.")
    local = len(strategy.extended.worker_devices)
    mesh = context.mesh_of(strategy)
    if local != strategy.num_replicas_in_sync and mesh.shape[1] != local:
        raise ValueError(f"weight_update_sharding=True across workers needs one mesh row per worker (the default); this strategy's mesh is {mesh.shape} with {local} replicas per worker. Leave mesh_shape unset, or use weight_update_sharding=False.")


def is_layerwise(optimizer):
    """True for a layer-wise optimizer that states its rule in the two parts sharding needs:
    `layer_factors(index, weight_norm, grad_norm)` -> (rate factor, weight decay) of variable
    `index`, and the element-wise `scaled_update(gradient, variable, rate, weight_decay)`."""
    return callable(getattr(optimizer, "layer_factors", None)) and callable(
        getattr(optimizer, "scaled_update", None)
    )


def check_shardable(optimizer, variables):
    """Raises a clear error, naming the optimizer, when its update cannot be sharded exactly."""
    name = type(optimizer).__name__
    if not (is_layerwise(optimizer) or _elementwise_rule(optimizer)):
        raise ValueError(f"weight_update_sharding=True runs the optimizer's own update_step on each replica's 1/N of the weights, which is exact for element-wise rules ({', '.join(ELEMENTWISE)}) and for tpu_scale.optimizers.LARS; {name}'s rule is not known to be element-wise (e.g. Lamb, Adafactor and Muon take norms or factors of whole variables). Wrap it with weight_update_sharding=False (tpu_scale.DistributedOptimizer) for {name}.")
    dtypes = {v.dtype for v in variables}
    if len(dtypes) != 1 or not keras.backend.is_float_dtype(next(iter(dtypes))):
        raise ValueError(f"weight_update_sharding=True needs every trainable variable in one floating dtype (Keras keeps float32 ones under mixed precision); got {sorted(dtypes)}.")
    if any(getattr(v, "overwrite_with_gradient", False) for v in variables):
        raise ValueError("weight_update_sharding=True cannot shard variables with overwrite_with_gradient=True (their gradient is their new value). Wrap it with weight_update_sharding=False (tpu_scale.DistributedOptimizer).")


def _elementwise_rule(optimizer):
    """True when the `update_step` `optimizer` runs is one of `ELEMENTWISE`'s own."""
    rule = type(optimizer).update_step
    return any(
        getattr(getattr(keras.optimizers, name, None), "update_step", None) is rule
        for name in ELEMENTWISE
    )


# A variable starts, and a chunk is cut, on a multiple of 64 bytes wherever that pads a buffer by at
# most `ALIGN_PADDING` of its length: TensorFlow's slices and splits along axis 0 that start (and
# end) there share the buffer instead of copying it.
ALIGN_BYTES = 64
ALIGN_PADDING = 0.01
# On one CPU host every phase is plain ops in the step graph, so fusing only copies: variables up to
# this size share a buffer (one small copy each, instead of N-fold padding each), larger ones are
# buffers of their own.
IN_GRAPH_PACK_BYTES = 256 * 1024


class Buffer(collections.namedtuple("Buffer", "variables start length shares")):
    """One fused buffer of a `Layout`: its variables (indices), its start and padded length in the
    flat index space, and per stream the `(start, length)` of that stream's share."""


class Layout:
    """Which replica updates which elements: the gradient sum's buffers, cut where its phases cut.

    The variables, flattened, are fused into buffers as the torus sum fuses gradients
    (`torus_schedule.pack_indices` with `pack_bytes`): each variable at its offset in its buffer,
    each buffer padded so that every stream's share splits into N equal chunks, the buffers end to
    end in one flat index space of `total` elements. After a stream's scatter phases
    (`torus_schedule.sharded_streams`) replica `k` holds one chunk of its share
    (`torus_schedule.shard_position`); its shard is those chunks, buffer by buffer and stream by
    stream: `segments[k]`, `shard` elements on every replica.

    Args:
      shapes: the optimizer's trainable variables' shapes, in its order.
      itemsize: bytes per element.
      mesh: the strategy's `ReplicaMesh` (row-major).
      algorithm: one of `torus_schedule.ALGORITHMS`.
      pack_bytes: the fused buffers' size (`None` or 0: one buffer).
      rank: callable `(members, replica) -> rank` in the collective runtime's order, or None for
        each replica's position in its group.
    """

    def __init__(self, shapes, itemsize, mesh, algorithm, pack_bytes, rank=None):
        self.shapes = [tuple(int(d) for d in shape) for shape in shapes]
        self.sizes = [int(np.prod(shape, dtype=np.int64)) for shape in self.shapes]
        self.num_shards = n = mesh.num_replicas
        self.algorithm = algorithm
        self.streams = torus_schedule.sharded_streams(torus_schedule.build_schedule(mesh, 0, algorithm))
        count = len(self.streams)
        align = max(1, ALIGN_BYTES // itemsize)
        self.starts = [0] * len(self.sizes)
        self.buffers = []
        self.segments = [[] for _ in range(n)]
        self.total = 0
        packs = torus_schedule.pack_indices([size * itemsize for size in self.sizes], pack_bytes)
        for pack in packs:
            offsets, length = _packed([self.sizes[v] for v in pack], n * count, align)
            for var, offset in zip(pack, offsets):
                self.starts[var] = self.total + offset
            share = length // count
            shares = [(self.total + i * share, share) for i in range(count)]
            self.buffers.append(Buffer(list(pack), self.total, length, shares))
            for (scatter, _), (start, size) in zip(self.streams, shares):
                chunk = size // n
                for k in range(n):
                    position = torus_schedule.shard_position(scatter, k, rank)
                    self.segments[k].append((start + position * chunk, chunk))
            self.total += length
        self.shard = sum(size for _, size in self.segments[0])

    def pieces(self, k):
        """Replica `k`'s shard as `(variable, start, end, offset)`: elements `[start, end)` of the
        flattened variable sit at `offset` in the shard (the rest of the shard is padding)."""
        out, offset = [], 0
        for start, size in self.segments[k]:
            end = start + size
            first = max(bisect.bisect_right(self.starts, start) - 1, 0)
            for var in range(first, bisect.bisect_left(self.starts, end)):
                a = max(start, self.starts[var])
                b = min(end, self.starts[var] + self.sizes[var])
                if a < b:
                    out.append((var, a - self.starts[var], b - self.starts[var], offset + a - start))
            offset += size
        return out

    def split(self, flat):
        """The per-variable parts of a flat numpy array over the whole index space."""
        return [
            np.reshape(flat[a : a + size], shape)
            for a, size, shape in zip(self.starts, self.sizes, self.shapes)
        ]

    def shard_of(self, flat, k):
        """Replica `k`'s shard of a flat numpy array over the whole index space."""
        return np.concatenate([flat[a : a + size] for a, size in self.segments[k]])

    def flat(self, shards):
        """The flat index space from every replica's shard (`shards[k]`, numpy)."""
        out = np.zeros([self.total], shards[0].dtype)
        for k, shard in enumerate(shards):
            offset = 0
            for a, size in self.segments[k]:
                out[a : a + size] = shard[offset : offset + size]
                offset += size
        return out


def _packed(sizes, quantum, align):
    """Offsets of variables of `sizes` in one buffer, and its length padded to a multiple of
    `quantum`: aligned to `align` elements when that costs at most `ALIGN_PADDING` more."""

    def lay(step):
        offsets, end = [], 0
        for size in sizes:
            offsets.append(-(-end // step) * step)
            end = offsets[-1] + size
        unit = quantum * step
        return offsets, -(-end // unit) * unit

    tight, aligned = lay(1), lay(align)
    return aligned if aligned[1] <= tight[1] * (1 + ALIGN_PADDING) else tight


class Slot:
    """What a sharded optimizer's `build` gets instead of a slot variable: which variable's slot it
    stands for, and where it sits in Keras's saved layout."""

    def __init__(self, variable, name, position):
        self.variable = variable  # index among the trainable variables
        self.name = name
        self.position = position  # how many optimizer variables Keras had made before it

    def __repr__(self):
        return f"Slot({self.name!r} of variable {self.variable}, sharded)"


class Sharded:
    """What a sharded optimizer holds besides Keras's own state.

    Args:
      strategy: the strategy it was built under.
      layout: the `Layout` of its variables over all of the strategy's replicas.
      inner: the inner optimizer (the same class and configuration) that runs `update_step` on
        each replica's shard.
      weights: the inner optimizer's one variable: `layout.shard` elements per replica, each
        replica's own shard of the weights.
      slots: the inner optimizer's slot variables, in the order Keras made them.
      recorded: the `Slot`s the optimizer's own `build` recorded, in its order.
      layerwise: True for a layer-wise rule (`is_layerwise`), with `flags` per variable.

      rank: `(members, replica) -> rank`: the collective runtime's order in a group (the layout's).

    Attributes:
      workers: the workers the shards span (1 on one host).
      replicas: per local replica `l`, its replica id (`layout.segments` index).
    """

    def __init__(self, strategy, layout, inner, weights, slots, recorded, layerwise, rank):
        self.strategy = strategy
        self.layout = layout
        self.inner = inner
        self.weights = weights
        self.slots = list(slots)
        self.recorded = list(recorded)
        self.layerwise = layerwise
        self.dtype = weights.dtype
        self.rank = rank
        local = len(strategy.extended.worker_devices)
        self.workers = layout.num_shards // local
        first = collectives.process_index(strategy) * local if self.workers > 1 else 0
        self.replicas = [first + i for i in range(local)]
        # Per variable, its recorded slots in order; slot `j` of every variable is inner slot `j`.
        per_variable = {}
        for slot in self.recorded:
            per_variable.setdefault(slot.variable, []).append(slot)
        self.names = [s.name for s in per_variable.get(0, [])]
        if any([s.name for s in v] != self.names for v in per_variable.values()) or len(
            self.names
        ) != len(self.slots):
            raise ValueError(f"weight_update_sharding=True needs the same slots for every variable (an element-wise rule); {type(inner).__name__}'s build made {[s.name for s in self.recorded]}. Wrap it with weight_update_sharding=False (tpu_scale.DistributedOptimizer).")

    @property
    def across_workers(self):
        """True when the shards span several workers' replicas."""
        return self.workers > 1


def unwrapped(optimizer):
    """The optimizer that holds the state: the one a `DistributedOptimizer` (or Keras's
    `LossScaleOptimizer`) wraps, at any depth."""
    while getattr(optimizer, "inner_optimizer", None) is not None:
        optimizer = optimizer.inner_optimizer
    return optimizer


def _state(optimizer):
    return getattr(unwrapped(optimizer), "_tpu_scale_sharded", None)


def is_sharded(optimizer):
    """True when `optimizer` was built with its update sharded."""
    return _state(optimizer) is not None


def layout(optimizer):
    """A sharded optimizer's `Layout` (which replica updates which elements); None when it is not
    sharded."""
    state = _state(optimizer)
    return state.layout if state is not None else None


def slot_shards(optimizer):
    """A sharded optimizer's state variables (slot name -> one shard per replica); {} when it is
    not sharded."""
    state = _state(optimizer)
    return dict(zip(state.names, state.slots)) if state is not None else {}


def floats_per_replica(optimizer):
    """How many floats of optimizer state one replica holds: the optimizer's own variables, and
    for a sharded one its shard of every slot and the shard of the weights its update runs on."""
    optimizer = unwrapped(optimizer)
    own = sum(int(np.prod(v.shape)) for v in optimizer.variables)
    state = _state(optimizer)
    if state is None:
        return own
    return own + (len(state.slots) + 1) * state.layout.shard


# --------------------------------------------------------------------------- what the wrapper calls
# (`keras_hook.DistributedOptimizer`: build, add_variable_from_reference, the update, save and
# load)


def record_slot(optimizer, reference_variable, name):
    """During a sharded `build`, a `Slot` standing for the slot `name` of `reference_variable`;
    None otherwise (Keras then makes the variable)."""
    recording = getattr(optimizer, "_tpu_scale_recording", None)
    if recording is None or name in KERAS_BASE_SLOTS:
        return None
    index = recording["indices"].get(id(reference_variable))
    if index is None:
        raise ValueError(f"weight_update_sharding=True shards slots of the trainable variables; {type(optimizer).__name__}'s build asked for slot {name!r} of {getattr(reference_variable, 'path', reference_variable)}, which is not one. Wrap it with weight_update_sharding=False (tpu_scale.DistributedOptimizer).")
    slot = Slot(index, name, len(optimizer.variables) + len(recording["slots"]))
    recording["slots"].append(slot)
    return slot


def build(optimizer, variables, strategy, keras_build, inner):
    """Builds `optimizer` with its update sharded over `strategy`'s replicas.

    Args:
      optimizer: the optimizer being built (the one a `DistributedOptimizer` wraps).
      variables: its trainable variables.
      strategy: the strategy it is built under.
      keras_build: its own class's `build` (Keras's), run with its slots recorded.
      inner: a fresh optimizer of the same class and configuration.

    Raises:
      ValueError: for an optimizer or variables that cannot be sharded (named).
    """
    variables = list(variables)
    check_shardable(optimizer, variables)
    optimizer._tpu_scale_recording = {"indices": {id(v): i for i, v in enumerate(variables)}, "slots": []}
    try:
        keras_build(variables)
    finally:
        recorded = optimizer._tpu_scale_recording["slots"]
        optimizer._tpu_scale_recording = None
    dtype = variables[0].dtype
    algorithm, pack_bytes, rank = _plan(strategy, variables)
    layout = Layout(
        [v.shape for v in variables], tf.as_dtype(dtype).size, context.mesh_of(strategy),
        algorithm, pack_bytes, rank,
    )
    with tf.init_scope():
        weights = keras.Variable(
            np.zeros([layout.shard], dtype), dtype=dtype, trainable=False, name="sharded_weights"
        )
    # The inner optimizer runs `update_step` only: no moving average, no accumulation of its own;
    # it counts steps as the optimizer does.
    inner.use_ema = False
    steps = optimizer.gradient_accumulation_steps
    inner.gradient_accumulation_steps = None
    before = {id(v) for v in inner.variables}
    inner.build([weights])
    slots = [v for v in inner.variables if id(v) not in before and tuple(v.shape) == (layout.shard,)]
    inner.gradient_accumulation_steps = steps
    for name, value in list(vars(inner).items()):
        shared = getattr(optimizer, name, None)
        if isinstance(value, keras.Variable) and isinstance(shared, keras.Variable):
            if value is not shared and tuple(value.shape) == () == tuple(shared.shape):
                setattr(inner, name, shared)  # the step counter, Nadam's u_product, ...
    state = Sharded(strategy, layout, inner, weights, slots, recorded, is_layerwise(optimizer), rank)
    if state.across_workers:
        _check_ranks(state)
    optimizer._tpu_scale_sharded = state


def _plan(strategy, variables):
    """The algorithm, buffer size and rank order of the sharded step's phases: the strategy's own
    gradient sum's (`Settings.algorithm`, with "auto" the strategy's rule for these variables,
    and `pack_bytes`). "native", the strategy's own all-reduce, has no reduce-scatter: its sharded
    form is "flat"'s, one phase over every replica each way. On one CPU host every phase is plain
    ops, and buffers are `IN_GRAPH_PACK_BYTES`."""
    # A strategy create_strategy did not make sums with TensorFlow's own ops: "flat" here.
    settings = getattr(strategy, "settings", None)
    mesh = context.mesh_of(strategy)
    devices = strategy.extended.worker_devices
    local = len(devices)
    algorithm = settings.algorithm if settings is not None and settings.torus_sum else "flat"
    if algorithm == "auto":
        rule = getattr(strategy, "auto_algorithm", None)
        sizes = [(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size, tf.as_dtype(v.dtype).name) for v in variables]
        algorithm = rule(mesh, sizes) if rule is not None else "auto"
    algorithm = torus_schedule.resolve_algorithm("flat" if algorithm == "native" else algorithm, mesh)
    one_cpu_host = local == mesh.num_replicas and all("CPU" in d.upper() for d in devices)
    pack_bytes = (
        IN_GRAPH_PACK_BYTES
        if one_cpu_host
        else (settings.pack_bytes if settings is not None else torus_schedule.DEFAULT_PACK_BYTES)
    )
    ranks = collectives.process_ranks(strategy)

    def rank(members, replica):  # processes in the runtime's order, then each one's devices
        return sorted(members, key=lambda m: (ranks[m // local], m % local)).index(replica)

    return algorithm, pack_bytes, rank


def update(optimizer, ctx, grads_and_vars, indices, learning_rate, gradient_dtype=None):
    """The sharded update of one replica (steps 2-4 of the module docstring), in replica context.

    Args:
      optimizer: a sharded optimizer.
      ctx: the replica context.
      grads_and_vars: the replica's local gradients and their variables.
      indices: each variable's index among the optimizer's trainable variables.
      learning_rate: the step's learning rate.
      gradient_dtype: e.g. `"bfloat16"` (the strategy's): across workers, the gradient's
        reduce-scatter between the workers carries it, as the torus sum's phases between hosts do;
        the weights' all-gather stays in their dtype.
    """
    state = _state(optimizer)
    layout = state.layout
    grads = [g for g, _ in grads_and_vars]
    variables = [v for _, v in grads_and_vars]
    if list(indices) != list(range(len(layout.sizes))) or any(g is None for g in grads):
        raise ValueError("weight_update_sharding=True needs a gradient for every trainable variable at every step; some had none (Keras warned which). Freeze them (trainable=False) instead.")
    grads = [tf.reshape(tf.convert_to_tensor(g), [-1]) for g in grads]
    values = [v.value if isinstance(v, keras.Variable) else v for v in variables]
    layer = optimizer if state.layerwise else None
    sharded_update.update(ctx, state, grads, values, learning_rate, layer, gradient_dtype)


def full_state(optimizer):
    """The optimizer's variables as numpy arrays in Keras's unsharded layout, or None when it is
    not sharded. Across workers this is a collective: every worker must call it at the same point.
    """
    optimizer = unwrapped(optimizer)
    state = _state(optimizer)
    if state is None:
        return None
    gathered = [state.layout.split(state.layout.flat(shards)) for shards in _gathered_slots(state)]
    names = {name: j for j, name in enumerate(state.names)}
    own = iter(optimizer.variables)
    values = []
    for item in _keras_layout(optimizer, state):
        if isinstance(item, Slot):
            values.append(gathered[names[item.name]][item.variable])
        else:
            values.append(keras.ops.convert_to_numpy(next(own)))
    return values


def _keras_layout(optimizer, state):
    """Keras's saved order: the optimizer's own variables with its recorded slots placed where
    Keras would have made them."""
    count = len(optimizer.variables) + len(state.recorded)
    slots = {s.position: s for s in state.recorded}
    return [slots.get(i, "own") for i in range(count)]


def _gathered_slots(state):
    """Per inner slot, every replica's shard (numpy, by replica id). Across workers this is a
    collective: every worker must call it at the same point."""
    strategy, layout = state.strategy, state.layout
    slots = state.slots
    if not state.across_workers or not slots:  # one host: all shards are here
        return [[p.numpy() for p in strategy.experimental_local_results(v.value)] for v in slots]
    _wait_for_the_other_workers()
    columns = strategy.mesh.column_groups()

    def gather():  # local replica `l` gets the shards of mesh column `l`, in the runtime's order
        return [collectives.all_gather(tf.convert_to_tensor(v.value), columns) for v in slots]

    gathered = tf.function(lambda: strategy.run(gather))()
    local = len(state.replicas)
    out = []
    for value in gathered:
        parts = [p.numpy() for p in strategy.experimental_local_results(value)]
        shards = []
        for k in range(layout.num_shards):
            members = [int(m) for m in columns[k % local]]
            r = state.rank(members, k)
            shards.append(parts[k % local][r * layout.shard : (r + 1) * layout.shard])
        out.append(shards)
    return out


# Seconds a worker saving a sharded optimizer's state waits for the other workers to save too.
SAVE_WAIT_SECONDS = 120.0
_saves = itertools.count()


def _wait_for_the_other_workers():
    """Meets every other worker at this save (a barrier of TensorFlow's coordination service), or
    raises a clear error after `SAVE_WAIT_SECONDS` instead of waiting in a collective forever.

    The barriers are numbered by the saves of this process; after one that some workers missed,
    the numbers differ between the workers, so the run cannot save again (the error says so)."""
    barrier = f"tpu_scale_weight_update_save_{next(_saves)}"
    try:
        tf_context.context().wait_at_barrier(barrier, int(SAVE_WAIT_SECONDS * 1000))
    except tf.errors.DeadlineExceededError:
        problem = f"not all of them came within {SAVE_WAIT_SECONDS:.0f} s"
    except tf.errors.OpError as e:
        problem = (
            f"the workers' barrier failed: {str(e).strip().split('. ')[0] or type(e).__name__}"
        )
    else:
        return
    raise RuntimeError(f"Saving this optimizer gathers each worker's shard of its state (weight_update_sharding=True across workers), so every worker must save at the same point; {problem}. Save on every worker, the chief to its path and the others to a scratch path, as MultiWorkerMirroredStrategy asks of model.save, and restart the run (its later saves would fail too); or wrap the optimizer with weight_update_sharding=False.") from None


def _check_ranks(state):
    """Checks, once per sharded optimizer across workers, that the collective ops between the
    workers rank each group's members as the layout assumes (`Sharded.rank`); another order would
    update each shard with another shard's gradient. Every worker builds the optimizer, so every
    worker joins these all-gathers."""
    if not tf.executing_eagerly():
        return  # built inside a traced step: nothing can run here
    strategy, layout = state.strategy, state.layout
    phases = [p for scatter, _ in layout.streams for p in scatter]

    def ranks():
        me = tf.distribute.get_replica_context().replica_id_in_sync_group
        me = int(tf.get_static_value(me))
        out = []
        for phase in phases:
            members = [int(m) for m in phase.groups[np.any(phase.groups == me, axis=1)][0]]
            out.append(collectives.all_gather(tf.constant([state.rank(members, me)], tf.int32), phase.groups))
        return out

    for gathered in tf.function(lambda: strategy.run(ranks))():
        order = [int(r) for r in strategy.experimental_local_results(gathered)[0].numpy()]
        if order != list(range(len(order))):
            raise RuntimeError(f"The collective ops across the workers order them {order}, not by collectives.worker_rank (0, 1, ...): weight_update_sharding=True cannot place the shards. Please report this with your cluster's task names; meanwhile wrap the optimizer with weight_update_sharding=False.")


def saving_gathers(optimizer):
    """True when saving `optimizer` is a collective across workers (its state is sharded over
    several workers' replicas): every worker must then save at the same point."""
    state = _state(optimizer)
    return state is not None and bool(state.slots) and state.across_workers


def load_full_state(optimizer, store):
    """Loads Keras's unsharded layout into a sharded optimizer; False if it is not sharded.

    Args:
      optimizer: the optimizer `load_own_variables` was called on.
      store: Keras's variable store (`"0"`, `"1"`, ... -> arrays).

    Returns:
      True when the optimizer is sharded and the state was loaded.

    Raises:
      ValueError: when the store does not hold this optimizer's state.
    """
    state = _state(optimizer)
    if state is None:
        return False
    layout = state.layout
    items = _keras_layout(optimizer, state)
    if len(store.keys()) != len(items):
        raise ValueError(f"The saved optimizer state holds {len(store.keys())} variables; this sharded {type(optimizer).__name__} expects {len(items)} (Keras's layout for its {len(layout.sizes)} trainable variables). Load a checkpoint of the same model and optimizer.")
    own = iter(optimizer.variables)
    pieces = [[None] * len(layout.sizes) for _ in state.slots]
    names = {name: j for j, name in enumerate(state.names)}
    for index, item in enumerate(items):
        if isinstance(item, Slot):
            pieces[names[item.name]][item.variable] = np.reshape(store[str(index)], [-1])
        else:
            next(own).assign(store[str(index)])
    for slot, parts in zip(state.slots, pieces):
        flat = np.zeros([layout.total], parts[0].dtype)
        for start, part in zip(layout.starts, parts):
            flat[start : start + part.size] = part
        values = state.strategy.experimental_local_results(slot.value)
        for value, replica in zip(values, state.replicas):
            value.assign(layout.shard_of(flat, replica))
    return True
