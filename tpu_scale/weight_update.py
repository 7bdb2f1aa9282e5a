"""Weight-update sharding on one host: each replica updates 1/N of the weights and holds 1/N of the
optimizer state.

`create_strategy(..., weight_update_sharding=True)` registers the strategy here; `model.fit` then
runs Keras's `keras.optimizers.SGD` (plain, momentum or Nesterov) and the package's
`tpu_scale.optimizers.LARS` this way, with no change to the model or the optimizer:

1. every replica's local gradients are fused into one flat buffer (in the order of the optimizer's
   variables, padded to a multiple of N);
2. reduce-scatter: replica `i` sums the `i`-th 1/N of every replica's buffer, on its own device;
3. replica `i` applies the update to its 1/N of the fused weights, with its 1/N of the momentum
   (one `sharded_momentum` variable of `ceil(parameters / N)` floats per replica, instead of a
   momentum the size of the model on every replica). LARS's per-variable trust ratios take each
   variable's weight and gradient norms as the sum of the shards' parts (every replica adds the
   N small vectors of per-variable squared norms); its batch-norm and bias exclusions hold;
4. all-gather: every replica concatenates the N updated pieces and writes its copy of the weights.

All replicas share the host's memory, so steps 2 and 4 are plain ops in the step graph, as the
torus executor builds the phases inside a host (`collectives.in_graph_groups`). Clipping and
weight decay run as Keras runs them, before the sum, on each replica's full gradient and weights;
gradient accumulation (`gradient_accumulation_steps`) composes with it. The result equals Keras's
unsharded update up to float rounding (the sums are the same, in another order).

Checkpoints hold the full state in Keras's own layout (one momentum per variable, gathered from
the replicas), so a backup, `final.keras` and `keras.models.load_model` are the same as without
sharding, and a run resumes on any replica count, sharded or not.

Scope: one host (`MirroredStrategy` of `create_strategy`), `keras.optimizers.SGD` and
`tpu_scale.optimizers.LARS`, every trainable variable of one floating dtype with a gradient at each
step. Anything else is a clear error; Adam/AdamW, several hosts and TPUs are not sharded yet.

Reference:
  Ying et al., "Image Classification at Supercomputer Scale", 2018 (arXiv:1811.06992), section 3.2
  (distributed weight update: each core updates a shard of the weights, then an all-gather).
"""

import weakref

import keras
import numpy as np
import tensorflow as tf

_strategies = weakref.WeakSet()
_states = weakref.WeakKeyDictionary()  # optimizer -> Sharded, for the optimizers built sharded


class Sharded:
    """What a sharded optimizer holds besides Keras's own state.

    Args:
      strategy: the strategy it was built under.
      layout: the `Layout` of its variables.
      momentum: its `sharded_momentum` variable (one shard per replica), or None without momentum.
      lars: for LARS, `(decays, adapts)`: per variable, whether it gets weight decay and a trust
        ratio; None for SGD.
    """

    def __init__(self, strategy, layout, momentum, lars=None):
        self.strategy = strategy
        self.layout = layout
        self.momentum = momentum
        self.lars = lars


def enable(strategy):
    """Makes `model.fit` under `strategy` shard SGD's weight update (see the module docstring).

    Args:
      strategy: a one-host strategy made by `create_strategy` (all replicas in this process).

    Raises:
      ValueError: when some replicas live in other processes.
    """
    if len(strategy.extended.worker_devices) != strategy.num_replicas_in_sync:
        raise ValueError(
            "weight_update_sharding=True works on one host (every replica in this process); this "
            f"strategy has {strategy.num_replicas_in_sync} replicas, "
            f"{len(strategy.extended.worker_devices)} of them here. Use "
            "weight_update_sharding=False across hosts."
        )
    _strategies.add(strategy)


def momentum_shards(optimizer):
    """The `sharded_momentum` variable of a sharded SGD or LARS (one shard per replica), else
    None."""
    state = _states.get(optimizer)
    return state.momentum if state is not None else None


def is_sharded(strategy):
    """True when `strategy` shards the weight update."""
    return strategy is not None and strategy in _strategies


