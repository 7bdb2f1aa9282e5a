"""Weight-update sharding: each of the N replicas updates 1/N of the weights and holds 1/N of the
optimizer state.

`create_strategy(..., weight_update_sharding=True)` registers the strategy here; `model.fit` then
runs Keras's `keras.optimizers.SGD` (plain, momentum or Nesterov), `Adam` and `AdamW` (with or
without `amsgrad`) and the package's `tpu_scale.optimizers.LARS` this way, with no change to the
model or the optimizer:

1. the optimizer's variables, flattened and laid end to end in its order, are cut into N equal
   shards (the last padded), one per replica: pieces of the variables (a variable inside one shard
   is one whole piece, and only the at most N - 1 variables on a boundary are cut);
2. reduce-scatter: each replica sums every replica's gradient over its pieces;
3. each replica applies the update to its pieces with its shard of the optimizer state (one
   `sharded_momentum`, `sharded_velocity`, ... variable of `ceil(parameters / N)` floats per
   replica, instead of one slot the size of the model on every replica). LARS's per-variable
   trust ratios take each variable's weight and gradient norms as the sum of its pieces' parts;
   its batch-norm and bias exclusions hold;
4. all-gather: every replica writes its copy of each variable from the updated pieces that cover
   it.

On one host replica `i` owns shard `i`, and steps 2 and 4 are plain ops in the step graph, as the
torus executor builds the phases inside a host: all replicas share the host's memory, and no fused
buffer is built (concatenating, padding and slicing a model-sized buffer on every replica would
cost more memory traffic than the update saves). Across workers (`MultiWorkerMirroredStrategy`,
one mesh row per worker), steps 2 and 4 are the torus sum's phases: a reduce-scatter along the
worker's row (plain ops) and one down each mesh column (a collective op across the workers), then
the all-gather back the same way; replica `l` of the worker of rank `r` in the column's
collective ops owns shard `l * workers + r`. `tpu_scale.sharded_update` builds the step.

Clipping runs as Keras runs it, on each replica's full gradient. Weight decay is sharded too:
Keras's decoupled decay (SGD's and AdamW's `weight_decay`, with their exclusions) runs on each
replica's pieces just before the update rule, in place of Keras's pass over the full weights; LARS
folds its decay into its rule. Gradient accumulation (`gradient_accumulation_steps`) composes with
it. Under mixed precision the variables and the state are float32 (Keras's master weights). The
result equals Keras's unsharded update up to float rounding (the same arithmetic; the sums in
another order).

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

Scope: the strategies of `create_strategy` on CPUs or GPUs, the optimizers above, every trainable
variable of one floating dtype with a gradient at each step. Anything else is a clear error;
TPUs are not sharded yet.

Reference:
  Ying et al., "Image Classification at Supercomputer Scale", 2018 (arXiv:1811.06992), section 3.2
  (distributed weight update: each core updates a shard of the weights, then an all-gather).
"""

import itertools
import weakref

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context as tf_context

from tpu_scale import collectives, sharded_update

_strategies = weakref.WeakSet()
_states = weakref.WeakKeyDictionary()  # optimizer -> Sharded, for the optimizers built sharded


class Sharded:
    """What a sharded optimizer holds besides Keras's own state.

    Args:
      strategy: the strategy it was built under.
      layout: the `Layout` of its variables over all of the strategy's replicas.
      kind: `"sgd"`, `"lars"` or `"adam"`: the update rule.
      slots: its sharded state, in Keras's order: name (`"momentum"`, `"velocity"`,
        `"velocity_hat"`) -> a variable of `layout.shard` elements per replica.
      groups: the slot names Keras builds together, e.g. `[["momentum", "velocity"],
        ["velocity_hat"]]` for Adam with `amsgrad` (their saved layout interleaves them).
      lars: for LARS, `(decays, adapts)`: per variable, whether it gets weight decay and a trust
        ratio; None otherwise.
      dtype: the variables' dtype (and the state's).

    Attributes:
      workers: the workers the shards span (1 on one host).
      rank: this worker's rank in the collective ops down the mesh's columns
        (`collectives.worker_rank`); 0 on one host.
      owned: per local replica `l`, the index of the shard it owns: `l * workers + rank`.
    """

    def __init__(self, strategy, layout, kind, slots, groups, lars=None, dtype="float32"):
        self.strategy = strategy
        self.layout = layout
        self.kind = kind
        self.slots = dict(slots)
        self.groups = [list(g) for g in groups if g]
        self.lars = lars
        local = len(strategy.extended.worker_devices)
        self.workers = layout.num_shards // local
        self.rank = collectives.worker_rank(strategy) if self.workers > 1 else 0
        self.owned = [i * self.workers + self.rank for i in range(local)]
        self.dtype = dtype

    @property
    def across_workers(self):
        """True when the shards span several workers' replicas."""
        return self.workers > 1


