"""The sharded weight update's step: each replica sums, updates and hands out its shard.

`tpu_scale.weight_update` holds the layout, the sharded state and what the Keras hooks call; this
module builds the step itself, in replica context, from the optimizer's update:

* one host: every replica lives in this process. One merge call builds the reduce-scatter, the
  update and the all-gather from plain ops on the replicas' devices: no collective op and no fused
  buffer (a whole variable's gradient is summed straight from the replicas' gradients, and its
  updated value is written to every copy as it is).
* across workers: several workers, one mesh row each. Replica `l` of the worker of rank `r` owns
  shard `l * workers + r`. Its gradient shard is the torus sum's first two phases: a reduce-scatter
  along its worker's row (plain ops, in a merge call) and one down its mesh column (a collective op
  across the workers, in the strategy's `gradient_dtype` when that is narrower). The replica
  updates its pieces (LARS's norms summed along the row and down the column alike), and the
  updated shards come back by the same two phases in reverse: an all-gather down the column (a
  collective op, in the weights' own dtype), then, in a merge call, every local copy written from
  the worker's gathered chunks.

The update rules are Keras's own arithmetic (`keras.optimizers.SGD`, `Adam`) and
`tpu_scale.optimizers.LARS`'s, applied piece by piece; under mixed precision they run on the
float32 master weights.
"""

import contextlib

import tensorflow as tf
from tensorflow.python.distribute import values as values_lib

from tpu_scale import collectives, context


def update(ctx, optimizer, state, grads, values, learning_rate, decayed, transport_dtype=None):
    """The sharded update of one replica, on one host or across workers (the module docstring).

    Args:
      ctx: the replica context.
      optimizer: the optimizer.
      state: its `weight_update.Sharded` state.
      grads: this replica's flattened local gradients, one per variable.
      values: the variables (their replica-local values).
      learning_rate: the step's learning rate.
      decayed: per variable, whether Keras's decoupled weight decay applies to it here.
      transport_dtype: across workers, a narrower float dtype (e.g. `"bfloat16"`) for the
        gradient's phase between the workers, or None.
    """
    if not state.across_workers:
        ctx.merge_call(
            _update_in_graph, args=(optimizer, state, grads, values, learning_rate, decayed)
        )
        return
    _across_workers(ctx, optimizer, state, grads, values, learning_rate, decayed, transport_dtype)


def _across_workers(ctx, optimizer, state, grads, values, learning_rate, decayed, transport_dtype):
    """`update` across workers, one mesh row per worker."""
    strategy, layout, workers = ctx.strategy, state.layout, state.workers
    index = int(tf.get_static_value(ctx.replica_id_in_sync_group)) % len(state.owned)
    columns = strategy.mesh.column_groups()
    flat = tf.concat(grads + [tf.zeros([layout.padding], grads[0].dtype)], 0)
    # This replica's chunk of its row's sum.
    chunk = ctx.merge_call(_row_sums, args=(flat, len(state.owned)))
    wide = chunk.dtype
    if transport_dtype is not None and tf.as_dtype(transport_dtype).size < wide.size:
        chunk = tf.cast(chunk, transport_dtype)  # the phase between the workers only
    grad = _down_column(chunk, columns, state.rank, workers, "reduce_scatter")
    grad = tf.reshape(tf.cast(grad, wide), [layout.shard])  # collectives leave the length unknown
    pieces = []
    with tf.name_scope(f"update_{index}"):
        slots = {name: tf.convert_to_tensor(v.value) for name, v in state.slots.items()}
        for var, a, b, offset in layout.pieces(state.owned[index]):
            weight = tf.reshape(tf.convert_to_tensor(values[var]), [-1])[a:b]
            pieces.append(
                _Piece(
                    var,
                    weight,
                    tf.cast(grad[offset : offset + b - a], weight.dtype),
                    {name: s[offset : offset + b - a] for name, s in slots.items()},
                )
            )
        if state.kind == "lars":
            norms = _squared_norms(state, pieces)
            norms = collectives.group_sum(norms, strategy.mesh.row_groups(), latency_bound=True)
            norms = collectives.group_sum(norms, columns)
            _set_lars_scales(optimizer, state, pieces, norms, learning_rate)
        _apply(optimizer, state, pieces, learning_rate, decayed)
        new_slots = {name: _shard_of(layout, pieces, name, s.dtype) for name, s in slots.items()}
        new_weights = _shard_of(layout, pieces, None, state.dtype)
    gathered = _down_column(new_weights, columns, state.rank, workers, "all_gather")
    gathered = tf.reshape(gathered, [workers * layout.shard])
    ctx.merge_call(_write_chunks, args=(state, values, gathered, new_slots))


