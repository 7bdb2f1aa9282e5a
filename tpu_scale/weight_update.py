"""Weight-update sharding: each of the N replicas updates 1/N of the weights and holds 1/N of the
optimizer state.

`create_strategy(..., weight_update_sharding=True)` makes `model.fit` run the update this way, with
no change to the model or the optimizer, for every Keras optimizer whose update rule is element-wise
(`ELEMENTWISE`: SGD, Adam, AdamW, Adamax, Nadam, RMSprop, Adagrad, Adadelta, Lion, Ftrl) and for
layer-wise ones that state their rule in two parts (`tpu_scale.optimizers.LARS`, see
`is_layerwise`). Any other optimizer is refused by name when it is built.

1. the optimizer's variables, flattened and laid end to end in its order, are cut into N equal
   shards (the last padded), one per replica: pieces of the variables (a variable inside one shard
   is one whole piece, and only the at most N - 1 variables on a boundary are cut);
2. reduce-scatter: each replica sums every replica's gradient over its shard;
3. each replica runs the optimizer's own `update_step` on its shard: an inner optimizer of the same
   class and configuration, built by Keras on one variable of `ceil(parameters / N)` elements per
   replica, holds the state (so each replica holds 1/N of every slot). An element-wise rule on a
   flat shard is the rule on each of its pieces. A layer-wise rule takes each variable's weight
   and gradient norms as the sums of its pieces' parts, summed over the shards;
4. all-gather: every replica writes its copy of each variable from the updated pieces that cover
   it.

`tpu_scale.sharded_update` builds steps 2-4 (on one host as plain ops, across workers as the torus
sum's phases). The optimizer's own `build` runs as Keras wrote it: its slots are recorded
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
waiting forever. When an optimizer is built across workers, one all-gather checks that the
collective ops order the workers as the shards assume.

Scope: the strategies of `create_strategy` on CPUs or GPUs, every trainable variable of one
floating dtype with a gradient at each step. Anything else is a clear error; TPUs are not sharded
yet.

Reference:
  Ying et al., "Image Classification at Supercomputer Scale", 2018 (arXiv:1811.06992), section 3.2
  (distributed weight update: each core updates a shard of the weights, then an all-gather).
"""

import itertools

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context as tf_context

from tpu_scale import collectives, sharded_update

# Keras's element-wise optimizers, by name (those this Keras has): their `update_step` on a flat
# shard is their `update_step` on each piece of it.
ELEMENTWISE = (
    "SGD", "Adam", "AdamW", "Adamax", "Nadam", "RMSprop", "Adagrad", "Adadelta", "Lion", "Ftrl"
)
# The slots Keras's base optimizer makes for every optimizer (the moving average, the gradient
# accumulators): full size, made by Keras, never sharded.
KERAS_BASE_SLOTS = ("average", "gradient_accumulator")


def enable(strategy):
    """Makes optimizers built from now on under `strategy` shard their update (see the module
    docstring); `create_strategy(weight_update_sharding=True)` calls it.

    Args:
      strategy: a strategy made by `create_strategy`: one host's replicas, or several workers'
        with one mesh row per worker (the shards then span every worker's replicas).

    Raises:
      ValueError: when the mesh's rows are not the workers' replicas.
    """
    local = len(strategy.extended.worker_devices)
    mesh = getattr(strategy, "mesh", None)
    if local != strategy.num_replicas_in_sync and (mesh is None or mesh.shape[1] != local):
        raise ValueError(f"weight_update_sharding=True across workers needs one mesh row per worker (the default); this strategy's mesh is {mesh.shape if mesh else None} with {local} replicas per worker. Leave mesh_shape unset, or use weight_update_sharding=False.")
    strategy.settings.weight_update_sharding = True


def disable(strategy):
    """Stops sharding the update of optimizers built from now on under `strategy` (those built
    sharded stay sharded)."""
    strategy.settings.weight_update_sharding = False


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
        raise ValueError(f"weight_update_sharding=True runs the optimizer's own update_step on each replica's 1/N of the weights, which is exact for element-wise rules ({', '.join(ELEMENTWISE)}) and for tpu_scale.optimizers.LARS; {name}'s rule is not known to be element-wise (e.g. Lamb, Adafactor and Muon take norms or factors of whole variables). Create the strategy with weight_update_sharding=False for {name}.")
    dtypes = {v.dtype for v in variables}
    if len(dtypes) != 1 or not keras.backend.is_float_dtype(next(iter(dtypes))):
        raise ValueError(f"weight_update_sharding=True needs every trainable variable in one floating dtype (Keras keeps float32 ones under mixed precision); got {sorted(dtypes)}.")
    if any(getattr(v, "overwrite_with_gradient", False) for v in variables):
        raise ValueError("weight_update_sharding=True cannot shard variables with overwrite_with_gradient=True (their gradient is their new value). Create the strategy with weight_update_sharding=False.")