class Layout:
    """Where each variable sits in the fused buffer, and each replica's share of it.

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

    def segments(self):
        """Per shard, the index of the variable each element belongs to (padding: the count)."""
        owner = np.repeat(np.arange(len(self.sizes)), self.sizes)
        owner = np.concatenate([owner, np.full(self.padding, len(self.sizes))])
        return owner.reshape(self.num_shards, self.shard).astype(np.int32)

    def split(self, flat):
        """The per-variable pieces of a flat numpy buffer (at least `total` long)."""
        return [
            np.reshape(flat[a:b], shape)
            for a, b, shape in zip(self.offsets[:-1], self.offsets[1:], self.shapes)
        ]


# --------------------------------------------------------------------------- what the Keras hooks
# call (`keras_hook.shard_weight_updates` wraps SGD's `build` and the optimizer's update, save and
# load)


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
    layout = Layout(variables, strategy.num_replicas_in_sync)
    shards = None
    if momentum:
        shards = optimizer.add_variable(
            (layout.shard,), dtype=variables[0].dtype, name="sharded_momentum"
        )
    _states[optimizer] = Sharded(strategy, layout, shards)


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
    layout = Layout(variables, strategy.num_replicas_in_sync)
    shards = optimizer.add_variable(
        (layout.shard,), dtype=variables[0].dtype, name="sharded_momentum"
    )
    _states[optimizer] = Sharded(strategy, layout, shards, lars=(list(decays), list(adapts)))
    return True


def update(optimizer, grads, variables, indices, learning_rate):
    """The sharded update, when the replica context's strategy is sharded; else False.

    Args:
      optimizer: the optimizer.
      grads: the replica's local gradients.
      variables: their variables.
      indices: each variable's index among the optimizer's variables.
      learning_rate: the step's learning rate.

    Returns:
      True when the update was built here.
    """
    ctx = tf.distribute.get_replica_context()
    if ctx is None or not is_sharded(ctx.strategy):
        return False
    _sharded_update(optimizer, ctx, grads, variables, indices, learning_rate)
    return True


def full_state(optimizer):
    """The optimizer's variables as numpy arrays in Keras's unsharded SGD layout, or None when it
    is not sharded."""
    if optimizer not in _states:
        return None
    return _full_state(optimizer)


def _check_variables(variables):
    dtypes = {v.dtype for v in variables}
    if len(dtypes) != 1 or not keras.backend.is_float_dtype(next(iter(dtypes))):
        raise ValueError(
            "weight_update_sharding=True needs every trainable variable in one floating dtype "
            f"(Keras keeps float32 ones under mixed precision); got {sorted(dtypes)}."
        )


def _full_state(optimizer):
    """The optimizer's variables as numpy arrays, in Keras's unsharded SGD layout."""
    state = _states[optimizer]
    values = []
    for variable in optimizer.variables:
        if variable is state.momentum:
            values.extend(state.layout.split(_gathered(state.strategy, variable)))
        else:
            values.append(keras.ops.convert_to_numpy(variable))
    return values


def _gathered(strategy, variable):
    """Every replica's shard of `variable`, concatenated in replica order."""
    parts = strategy.experimental_local_results(variable.value)
    return np.concatenate([p.numpy() for p in parts])


