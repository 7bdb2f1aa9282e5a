"""The sharded weight update's step: the gradient sum's phases, cut around each replica's update.

`tpu_scale.torus.weight_update` holds the layout, the sharded state and what the Keras seam calls; this
module builds the step itself, in replica context, from one replica's gradients:

1. the gradients are fused into the layout's buffers (`weight_update.Layout`: the torus sum's
   buffers, `pack_bytes` each), each cut into its streams' shares;
2. each stream's reduce-scatter phases (`torus_schedule.sharded_streams`: the strategy's algorithm
   with its all-reduce cut in two) leave this replica the sum of its chunk of every share, run by
   `torus.run_streams` as the torus sum runs its phases: plain ops where a phase's groups sit in
   this CPU process, collective ops elsewhere, `gradient_dtype` on the phases between processes;
3. the optimizer's own update on the chunks: Keras's `update_step` of the inner optimizer on this
   replica's shard, run by `extended.update` as Keras runs it on a replicated variable (each
   replica's call reads and writes that replica's part of the inner optimizer's variables). A
   layer-wise rule runs its element-wise part, `scaled_update`, with each piece's rate and decay
   from `layer_factors` and the variables' norms summed over every shard;
4. the all-gather phases, in reverse, bring every replica the updated buffers in the weights' own
   dtype, and each replica writes its copy of the variables from them.
"""

import tensorflow as tf

from tpu_scale.distribute import collectives
from tpu_scale.tf_seam import distribute_values as values_lib
from tpu_scale.torus import all_reduce as torus


