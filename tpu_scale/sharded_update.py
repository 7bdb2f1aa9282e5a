"""The sharded weight update's step: each replica sums, updates and hands out its shard.

`tpu_scale.weight_update` holds the layout, the sharded state and what the Keras seam calls; this
module builds the step itself, in replica context, from the optimizer's gradient sum:

* one host: every replica lives in this process. One merge call builds the reduce-scatter, the
  update and the all-gather from plain ops on the replicas' devices: no collective op and no fused
  buffer (a whole variable's gradient is summed straight from the replicas' gradients, and its
  updated value is written to every copy as it is).
* across workers: several workers, one mesh row each. Replica `l` of the worker of rank `r` owns
  shard `l * workers + r`. Its gradient shard is the torus sum's first two phases: a reduce-scatter
  along its worker's row (plain ops, in a merge call) and one down its mesh column (a collective op
  across the workers, in the strategy's `gradient_dtype` when that is narrower). The replica
  updates its shard (a layer-wise rule's norms summed along the row and down the column alike), and
  the updated shards come back by the same two phases in reverse: an all-gather down the column (a
  collective op, in the weights' own dtype), then, in a merge call, every local copy written from
  the worker's gathered chunks.

The update itself is the optimizer's own: Keras's `update_step` of the inner optimizer on each
replica's shard, run by `extended.update` as Keras runs it on a replicated variable (each replica's
call reads and writes that replica's part of the inner optimizer's variables). A layer-wise rule
runs its element-wise part, `scaled_update`, with each piece's rate and decay from
`layer_factors`.
"""

import contextlib

import tensorflow as tf
from tensorflow.python.distribute import values as values_lib

from tpu_scale import collectives, context


def update(ctx, state, grads, values, learning_rate, layer=None, gradient_dtype=None):
    """The sharded update of one replica, on one host or across workers (the module docstring).

    Args:
      ctx: the replica context.
      state: the optimizer's `weight_update.Sharded` state.
      grads: this replica's flattened local gradients, one per variable.
      values: the variables (their replica-local values).
      learning_rate: the step's learning rate.
      layer: for a layer-wise rule, the optimizer, whose `layer_factors(index, weight_norm,
        grad_norm)` gives the rate factor and weight decay of variable `index`; None for an
        element-wise rule.
      gradient_dtype: across workers, a narrower float dtype (e.g. `"bfloat16"`) for the
        gradient's phase between the workers, or None.
    """
    if not state.across_workers:
        ctx.merge_call(_update_in_graph, args=(state, grads, values, learning_rate, layer))
        return
    _across_workers(ctx, state, grads, values, learning_rate, layer, gradient_dtype)


def _across_workers(ctx, state, grads, values, learning_rate, layer, gradient_dtype):
    """`update` across workers, one mesh row per worker."""
    strategy, layout, workers = ctx.strategy, state.layout, state.workers
    index = int(tf.get_static_value(ctx.replica_id_in_sync_group)) % len(state.owned)
    columns = strategy.mesh.column_groups()
    flat = tf.concat(grads + [tf.zeros([layout.padding], grads[0].dtype)], 0)
    # This replica's chunk of its row's sum.
    chunk = ctx.merge_call(_row_sums, args=(flat, len(state.owned)))
    wide = chunk.dtype
    if gradient_dtype is not None and tf.as_dtype(gradient_dtype).size < wide.size:
        chunk = tf.cast(chunk, gradient_dtype)  # the phase between the workers only
    grad = _down_column(chunk, columns, state.rank, workers, "reduce_scatter")
    grad = tf.reshape(tf.cast(grad, state.dtype), [layout.shard])  # collectives lose the length
    pieces = layout.pieces(state.owned[index])
    weights = [
        _part(tf.reshape(tf.convert_to_tensor(values[var]), [-1]), a, b, layout.sizes[var])
        for var, a, b, _ in pieces
    ]
    weight = _padded(weights, layout.shard, state.dtype)
    rate = decay = None
    if layer is not None:
        norms = _squared_norms(len(layout.sizes), pieces, weights, _pieces_of(grad, pieces))
        norms = collectives.group_sum(norms, strategy.mesh.row_groups(), latency_bound=True)
        norms = collectives.group_sum(norms, columns)
        rate, decay = _layer_vectors(layer, layout, pieces, norms, learning_rate, state.dtype)
    new_weights = ctx.merge_call(
        _apply_to_shards, args=(state, weight, grad, learning_rate, rate, decay)
    )
    gathered = _down_column(new_weights, columns, state.rank, workers, "all_gather")
    gathered = tf.reshape(gathered, [workers * layout.shard])
    ctx.merge_call(_write_chunks, args=(state, values, gathered))


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


def _write_chunks(strategy, state, variables, gathered):
    """Merge call: writes every local copy of the variables from the worker's gathered chunks.

    Chunk `l`, on replica `l`, covers positions `[l * size, (l + 1) * size)` of the flattened
    variables; each variable is rebuilt from the chunks that cover it."""
    layout = state.layout
    devices = strategy.extended.worker_devices
    chunks = strategy.experimental_local_results(gathered)
    size = int(chunks[0].shape[0])
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


def _padded(parts, length, dtype):
    """`parts` end to end, padded with zeros to `length`."""
    tail = length - sum(int(p.shape[0]) for p in parts)
    if tail:
        parts = list(parts) + [tf.zeros([tail], dtype)]
    return parts[0] if len(parts) == 1 else tf.concat(parts, 0)