def _elementwise_rule(optimizer):
    """True when the `update_step` `optimizer` runs is one of `ELEMENTWISE`'s own."""
    rule = type(optimizer).update_step
    return any(
        getattr(getattr(keras.optimizers, name, None), "update_step", None) is rule
        for name in ELEMENTWISE
    )


class Layout:
    """Where each variable sits in the fused order, and each replica's share of it.

    The variables, flattened and laid end to end in the optimizer's order, form `total` elements;
    shard `i` covers positions `[i * shard, (i + 1) * shard)` (the last shards are padded), and
    `Sharded.owned` says which local replica holds it.

    Args:
      variables: the optimizer's trainable variables, in its order.
      num_shards: the number of replicas.
    """

    def __init__(self, variables, num_shards):
        self.shapes = [tuple(v.shape) for v in variables]
        self.sizes = [int(np.prod(shape, dtype=np.int64)) for shape in self.shapes]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes, dtype=np.int64)]).tolist()
        self.total = int(self.offsets[-1])
        self.num_shards = num_shards
        self.shard = -(-self.total // num_shards)
        self.padding = self.shard * num_shards - self.total

    def pieces(self, i):
        """Shard `i` as `(variable, start, end, offset)`: elements `[start, end)` of the flattened
        variable sit at `offset` in the shard."""
        first, last = i * self.shard, min((i + 1) * self.shard, self.total)
        out = []
        for var, (a, b) in enumerate(zip(self.offsets[:-1], self.offsets[1:])):
            if b <= first or a >= last or a == b:
                continue
            start, end = max(first, a), min(last, b)
            out.append((var, start - a, end - a, start - first))
        return out

    def split(self, flat):
        """The per-variable pieces of a flat numpy buffer (at least `total` long)."""
        return [
            np.reshape(flat[a:b], shape)
            for a, b, shape in zip(self.offsets[:-1], self.offsets[1:], self.shapes)
        ]


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

    Attributes:
      workers: the workers the shards span (1 on one host).
      rank: this worker's rank in the collective ops down the mesh's columns
        (`collectives.worker_rank`); 0 on one host.
      owned: per local replica `l`, the index of the shard it owns: `l * workers + rank`.
    """

    def __init__(self, strategy, layout, inner, weights, slots, recorded, layerwise):
        self.strategy = strategy
        self.layout = layout
        self.inner = inner
        self.weights = weights
        self.slots = list(slots)
        self.recorded = list(recorded)
        self.layerwise = layerwise
        self.dtype = weights.dtype
        local = len(strategy.extended.worker_devices)
        self.workers = layout.num_shards // local
        self.rank = collectives.worker_rank(strategy) if self.workers > 1 else 0
        self.owned = [i * self.workers + self.rank for i in range(local)]
        # Per variable, its recorded slots in order; slot `j` of every variable is inner slot `j`.
        per_variable = {}
        for slot in self.recorded:
            per_variable.setdefault(slot.variable, []).append(slot)
        self.names = [s.name for s in per_variable.get(0, [])]
        if any([s.name for s in v] != self.names for v in per_variable.values()) or len(
            self.names
        ) != len(self.slots):
            raise ValueError(f"weight_update_sharding=True needs the same slots for every variable (an element-wise rule); {type(inner).__name__}'s build made {[s.name for s in self.recorded]}. Create the strategy with weight_update_sharding=False.")

    @property
    def across_workers(self):
        """True when the shards span several workers' replicas."""
        return self.workers > 1


def _state(optimizer):
    return getattr(optimizer, "_tpu_scale_sharded", None)


def is_sharded(optimizer):
    """True when `optimizer` was built with its update sharded."""
    return _state(optimizer) is not None


def slot_shards(optimizer):
    """A sharded optimizer's state variables (slot name -> one shard per replica); {} when it is
    not sharded."""
    state = _state(optimizer)
    return dict(zip(state.names, state.slots)) if state is not None else {}


def floats_per_replica(optimizer):
    """How many floats of optimizer state one replica holds: the optimizer's own variables, and
    for a sharded one its shard of every slot and the shard of the weights its update runs on."""
    own = sum(int(np.prod(v.shape)) for v in optimizer.variables)
    state = _state(optimizer)
    if state is None:
        return own
    return own + (len(state.slots) + 1) * state.layout.shard


# --------------------------------------------------------------------------- what the seam calls
# (`keras_hook.Seam`: build, add_variable_from_reference, the update, save and load)


def record_slot(optimizer, reference_variable, name):
    """During a sharded `build`, a `Slot` standing for the slot `name` of `reference_variable`;
    None otherwise (Keras then makes the variable)."""
    recording = getattr(optimizer, "_tpu_scale_recording", None)
    if recording is None or name in KERAS_BASE_SLOTS:
        return None
    index = recording["indices"].get(id(reference_variable))
    if index is None:
        raise ValueError(f"weight_update_sharding=True shards slots of the trainable variables; {type(optimizer).__name__}'s build asked for slot {name!r} of {getattr(reference_variable, 'path', reference_variable)}, which is not one. Create the strategy with weight_update_sharding=False.")
    slot = Slot(index, name, len(optimizer.variables) + len(recording["slots"]))
    recording["slots"].append(slot)
    return slot


def build(optimizer, variables, strategy, keras_build, inner):
    """Builds `optimizer` with its update sharded over `strategy`'s replicas.

    Args:
      optimizer: the optimizer being built (adopted by `keras_hook`).
      variables: its trainable variables.
      strategy: the strategy it is built under.
      keras_build: its own class's `build` (Keras's), run with its slots recorded.
      inner: a fresh optimizer of the same class and configuration, not adopted.

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
    layout = Layout(variables, strategy.num_replicas_in_sync)
    dtype = variables[0].dtype
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
    state = Sharded(strategy, layout, inner, weights, slots, recorded, is_layerwise(optimizer))
    if state.across_workers:
        _check_column_ranks(state)
    optimizer._tpu_scale_sharded = state


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
    state = _state(optimizer)
    if state is None:
        return None
    gathered = [state.layout.split(flat) for flat in _gathered_slots(state)]
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
    """Every inner slot's value in full (all replicas' shards in shard order), in the inner
    optimizer's order. Across workers this is a collective: every worker must call it at the same
    point."""
    strategy = state.strategy
    slots = state.slots
    if not state.across_workers or not slots:  # one host: all shards are here
        gathered = [v.value for v in slots]
    else:
        _wait_for_the_other_workers()
        columns = strategy.mesh.column_groups()

        def gather():  # replica `l`'s column gives shards `l * workers` to `(l + 1) * workers`
            return [collectives.all_gather(tf.convert_to_tensor(v.value), columns) for v in slots]

        gathered = tf.function(lambda: strategy.run(gather))()
    return [
        np.concatenate([p.numpy() for p in strategy.experimental_local_results(g)])
        for g in gathered
    ]


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
    raise RuntimeError(f"Saving this optimizer gathers each worker's shard of its state (weight_update_sharding=True across workers), so every worker must save at the same point; {problem}. Save on every worker, the chief to its path and the others to a scratch path, as MultiWorkerMirroredStrategy asks of model.save, and restart the run (its later saves would fail too); or create the strategy with weight_update_sharding=False.") from None


def _check_column_ranks(state):
    """Checks, once per sharded optimizer across workers, that the collective ops down the mesh's
    columns order the workers as `collectives.worker_rank` says; a different order would update
    each shard with another shard's gradient. Every worker builds the optimizer, so every worker
    joins this all-gather."""
    if not tf.executing_eagerly():
        return  # built inside a traced step: nothing can run here
    strategy, columns = state.strategy, state.strategy.mesh.column_groups()

    def ranks():
        return collectives.all_gather(tf.constant([state.rank], tf.int32), columns)

    gathered = strategy.experimental_local_results(tf.function(lambda: strategy.run(ranks))())
    order = [int(r) for r in gathered[0].numpy()]
    if order != list(range(len(order))):
        raise RuntimeError(f"The collective ops across the workers order them {order}, not by collectives.worker_rank (0, 1, ...): weight_update_sharding=True cannot place the shards. Please report this with your cluster's task names; meanwhile create the strategy with weight_update_sharding=False.")


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
        flat = np.concatenate(parts + [np.zeros(layout.padding, parts[0].dtype)])
        values = state.strategy.experimental_local_results(slot.value)
        for value, shard in zip(values, state.owned):
            value.assign(flat[shard * layout.shard : (shard + 1) * layout.shard])
    return True