def enable(strategy):
    """Makes `model.fit` under `strategy` shard the weight update (see the module docstring).

    Args:
      strategy: a strategy made by `create_strategy`: one host's replicas, or several workers'
        with one mesh row per worker (the shards then span every worker's replicas).

    Raises:
      ValueError: when the mesh's rows are not the workers' replicas.
    """
    local = len(strategy.extended.worker_devices)
    mesh = getattr(strategy, "mesh", None)
    if local != strategy.num_replicas_in_sync and (mesh is None or mesh.shape[1] != local):
        raise ValueError(
            "weight_update_sharding=True across workers needs one mesh row per worker (the "
            f"default); this strategy's mesh is {mesh.shape if mesh else None} with {local} "
            "replicas per worker. Leave mesh_shape unset, or use weight_update_sharding=False."
        )
    _strategies.add(strategy)


def disable(strategy):
    """Stops sharding the update of optimizers built from now on under `strategy` (those built
    sharded stay sharded)."""
    _strategies.discard(strategy)


def momentum_shards(optimizer):
    """The `sharded_momentum` variable of a sharded optimizer (one shard per replica), else
    None."""
    return slot_shards(optimizer).get("momentum")


def slot_shards(optimizer):
    """A sharded optimizer's state variables (name -> one shard per replica); {} when it is not
    sharded."""
    state = _states.get(optimizer)
    return dict(state.slots) if state is not None else {}


def is_sharded(strategy):
    """True when `strategy` shards the weight update."""
    return strategy is not None and strategy in _strategies


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


# --------------------------------------------------------------------------- what the Keras hooks
# call (`keras_hook.shard_weight_updates` wraps SGD's and Adam's `build` and the optimizer's
# update, save and load)


def _register(optimizer, strategy, variables, kind, groups, lars=None):
    """Builds the sharded state of `optimizer`: the layout over all of the strategy's replicas and
    one `sharded_<name>` variable of a shard per replica for each slot name in `groups`."""
    layout = Layout(variables, strategy.num_replicas_in_sync)
    slots = {
        name: optimizer.add_variable(
            (layout.shard,), dtype=variables[0].dtype, name=f"sharded_{name}"
        )
        for group in groups
        for name in group
    }
    state = Sharded(strategy, layout, kind, slots, groups, lars, variables[0].dtype)
    if state.across_workers:
        _check_column_ranks(state)
    _states[optimizer] = state


def build_sgd(optimizer, variables, sgd_build):
    """SGD's `build` under a sharded strategy: no full-size momentum, one shard per replica.

    Args:
      optimizer: a `keras.optimizers.SGD`.
      variables: its trainable variables.
      sgd_build: Keras's own `SGD.build`.
    """
    strategy = tf.distribute.get_strategy()
    if optimizer.built or not is_sharded(strategy):
        return sgd_build(optimizer, variables)
    _check_variables(variables)
    momentum = optimizer.momentum
    optimizer.momentum = 0.0  # SGD then makes no full-size momentum
    try:
        sgd_build(optimizer, variables)
    finally:
        optimizer.momentum = momentum
    _register(optimizer, strategy, variables, "sgd", [["momentum"] if momentum else []])


def build_adam(optimizer, variables, adam_build):
    """Adam's (and AdamW's) `build` under a sharded strategy: its momentums and velocities (and
    velocity hats with `amsgrad`) as one shard per replica instead of one per variable.

    Args:
      optimizer: a `keras.optimizers.Adam` or `AdamW`.
      variables: its trainable variables.
      adam_build: Keras's own `Adam.build`.

    Returns:
      True when the state was built sharded.
    """
    strategy = tf.distribute.get_strategy()
    if optimizer.built or not is_sharded(strategy):
        adam_build(optimizer, variables)
        return False
    _check_variables(variables)
    super(keras.optimizers.Adam, optimizer).build(variables)  # Keras's base state only
    hats = ["velocity_hat"] if optimizer.amsgrad else []
    _register(optimizer, strategy, variables, "adam", [["momentum", "velocity"], hats])
    return True