def _pieces_of(shard, pieces):
    """The parts of a flat shard that are `pieces`."""
    return [shard[offset : offset + b - a] for _, a, b, offset in pieces]


def _local(strategy, value, i):
    """Replica `i`'s part of `value` (a distributed value, or one value for every replica)."""
    parts = strategy.experimental_local_results(value)
    return parts[i] if len(parts) > 1 else parts[0]


def _apply_to_shards(strategy, state, weights, grads, learning_rate, rates=None, decays=None):
    """Merge call: each replica's shard of the weights into the inner optimizer's variable, the
    optimizer's own update on it, and each replica's updated shard back (per replica)."""
    inner, variable = state.inner, state.weights.value
    devices = strategy.extended.worker_devices
    for i, (part, device) in enumerate(zip(strategy.experimental_local_results(variable), devices)):
        with tf.device(device):
            part.assign(_local(strategy, weights, i))
    if rates is None:
        strategy.extended.update(
            variable, lambda v, g, r: inner.update_step(g, v, r), args=(grads, learning_rate),
            group=False,
        )
    else:
        strategy.extended.update(
            variable, lambda v, g, r, d: inner.scaled_update(g, v, r, d),
            args=(grads, rates, decays), group=False,
        )
    updated = []
    for part, device in zip(strategy.experimental_local_results(variable), devices):
        with tf.device(device):
            updated.append(tf.identity(part.read_value()))
    return values_lib.PerReplica(tuple(updated))


def _update_in_graph(strategy, state, grads, variables, learning_rate, layer):
    """Merge call of `update` on one host: reduce-scatter, sharded update and all-gather.

    All are plain ops on each replica's device. Each shard is a list of pieces of variables (a
    variable inside one shard is one piece, whole)."""
    layout = state.layout
    devices = strategy.extended.worker_devices
    grads = [strategy.experimental_local_results(g) for g in grads]
    copies = [strategy.experimental_local_results(v) for v in variables]
    weight_shards, grad_shards, weight_pieces, grad_pieces = [], [], [], []
    for i, device in enumerate(devices):
        with tf.device(device):
            weights, sums = [], []
            for var, a, b, _ in layout.pieces(state.owned[i]):
                size = layout.sizes[var]
                weights.append(_part(tf.reshape(copies[var][i], [-1]), a, b, size))
                summed = tf.add_n([_part(g, a, b, size) for g in grads[var]])
                sums.append(tf.cast(summed, state.dtype))
            weight_pieces.append(weights)
            grad_pieces.append(sums)
            weight_shards.append(_padded(weights, layout.shard, state.dtype))
            grad_shards.append(_padded(sums, layout.shard, state.dtype))
    rates = decays = None
    if layer is not None:
        count = len(layout.sizes)
        partial = []
        for i, device in enumerate(devices):
            with tf.device(device):
                pieces = layout.pieces(state.owned[i])
                partial.append(_squared_norms(count, pieces, weight_pieces[i], grad_pieces[i]))
        rates, decays = [], []
        for i, device in enumerate(devices):
            with _on_replica(i, device):
                norms = tf.add_n(partial)
                rate, decay = _layer_vectors(
                    layer, layout, layout.pieces(state.owned[i]), norms,
                    _local(strategy, learning_rate, i), state.dtype,
                )
                rates.append(rate)
                decays.append(decay)
        rates, decays = values_lib.PerReplica(tuple(rates)), values_lib.PerReplica(tuple(decays))
    updated = _apply_to_shards(
        strategy, state, values_lib.PerReplica(tuple(weight_shards)),
        values_lib.PerReplica(tuple(grad_shards)), learning_rate, rates, decays,
    )
    updated = strategy.experimental_local_results(updated)
    # All-gather: every replica writes each variable from the updated pieces that cover it.
    parts = [[] for _ in layout.sizes]
    for i, device in enumerate(devices):
        for var, a, b, offset in layout.pieces(state.owned[i]):
            parts[var].append((device, updated[i][offset : offset + b - a]))
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


def _squared_norms(count, pieces, weights, grads):
    """`[2, count]`: the squared weight and gradient norms of `pieces` per variable (zero for the
    variables with no piece here). Summed over every shard, they are each variable's squared
    norms."""
    dtype = weights[0].dtype if weights else tf.float32
    if not pieces:
        return tf.zeros([2, count], dtype)
    rows = [
        tf.stack([tf.reduce_sum(tf.square(w)), tf.reduce_sum(tf.square(g))])
        for w, g in zip(weights, grads)
    ]
    indices = [[var] for var, _, _, _ in pieces]
    return tf.transpose(tf.scatter_nd(indices, tf.stack(rows), [count, 2]))


def _layer_vectors(layer, layout, pieces, norms, learning_rate, dtype):
    """Per element of a shard, the layer-wise rule's rate (the learning rate times its variable's
    factor) and weight decay, from the variables' squared `norms` summed over every shard."""
    rates, decays = [], []
    rate = tf.cast(learning_rate, dtype)
    for var, a, b, _ in pieces:
        factor, decay = layer.layer_factors(var, tf.sqrt(norms[0, var]), tf.sqrt(norms[1, var]))
        rates.append(tf.fill([b - a], rate * tf.cast(factor, dtype)))
        decays.append(tf.fill([b - a], tf.cast(decay, dtype)))
    return _padded(rates, layout.shard, dtype), _padded(decays, layout.shard, dtype)