def _row_sums(strategy, flat, local):
    """Merge call: each local replica's chunk of its worker's summed gradients.

    Local replica `l` gets chunk `l` of the sum of the worker's flat gradients, summed on its own
    device (plain ops, on any device type)."""
    parts = strategy.experimental_local_results(flat)
    size = int(parts[0].shape[0]) // local
    chunks = []
    for i, device in enumerate(strategy.extended.worker_devices):
        with tf.device(device):
            chunks.append(tf.add_n([p[i * size : (i + 1) * size] for p in parts]))
    return values_lib.PerReplica(tuple(chunks))


def _down_column(x, columns, rank, workers, kind):
    """The column phase across the workers, in the collective runtime's rank order.

    `reduce_scatter` keeps rank `rank`'s chunk of the column's sum; `all_gather` concatenates the
    column's `x` in rank order. Inside `tf.function` these are collective ops. Eagerly (where the
    package's fallback orders ranks by the group's row instead) the same results come from sums
    alone, which need no order: the column's sum, sliced; and each rank's `x` placed in its slot.
    """
    if context.backend() != "eager":
        if kind == "reduce_scatter":
            return collectives.reduce_scatter(x, columns)
        return collectives.all_gather(x, columns)
    if kind == "reduce_scatter":
        size = int(x.shape[0]) // workers
        return collectives.group_sum(x, columns)[rank * size : (rank + 1) * size]
    size = int(x.shape[0])
    placed = tf.pad(x, [[rank * size, (workers - 1 - rank) * size]])
    return collectives.group_sum(placed, columns)


def _shard_of(layout, pieces, slot, dtype):
    """The replica's updated shard, `layout.shard` long.

    Its pieces' new weights (`slot` None) or values of `slot`, padded with zeros."""
    parts = [p.weight if slot is None else p.slots[slot] for p in pieces]
    tail = layout.shard - sum(int(p.weight.shape[0]) for p in pieces)
    if tail:
        parts.append(tf.zeros([tail], dtype))
    return parts[0] if len(parts) == 1 else tf.concat(parts, 0)