def build_lars(optimizer, variables, decays, adapts):
    """LARS's state under a sharded strategy: one momentum shard per replica, the per-variable
    rules; False (nothing built) when the current strategy is not sharded.

    Args:
      optimizer: a `tpu_scale.optimizers.LARS`, its base class already built.
      variables: its trainable variables.
      decays: per variable, whether it gets weight decay.
      adapts: per variable, whether it gets a trust ratio.
    """
    strategy = tf.distribute.get_strategy()
    if not is_sharded(strategy):
        return False
    _check_variables(variables)
    _register(optimizer, strategy, variables, "lars", [["momentum"]], (list(decays), list(adapts)))
    return True


def update(optimizer, grads, variables, indices, learning_rate, uses_decay, transport_dtype=None):
    """The sharded update, when the replica context's strategy is sharded; else False.

    Args:
      optimizer: the optimizer.
      grads: the replica's local gradients.
      variables: their variables.
      indices: each variable's index among the optimizer's variables.
      learning_rate: the step's learning rate.
      uses_decay: the optimizer's test of whether its weight decay applies to a variable (Keras's
        exclusions).
      transport_dtype: e.g. `"bfloat16"` (the strategy's `gradient_dtype`): across workers, the
        gradient's reduce-scatter between the workers carries it (cast there and back), as the
        torus sum's phases between hosts do; the weights' all-gather stays in their dtype.

    Returns:
      True when the update was built here.
    """
    ctx = tf.distribute.get_replica_context()
    if ctx is None or not is_sharded(ctx.strategy):
        return False
    _sharded_update(
        optimizer, ctx, grads, variables, indices, learning_rate, uses_decay, transport_dtype
    )
    return True


def decays_in_update(optimizer):
    """True when the sharded update applies `optimizer`'s decoupled weight decay (Keras's SGD's and
    AdamW's `weight_decay`) shard by shard, so that Keras's own pass over the full weights is
    skipped; called in replica context."""
    ctx = tf.distribute.get_replica_context()
    state = _states.get(optimizer)
    return (
        ctx is not None
        and is_sharded(ctx.strategy)
        and state is not None
        and state.kind != "lars"  # LARS decays inside its own rule
        and optimizer.weight_decay is not None
    )


def full_state(optimizer):
    """The optimizer's variables as numpy arrays in Keras's unsharded layout, or None when it is
    not sharded."""
    if optimizer not in _states:
        return None
    state = _states[optimizer]
    gathered = _gathered_slots(state)
    values = []
    for item in _keras_layout(optimizer, state):
        if isinstance(item, list):  # slots built together: Keras interleaves them per variable
            pieces = [state.layout.split(gathered[id(v)]) for v in item]
            values.extend(p for per_variable in zip(*pieces) for p in per_variable)
        else:
            values.append(keras.ops.convert_to_numpy(item))
    return values


def _keras_layout(optimizer, state):
    """The optimizer's variables in order, each group of sharded slots as one list where its
    first member stands (Keras's `add_optimizer_variables` interleaves a group's slots per
    variable: momentum, velocity, momentum, velocity, ...)."""
    groups = {id(state.slots[g[0]]): [state.slots[n] for n in g] for g in state.groups}
    members = {id(state.slots[n]) for g in state.groups for n in g}
    out = []
    for variable in optimizer.variables:
        if id(variable) in groups:
            out.append(groups[id(variable)])
        elif id(variable) not in members:
            out.append(variable)
    return out


def _check_variables(variables):
    dtypes = {v.dtype for v in variables}
    if len(dtypes) != 1 or not keras.backend.is_float_dtype(next(iter(dtypes))):
        raise ValueError(
            "weight_update_sharding=True needs every trainable variable in one floating dtype "
            f"(Keras keeps float32 ones under mixed precision); got {sorted(dtypes)}."
        )