def load_full_state(optimizer, store):
    """Loads Keras's unsharded SGD layout into a sharded optimizer; False if it is not sharded.

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
    layout, sharded = state.layout, state.momentum
    expected = len(optimizer.variables) - 1 + len(layout.sizes) if sharded is not None else None
    expected = expected or len(optimizer.variables)
    if len(store.keys()) != expected:
        raise ValueError(
            f"The saved optimizer state holds {len(store.keys())} variables; this sharded "
            f"{type(optimizer).__name__} expects {expected} (Keras's layout for its "
            f"{len(layout.sizes)} trainable variables). Load a checkpoint of the same model and "
            "optimizer."
        )
    index = 0
    for variable in optimizer.variables:
        if variable is sharded:
            pieces = [np.reshape(store[str(index + j)], [-1]) for j in range(len(layout.sizes))]
            index += len(layout.sizes)
            flat = np.concatenate(pieces + [np.zeros(layout.padding, pieces[0].dtype)])
            parts = state.strategy.experimental_local_results(variable.value)
            for i, part in enumerate(parts):
                part.assign(flat[i * layout.shard : (i + 1) * layout.shard])
        else:
            variable.assign(store[str(index)])
            index += 1
    return True


# --------------------------------------------------------------------------- the sharded step


def _sharded_update(optimizer, ctx, grads, variables, indices, learning_rate):
    """Steps 1-4 of the module docstring, called in replica context from the optimizer's update."""
    state = _states.get(optimizer)
    if state is None:
        raise ValueError(
            "weight_update_sharding=True supports keras.optimizers.SGD (plain, momentum or "
            "Nesterov) and tpu_scale.optimizers.LARS; got "
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
    flat = tf.concat([tf.reshape(tf.convert_to_tensor(g), [-1]) for g in grads], 0)
    flat = tf.pad(flat, [[0, layout.padding]])
    values = [v.value if isinstance(v, keras.Variable) else v for v in variables]
    ctx.merge_call(_update_in_graph, args=(optimizer, state, flat, values, learning_rate))


def _update_in_graph(strategy, optimizer, state, flat, variables, learning_rate):
    """Reduce-scatter, sharded SGD, all-gather: plain ops on each replica's device."""
    layout = state.layout
    size = layout.shard
    grads = strategy.experimental_local_results(flat)
    copies = [strategy.experimental_local_results(v) for v in variables]
    momentums = None
    if state.momentum is not None:
        momentums = strategy.experimental_local_results(state.momentum.value)
    devices = strategy.extended.worker_devices
    grads = [_grad_shard(grads, i, size, d) for i, d in enumerate(devices)]
    weights = [_on(d, lambda i=i: _shard_of(copies, i, layout)) for i, d in enumerate(devices)]
    if state.lars is not None:
        shards = _lars(optimizer, state, grads, weights, momentums, devices, learning_rate)
    else:
        shards = []
        for i, device in enumerate(devices):
            with tf.device(device):
                w, grad = weights[i], tf.cast(grads[i], weights[i].dtype)
                rate = tf.cast(learning_rate, w.dtype)
                if momentums is None:
                    w = w - rate * grad
                else:
                    decay = tf.cast(optimizer.momentum, w.dtype)
                    momentum = decay * momentums[i] - rate * grad
                    momentums[i].assign(momentum)
                    step = decay * momentum - rate * grad if optimizer.nesterov else momentum
                    w = w + step
                shards.append(w)
    # All-gather: each replica writes each variable from the pieces of the shards it spans (no
    # copy of the whole fused buffer per replica).
    bounds = zip(layout.offsets[:-1], layout.offsets[1:])
    pieces = [_pieces(shards, a, b, layout.shard) for a, b in bounds]
    for i, device in enumerate(devices):
        with tf.device(device):
            for copy, parts, shape in zip(copies, pieces, layout.shapes):
                value = parts[0] if len(parts) == 1 else tf.concat(parts, 0)
                copy[i].assign(tf.reshape(value, shape))


def _pieces(shards, a, b, size):
    """The slices of `shards` (each `size` long, in order) that cover fused positions [a, b)."""
    parts = []
    for j in range(a // size, (b - 1) // size + 1):
        start, end = max(a, j * size) - j * size, min(b, (j + 1) * size) - j * size
        parts.append(shards[j][start:end])
    return parts


def _on(device, fn):
    with tf.device(device):
        return fn()


def _grad_shard(grads, i, size, device):
    """Reduce-scatter: replica `i` sums the `i`-th piece of every replica's fused gradient."""
    with tf.device(device):
        return tf.add_n([g[i * size : (i + 1) * size] for g in grads])


def _lars(optimizer, state, grads, weights, momentums, devices, learning_rate):
    """LARS on each replica's shard; the per-variable norms are group sums of the shards' parts.

    Returns:
      The updated weight shards, one per replica.
    """
    layout = state.layout
    decays, adapts = state.lars
    count = len(layout.sizes)
    dtype = weights[0].dtype
    segments = layout.segments()  # per shard: the variable of each element (count = padding)
    partial = []
    for i, device in enumerate(devices):
        with tf.device(device):
            grad = tf.cast(grads[i], dtype)
            ids = tf.constant(segments[i])
            partial.append(
                tf.stack(
                    [
                        tf.math.unsorted_segment_sum(tf.square(weights[i]), ids, count + 1),
                        tf.math.unsorted_segment_sum(tf.square(grad), ids, count + 1),
                    ]
                )
            )
    shards = []
    wd_flags = np.array([bool(d) for d in decays] + [False])
    adapt_flags = np.array([bool(a) for a in adapts] + [False])
    for i, device in enumerate(devices):
        with tf.device(device):
            sums = tf.add_n(partial)  # every shard's part of each variable's squared norms
            w_norm, g_norm = tf.sqrt(sums[0]), tf.sqrt(sums[1])
            weight_decay = tf.where(wd_flags, tf.cast(optimizer.weight_decay, dtype), 0.0)
            usable = tf.logical_and(w_norm > 0.0, g_norm > 0.0)
            denominator = tf.where(usable, g_norm + weight_decay * w_norm, 1.0)
            trust = tf.where(
                tf.logical_and(adapt_flags, usable),
                tf.cast(optimizer.eta, dtype) * w_norm / denominator,
                1.0,
            )
            ids = tf.constant(segments[i])
            grad = tf.cast(grads[i], dtype)
            update = grad + tf.gather(weight_decay, ids) * weights[i]
            rate = tf.cast(learning_rate, dtype) * tf.gather(trust, ids)
            velocity = momentums[i] * tf.cast(optimizer.momentum, dtype) + update * rate
            momentums[i].assign(velocity)
            shards.append(weights[i] - velocity)
    return shards


def _shard_of(copies, i, layout):
    """Replica `i`'s 1/N of the fused weights, read from its own copies of the variables."""
    size = layout.shard
    start, end = i * size, min((i + 1) * size, layout.total)
    pieces = []
    for copy, a, b in zip(copies, layout.offsets[:-1], layout.offsets[1:]):
        if b <= start or a >= end:
            continue
        flat = tf.reshape(copy[i], [-1])
        pieces.append(flat[max(start, a) - a : min(end, b) - a])
    pieces.append(tf.zeros([(i + 1) * size - max(end, start)], copies[0][i].dtype))
    return tf.concat(pieces, 0)