def update(ctx, state, grads, values, learning_rate, layer=None, gradient_dtype=None):
    """The sharded update of one replica (the module docstring).

    Args:
      ctx: the replica context.
      state: the optimizer's `weight_update.Sharded` state.
      grads: this replica's flattened local gradients, one per variable.
      values: the variables (their replica-local values).
      learning_rate: the step's learning rate.
      layer: for a layer-wise rule, the optimizer, whose `layer_factors(index, weight_norm,
        grad_norm)` gives the rate factor and weight decay of variable `index`; None for an
        element-wise rule.
      gradient_dtype: a narrower float dtype (e.g. `"bfloat16"`) for the gradient's phases between
        processes, or None. The weights' all-gather keeps their dtype.
    """
    strategy, layout = ctx.strategy, state.layout
    replica = int(tf.get_static_value(ctx.replica_id_in_sync_group))
    pieces = layout.pieces(replica)
    scatter = [s for s, _ in layout.streams]
    gather = [g for _, g in layout.streams]
    transport = None if gradient_dtype is None else tf.as_dtype(gradient_dtype)
    # 1-2. This replica's chunk of every buffer's sum.
    shares = [_shares(layout, buffer, grads) for buffer in layout.buffers]
    torus.run_streams(scatter, shares, transport, channel="tpu_scale.torus.sharded_update")
    n = layout.num_shards
    grad = _joined(  # (collective ops lose the static length)
        [
            tf.reshape(tf.cast(c, state.dtype), [size // n])
            for chunks, buffer in zip(shares, layout.buffers)
            for c, (_, size) in zip(chunks, buffer.shares)
        ]
    )
    # 3. The optimizer's own update on this replica's shard of the weights.
    flat = [tf.reshape(tf.convert_to_tensor(v), [-1]) for v in values]
    weights = [_part(flat[var], a, b, layout.sizes[var]) for var, a, b, _ in pieces]
    offsets = [offset for _, _, _, offset in pieces]
    weight = _placed(list(zip(offsets, weights)), layout.shard, state.dtype)
    rate = decay = None
    if layer is not None:
        norms = _squared_norms(len(layout.sizes), pieces, weights, _pieces_of(grad, pieces))
        if state.across_workers:  # within each worker, then between them
            norms = collectives.group_sum(norms, strategy.mesh.row_groups(), latency_bound=True)
            norms = collectives.group_sum(norms, strategy.mesh.column_groups())
        else:
            everyone = [list(range(n))]
            norms = collectives.group_sum(norms, everyone, latency_bound=True)
        rate, decay = _layer_vectors(layer, layout, pieces, norms, learning_rate, state.dtype)
    updated = ctx.merge_call(_apply_to_shards, args=(state, weight, grad, learning_rate, rate, decay))
    # 4. Every replica's updated chunks back, then this replica's copy of each variable from them.
    chunks, offset = [], 0  # the shard holds its chunks buffer by buffer, stream by stream
    for buffer in layout.buffers:
        chunks.append([])
        for _, size in buffer.shares:
            chunks[-1].append(updated[offset : offset + size // n])
            offset += size // n
    torus.run_streams(gather, chunks, None, channel="tpu_scale.torus.sharded_update")
    new_values = [None] * len(values)
    for buffer, gathered in zip(layout.buffers, chunks):
        full = _joined([tf.reshape(c, [size]) for c, (_, size) in zip(gathered, buffer.shares)])
        for var in buffer.variables:
            at = layout.starts[var] - buffer.start
            new_values[var] = tf.reshape(
                _part(full, at, at + layout.sizes[var], buffer.length), layout.shapes[var]
            )
    ctx.merge_call(_write, args=(values, new_values))


def _shares(layout, buffer, grads):
    """This replica's gradients fused into one of the layout's buffers, cut into its streams'
    shares."""
    dtype = grads[buffer.variables[0]].dtype
    placed = [(layout.starts[var] - buffer.start, grads[var]) for var in buffer.variables]
    flat = _placed(placed, buffer.length, dtype)
    return [
        _part(flat, a - buffer.start, a - buffer.start + size, buffer.length)
        for a, size in buffer.shares
    ]


def _joined(parts):
    return parts[0] if len(parts) == 1 else tf.concat(parts, 0)


def _part(flat, a, b, size):
    """`flat[a:b]`, without an op when it is all of `flat` (`size` long)."""
    return flat if (a, b) == (0, size) else flat[a:b]


def _placed(items, length, dtype):
    """A vector of `length`: each `(offset, part)` of `items` (in order) at its offset, zeros
    between."""
    out, end = [], 0
    for offset, part in items:
        if offset > end:
            out.append(tf.zeros([offset - end], dtype))
        out.append(part)
        end = offset + int(part.shape[0])
    if length > end:
        out.append(tf.zeros([length - end], dtype))
    return _joined(out)


def _pieces_of(shard, pieces):
    """The parts of a flat shard that are `pieces`."""
    return [shard[offset : offset + b - a] for _, a, b, offset in pieces]


def _apply_to_shards(strategy, state, weights, grads, learning_rate, rates=None, decays=None):
    """Merge call: each replica's shard of the weights into the inner optimizer's variable, the
    optimizer's own update on it, and each replica's updated shard back (per replica)."""
    inner, variable = state.inner, state.weights.value
    devices = strategy.extended.worker_devices
    parts = strategy.experimental_local_results(variable)
    for part, value, device in zip(parts, strategy.experimental_local_results(weights), devices):
        with tf.device(device):
            part.assign(value)
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
    for part, device in zip(parts, devices):
        with tf.device(device):
            updated.append(tf.identity(part.read_value()))
    return values_lib.PerReplica(tuple(updated))


def _write(strategy, variables, values):
    """Merge call: each replica's copy of each variable from its own gathered value."""
    devices = strategy.extended.worker_devices
    for variable, value in zip(variables, values):
        copies = strategy.experimental_local_results(variable)
        for copy, part, device in zip(copies, strategy.experimental_local_results(value), devices):
            with tf.device(device):
                copy.assign(part)


def _squared_norms(count, pieces, weights, grads):
    """`[2, count]`: the squared weight and gradient norms of `pieces` per variable (zero for the
    variables with no piece here). Summed over every shard, they are each variable's squared
    norms."""
    dtype = weights[0].dtype if weights else tf.float32
    if not pieces:
        return tf.zeros([2, count], dtype)
    # `reduce_sum(square(x))` would also write and read a copy of each piece.
    rows = [tf.stack([_squared_norm(w), _squared_norm(g)]) for w, g in zip(weights, grads)]
    indices = [[var] for var, _, _, _ in pieces]
    return tf.transpose(tf.scatter_nd(indices, tf.stack(rows), [count, 2]))


def _squared_norm(x):
    """`sum(x * x)`, in one kernel that reads `x` once (TensorFlow's `L2Loss`, half of it)."""
    return 2 * tf.nn.l2_loss(x)


def _layer_vectors(layer, layout, pieces, norms, learning_rate, dtype):
    """Per element of a shard, the layer-wise rule's rate (the learning rate times its variable's
    factor) and weight decay, from the variables' squared `norms` summed over every shard."""
    rates, decays = [], []
    rate = tf.cast(learning_rate, dtype)
    for var, a, b, _ in pieces:
        factor, decay = layer.layer_factors(var, tf.sqrt(norms[0, var]), tf.sqrt(norms[1, var]))
        rates.append(tf.fill([b - a], rate * tf.cast(factor, dtype)))
        decays.append(tf.fill([b - a], tf.cast(decay, dtype)))
    offsets = [offset for _, _, _, offset in pieces]
    return (
        _placed(list(zip(offsets, rates)), layout.shard, dtype),
        _placed(list(zip(offsets, decays)), layout.shard, dtype),
    )