def _gathered_slots(state):
    """Every sharded slot's value in full (all replicas' shards in shard order), by `id` of its
    variable. Across workers this is a collective: every worker must call it at the same point."""
    strategy = state.strategy
    slots = list(state.slots.values())
    if not state.across_workers or not slots:  # one host: all shards are here
        gathered = [v.value for v in slots]
    else:
        _wait_for_the_other_workers()
        columns = strategy.mesh.column_groups()

        def gather():  # replica `l`'s column gives shards `l * workers` to `(l + 1) * workers`
            return [collectives.all_gather(tf.convert_to_tensor(v.value), columns) for v in slots]

        gathered = tf.function(lambda: strategy.run(gather))()
    return {
        id(v): np.concatenate([p.numpy() for p in strategy.experimental_local_results(g)])
        for v, g in zip(slots, gathered)
    }


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
    raise RuntimeError(
        "Saving this optimizer gathers each worker's shard of its state "
        "(weight_update_sharding=True across workers), so every worker must save at the same "
        f"point; {problem}. Save on every worker, the chief to its path and the others to a "
        "scratch path, as MultiWorkerMirroredStrategy asks of model.save, and restart the run "
        "(its later saves would fail too); or create the strategy with "
        "weight_update_sharding=False."
    ) from None


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
        raise RuntimeError(
            f"The collective ops across the workers order them {order}, not by "
            "collectives.worker_rank (0, 1, ...): weight_update_sharding=True cannot place the "
            "shards. Please report this with your cluster's task names; meanwhile create the "
            "strategy with weight_update_sharding=False."
        )


def saving_gathers(optimizer):
    """True when saving `optimizer` is a collective across workers (its state is sharded over
    several workers' replicas): every worker must then save at the same point."""
    state = _states.get(optimizer)
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
    state = _states.get(optimizer)
    if state is None:
        return False
    layout = state.layout
    count = len(layout.sizes)
    expected = len(optimizer.variables) + len(state.slots) * (count - 1)
    if len(store.keys()) != expected:
        raise ValueError(
            f"The saved optimizer state holds {len(store.keys())} variables; this sharded "
            f"{type(optimizer).__name__} expects {expected} (Keras's layout for its "
            f"{count} trainable variables). Load a checkpoint of the same model and optimizer."
        )
    index = 0
    for item in _keras_layout(optimizer, state):
        if not isinstance(item, list):
            item.assign(store[str(index)])
            index += 1
            continue
        for k, variable in enumerate(item):
            pieces = [np.reshape(store[str(index + j * len(item) + k)], [-1]) for j in range(count)]
            flat = np.concatenate(pieces + [np.zeros(layout.padding, pieces[0].dtype)])
            parts = state.strategy.experimental_local_results(variable.value)
            for part, shard in zip(parts, state.owned):
                part.assign(flat[shard * layout.shard : (shard + 1) * layout.shard])
        index += count * len(item)
    return True


# --------------------------------------------------------------------------- the sharded step


def _sharded_update(
    optimizer, ctx, grads, variables, indices, learning_rate, uses_decay, transport_dtype
):
    """Steps 1-4 of the module docstring, called in replica context from the optimizer's update."""
    state = _states.get(optimizer)
    if state is None:
        raise ValueError(
            "weight_update_sharding=True supports keras.optimizers.SGD (plain, momentum or "
            "Nesterov), Adam, AdamW and tpu_scale.optimizers.LARS; got "
            f"{type(optimizer).__name__}. Create the strategy with "
            "weight_update_sharding=False for other optimizers, or create the optimizer under "
            "the strategy's scope."
        )
    layout = state.layout
    if list(indices) != list(range(len(layout.sizes))):
        raise ValueError(
            "weight_update_sharding=True needs a gradient for every trainable variable at every "
            "step; some had none (Keras warned which). Freeze them (trainable=False) instead."
        )
    grads = [tf.reshape(tf.convert_to_tensor(g), [-1]) for g in grads]
    decays = decays_in_update(optimizer)
    decayed = [decays and bool(uses_decay(v)) for v in variables]
    values = [v.value if isinstance(v, keras.Variable) else v for v in variables]
    sharded_update.update(
        ctx, optimizer, state, grads, values, learning_rate, decayed, transport_dtype
    )