def _write_chunks(strategy, state, variables, gathered, new_slots):
    """Merge call: writes the local replicas' new state and every local copy of the variables.

    Each replica's slot shards take its new values; each variable is rebuilt from the worker's
    gathered chunks (chunk `l`, on replica `l`, covers positions `[l * size, (l + 1) * size)` of the
    flattened variables) and written to every local copy."""
    layout = state.layout
    devices = strategy.extended.worker_devices
    chunks = strategy.experimental_local_results(gathered)
    size = int(chunks[0].shape[0])
    for name, variable in state.slots.items():
        for part, value in zip(
            strategy.experimental_local_results(variable.value),
            strategy.experimental_local_results(new_slots[name]),
        ):
            part.assign(value)
    for var, (a, b) in enumerate(zip(layout.offsets[:-1], layout.offsets[1:])):
        if a == b:
            continue
        first = a // size
        with tf.device(devices[first]):
            parts = [
                chunks[c][max(a, c * size) - c * size : min(b, (c + 1) * size) - c * size]
                for c in range(first, (b - 1) // size + 1)
            ]
            value = parts[0] if len(parts) == 1 else tf.concat(parts, 0)
            value = tf.reshape(value, layout.shapes[var])
        for i, device in enumerate(devices):
            with tf.device(device):
                strategy.experimental_local_results(variables[var])[i].assign(value)


def _part(flat, a, b, size):
    """`flat[a:b]`, without an op when it is all of `flat` (`size` long)."""
    return flat if (a, b) == (0, size) else flat[a:b]


def _update_in_graph(strategy, optimizer, state, grads, variables, learning_rate, decayed):
    """Merge call of `update` on one host: reduce-scatter, sharded update and all-gather.

    All are plain ops on each replica's device. Each shard is a list of pieces of variables (a
    variable inside one shard is one piece, whole)."""
    layout = state.layout
    devices = strategy.extended.worker_devices
    grads = [strategy.experimental_local_results(g) for g in grads]
    copies = [strategy.experimental_local_results(v) for v in variables]
    slots = {name: strategy.experimental_local_results(v.value) for name, v in state.slots.items()}
    shards = []  # per replica: its pieces
    for i, device in enumerate(devices):
        with tf.device(device):
            shard = []
            for var, a, b, offset in layout.pieces(state.owned[i]):
                size = layout.sizes[var]
                weight = _part(tf.reshape(copies[var][i], [-1]), a, b, size)
                grad = tf.add_n([_part(g, a, b, size) for g in grads[var]])
                shard.append(
                    _Piece(
                        var,
                        weight,
                        tf.cast(grad, weight.dtype),
                        {name: s[i][offset : offset + b - a] for name, s in slots.items()},
                    )
                )
            shards.append(shard)
    if state.kind == "lars":
        partial = []
        for i, device in enumerate(devices):
            with _on_replica(i, device):
                partial.append(_squared_norms(state, shards[i]))
        for i, device in enumerate(devices):
            with _on_replica(i, device):
                norms = tf.add_n(partial)
                _set_lars_scales(optimizer, state, shards[i], norms, learning_rate)
    for i, device in enumerate(devices):
        with _on_replica(i, device):
            _apply(optimizer, state, shards[i], learning_rate, decayed)
            for name, s in slots.items():
                s[i].assign(_shard_of(layout, shards[i], name, s[i].dtype))
    # All-gather: every replica writes each variable from the updated pieces that cover it.
    parts = [[] for _ in layout.sizes]
    for i, device in enumerate(devices):
        for piece in shards[i]:
            parts[piece.var].append((device, piece.weight))
    for var, pieces in enumerate(parts):
        if not pieces:
            continue
        with tf.device(pieces[0][0]):
            value = pieces[0][1] if len(pieces) == 1 else tf.concat([p for _, p in pieces], 0)
            value = tf.reshape(value, layout.shapes[var])
        for i, device in enumerate(devices):
            with tf.device(device):
                copies[var][i].assign(value)


def _on_replica(i, device):
    """Replica `i`'s device, under the name scope Keras's replicated update gives its share
    (`update_<i>`, from `MirroredStrategy`'s `extended.update`): a profile names both alike."""
    scope = contextlib.ExitStack()
    scope.enter_context(tf.device(device))
    scope.enter_context(tf.name_scope(f"update_{i}"))
    return scope


class _Piece:
    """One variable's piece in one shard: its weights, summed gradient and optimizer slots
    (tensors, replaced by their updated values), and for LARS its learning-rate scale."""

    def __init__(self, var, weight, grad, slots):
        self.var = var
        self.weight = weight
        self.grad = grad
        self.slots = slots
        self.scale = None
        self.decay = None


def _apply(optimizer, state, pieces, learning_rate, decayed):
    """Keras's decoupled weight decay where `decayed` says, then the update rule, piece by piece."""
    for piece in pieces:
        if decayed[piece.var]:  # Keras's decoupled decay: w - w * weight_decay * rate
            w, dtype = piece.weight, piece.weight.dtype
            rate = tf.cast(learning_rate, dtype)
            piece.weight = w - w * tf.cast(optimizer.weight_decay, dtype) * rate
        _UPDATES[state.kind](optimizer, piece, learning_rate)


def _sgd(optimizer, piece, learning_rate):
    """Keras's SGD rule (plain, momentum or Nesterov) on one piece."""
    w, grad = piece.weight, piece.grad
    rate = tf.cast(learning_rate, w.dtype)
    if "momentum" not in piece.slots:
        piece.weight = w - rate * grad
        return
    decay = tf.cast(optimizer.momentum, w.dtype)
    momentum = decay * piece.slots["momentum"] - rate * grad
    piece.slots["momentum"] = momentum
    step = decay * momentum - rate * grad if optimizer.nesterov else momentum
    piece.weight = w + step


def _squared_norms(state, pieces):
    """`[2, variables]`: the squared weight and gradient norms of `pieces`, per variable (zero for
    the variables with no piece here or no trust ratio). Summed over every shard, they are each
    variable's squared norms."""
    _, adapts = state.lars
    count, dtype = len(adapts), state.slots["momentum"].dtype
    parts = {}
    for piece in pieces:
        if adapts[piece.var]:
            parts[piece.var] = tf.stack(
                [tf.reduce_sum(tf.square(piece.weight)), tf.reduce_sum(tf.square(piece.grad))]
            )
    if not parts:
        return tf.zeros([2, count], dtype)
    indices = sorted(parts)
    return tf.transpose(
        tf.scatter_nd([[i] for i in indices], tf.stack([parts[i] for i in indices]), [count, 2])
    )


def _set_lars_scales(optimizer, state, pieces, norms, learning_rate):
    """Each piece's LARS learning rate and decay, from the variables' squared `norms` (`[2,
    variables]`, summed over every shard)."""
    decays, adapts = state.lars
    dtype = state.slots["momentum"].dtype
    weight_decay = tf.cast(optimizer.weight_decay, dtype)
    rate = tf.cast(learning_rate, dtype)
    for piece in pieces:
        decay = weight_decay if decays[piece.var] else tf.zeros([], dtype)
        piece.decay = decay
        piece.scale = rate
        if not adapts[piece.var]:
            continue
        w_norm, g_norm = tf.sqrt(norms[0, piece.var]), tf.sqrt(norms[1, piece.var])
        usable = tf.logical_and(w_norm > 0.0, g_norm > 0.0)
        denominator = tf.where(usable, g_norm + decay * w_norm, 1.0)
        trust = tf.where(usable, tf.cast(optimizer.eta, dtype) * w_norm / denominator, 1.0)
        piece.scale = rate * trust


def _lars(optimizer, piece, learning_rate):
    """`tpu_scale.optimizers.LARS`'s rule on one piece, with its scale and decay set."""
    w, dtype = piece.weight, piece.weight.dtype
    update = piece.grad + piece.decay * w
    velocity = piece.slots["momentum"] * tf.cast(optimizer.momentum, dtype) + update * piece.scale
    piece.slots["momentum"] = velocity
    piece.weight = w - velocity


def _adam(optimizer, piece, learning_rate):
    """Keras's Adam rule (`keras.optimizers.Adam.update_step`, constants included) on one piece."""
    w, grad, dtype = piece.weight, piece.grad, piece.weight.dtype
    rate = tf.cast(learning_rate, dtype)
    step = tf.cast(optimizer.iterations + 1, dtype)
    beta_1_power = tf.pow(tf.cast(optimizer.beta_1, dtype), step)
    beta_2_power = tf.pow(tf.cast(optimizer.beta_2, dtype), step)
    alpha = rate * tf.sqrt(1 - beta_2_power) / (1 - beta_1_power)
    m, v = piece.slots["momentum"], piece.slots["velocity"]
    m = m + (grad - m) * tf.cast(1 - optimizer.beta_1, dtype)
    v = v + (tf.square(grad) - v) * tf.cast(1 - optimizer.beta_2, dtype)
    piece.slots["momentum"], piece.slots["velocity"] = m, v
    if "velocity_hat" in piece.slots:
        v = tf.maximum(piece.slots["velocity_hat"], v)
        piece.slots["velocity_hat"] = v
    piece.weight = w - (m * alpha) / (tf.sqrt(v) + tf.cast(optimizer.epsilon, dtype))


_UPDATES = {"sgd": _sgd, "lars": _lars, "adam": _adam}
