"""Grouped ("distributed") batch normalization: batch statistics over a group of replicas.

At large scale each replica sees only a handful of examples, too few for good batch statistics,
while normalizing over all replicas is slow and also hurts accuracy. `DistributedBatchNormalization`
normalizes over a *group* of replicas instead: each replica packs its local per-channel sum, sum of
squares and count into one tensor, the group sums it with a single cross-replica reduction, and
every member normalizes with the group's mean and variance.

Reference:
  Ying et al., "Image Classification at Supercomputer Scale", 2018 (arXiv:1811.06992), section 3.
"""

import logging
import weakref

import keras
import numpy as np
import tensorflow as tf

from tpu_scale import keras_hook
from tpu_scale.distribute import collectives, context
from tpu_scale.distribute.mesh import smallest_group_for_span

# The BN span (examples normalized together) `group_size=None` aims for: the smallest group reaching
# it.
DEFAULT_SPAN = 64

logger = logging.getLogger(__name__)


_RENORM_ARGUMENTS = ("renorm", "renorm_clipping", "renorm_momentum")


keras_has_renorm = keras_hook.keras_has_renorm


@keras.saving.register_keras_serializable(package="tpu_scale")
class BatchNormalization(keras.layers.BatchNormalization):
    """Batch normalization whose training statistics cover a group of replicas.

    `tpu_scale.layers.DistributedBatchNormalization` (the paper's name) is this class. A drop-in
    replacement for `keras.layers.BatchNormalization`: it takes every argument of that layer and
    behaves exactly like it outside a multi-replica strategy, at inference, and with `group_size=1`
    (except for batches with no element, below). It carries Keras's class name, so Keras saves
    its weights under the same names as its own layer's: weights files (`.weights.h5`, `.keras`)
    move both ways between a model with Keras's layer and the same model with this one. In training under a strategy with
    several replicas, the mean and variance are those of the concatenated batch of the replica's
    group, so each replica's output (and gradient) is what plain batch normalization would give on
    the group's whole batch.

    Replicas may hold any number of examples, none included: the last batch of an epoch batched with
    `drop_remainder=False` is split unevenly and can leave replicas empty. A member with no
    (unmasked) element adds nothing to its group's statistics and gets zero gradients, and the
    others normalize over the elements the group has. A group with no element at all (every member
    empty or fully masked; with local statistics, an empty replica) has no batch statistics: its
    moving statistics keep their values and its gradients are zero. Keras's layer, given an empty
    batch, takes the 0 / 0 moments and turns its moving statistics and `gamma` gradient NaN (a fully
    masked one moves the moving mean and variance towards 0).

    Each training call makes exactly one cross-replica call, `tpu_scale.distribute.collectives.all_gather`:
    every member's per-channel unmasked-element count, mean and variance (two passes over its own
    elements, as Keras's local moments), packed into a single float32 tensor (float64 for float64
    inputs; bfloat16 and float16 inputs are upcast first). From them each member combines the group's
    moments exactly as one pass over the concatenated batch would: `N = sum(n_r)`, `mean = sum(n_r
    m_r) / N` and `variance = sum(n_r (v_r + (m_r - mean)^2)) / N`, a sum of non-negative terms: the
    group's true variance, never an average of per-replica variances, and without the cancellation
    of `E[x^2] - E[x]^2` when the mean is large against the spread.

    Groups come from the strategy's mesh: `mesh.group_assignment(group_size, tiled=mesh.is_torus)`,
    i.e. contiguous replica ids on CPU/GPU hosts and compact tiles of neighbouring chips on a TPU
    torus.

    Training calls on 4-D channels-last float inputs without mask or renorm (convolutional networks)
    normalize with TensorFlow's fused batch-norm kernel given these statistics, with a written-out
    gradient; outputs then match Keras's element-wise ops up to float rounding, and the step is
    shorter (on one host every replica of a group runs the ops after the group sum at the same
    time).

    One set of moving statistics: every replica moves them towards the mean, over all replicas,
    of Keras's update from its group's batch statistics, so after any step every replica holds the
    same values, and `evaluate` and `predict` under the strategy, checkpoints and the saved model
    all use them. Where groups are smaller than the replicas this costs one more sum per training
    call, of a few kilobytes, over all replicas; nothing in the step waits for it. (Keras's own
    layer keeps a copy per replica that drifts apart; `average_moving_statistics` is for it.)
    Batch renormalization
    (`renorm=True`) runs Keras's algorithm unchanged on the group statistics: its `r`/`d`
    corrections and all its moving statistics use the group mean and deviation.

    Args:
      group_size: replicas per group. `1` gives local statistics, `strategy.num_replicas_in_sync`
        global ones. `None` picks the smallest group whose span (per-replica batch size x group
        size) reaches 64 examples, from the static batch size of the first training call, and keeps
        it for the layer's life; where that batch size is unknown (a dataset batched without
        `drop_remainder`), the replicas of one host. With `synchronized=True`, `None` means all
        replicas. The choice is logged once. Must divide
        the number of replicas (and tile the torus on TPU).
      virtual_batch_size: examples per virtual batch ("ghost" batch normalization, Hoffer et al.,
        2017; tf.keras's argument of the same name): in training, each run of this many examples
        of a replica's batch is normalized with its own mean and variance (the last run holds
        what is left, so any batch size works), and the moving statistics move towards their
        average. For a replica whose batch is larger than the span batch norm works best at.
        Statistics stay local (`group_size` `None` or 1; not with `synchronized` or `renorm`).
      **kwargs: every argument of `keras.layers.BatchNormalization` (`axis`, `momentum`, `epsilon`,
        `center`, `scale`, initializers, regularizers, constraints, `renorm`, `renorm_clipping`,
        `renorm_momentum`, `synchronized`) and the base layer arguments (`name`, `dtype`, ...).
        The `renorm` arguments need a Keras whose layer has them (Keras 3.12's has not: there
        `renorm=True` is a `ValueError` naming the fix, and renorm arguments with renorm off are
        dropped).

    Call arguments:
      inputs: input tensor of any rank.
      training: Python boolean; in training mode the layer normalizes with the group's batch
        statistics and updates the moving statistics, otherwise it uses the moving statistics and
        does not communicate.
      mask: optional tensor of one dimension less than `inputs`, `True` where an element counts.
        Masked elements are excluded from the group's statistics (and from its count).

    Reference:
      - [Ioffe and Szegedy, 2015](https://arxiv.org/abs/1502.03167).
      - [Hoffer et al., 2017](https://arxiv.org/abs/1705.08741), "Ghost batch normalization".
      - [Ying et al., 2018](https://arxiv.org/abs/1811.06992), "Distributed batch normalization".
    """

    def __init__(self, group_size=None, virtual_batch_size=None, **kwargs):
        if not keras_has_renorm():
            asked = [name for name in _RENORM_ARGUMENTS if name in kwargs]
            if kwargs.get("renorm"):
                raise ValueError(f"Batch renormalization ({', '.join(asked)}) needs a Keras whose BatchNormalization has it (added by keras-team/keras#22047); Keras {keras.__version__} has none. Upgrade Keras (pip install -U keras) or leave renorm off.")
            # Renormalization off, e.g. in the config of a model saved with a newer Keras.
            for name in asked:
                kwargs.pop(name)
        super().__init__(**kwargs)
        group_size = _positive_int_or_none(group_size, "group_size", "replicas per group")
        if self.synchronized and group_size == 1:
            raise ValueError("synchronized=True asks for statistics over all replicas but group_size=1 asks for local ones; pass only one of them.")
        virtual_batch_size = _positive_int_or_none(
            virtual_batch_size, "virtual_batch_size", "examples per virtual batch"
        )
        if virtual_batch_size is not None:
            if self.synchronized or (group_size or 1) > 1:
                raise ValueError(f"virtual_batch_size={virtual_batch_size} splits each replica's batch, and {'synchronized=True' if self.synchronized else f'group_size={group_size}'} joins several replicas' batches: pass only one of them.")
            if kwargs.get("renorm"):
                raise ValueError("Batch renormalization (renorm=True) has one set of batch statistics per step, virtual batches one per virtual batch: pass only one of them.")
        self.group_size = group_size
        self.virtual_batch_size = virtual_batch_size
        # (mesh, group size) chosen by the span rule; kept so a smaller last batch cannot change the
        # groups.
        self._resolved = None

    def build(self, input_shape):
        super().build(input_shape)
        if self.virtual_batch_size and self.axis % len(input_shape) == 0:
            raise ValueError(f"virtual_batch_size={self.virtual_batch_size} splits the batch axis, which axis={self.axis} normalizes per index: use a feature axis (the default, -1).")
        # Fail at model construction, not at the first step, when the group size cannot fit the
        # strategy.
        if self.group_size is not None and tf.distribute.has_strategy():
            from tpu_scale.distribute.strategy import mesh_of

            self._checked_assignment(mesh_of(tf.distribute.get_strategy()), self.group_size)

    def get_config(self):
        return {
            **super().get_config(),
            "group_size": self.group_size,
            "virtual_batch_size": self.virtual_batch_size,
        }

    @property
    def _renorm(self):
        """Whether batch renormalization is on (Keras 3.12 has no `renorm`: off)."""
        return getattr(self, "renorm", False)

    def call(self, inputs, training=None, mask=None):
        if not (training and self.trainable):
            return super().call(inputs, training=training, mask=mask)
        if mask is not None and mask.shape.rank != inputs.shape.rank - 1:
            raise ValueError(f"The mask provided should be one dimension less than the inputs. Received: mask.shape={mask.shape}, inputs.shape={inputs.shape}")
        if self.virtual_batch_size:
            return self._virtual_batch_call(inputs, mask)
        # Keras's training step (upcast, statistics from `_moments`, renorm corrections, moving-
        # average updates, normalization), with the moving statistics kept where the group counted
        # nothing, and the normalization of 4-D channels-last inputs done by TensorFlow's fused
        # kernel: one op each way instead of about ten element-wise ones, which on one host all wait
        # on the same group barrier.
        fused = self._fused_training_call(inputs, training, mask)
        dtype = tf.float32 if fused else keras.backend.result_type(inputs.dtype, "float32")
        x = tf.cast(inputs, dtype)
        mean, variance, filled = self._moments(x, mask)
        gamma = tf.cast(self.gamma, dtype) if self.scale else None
        beta = tf.cast(self.beta, dtype) if self.center else None
        if self._renorm:
            r, d, mean, variance = self._renorm_correction_and_moments(mean, variance)
            gamma, beta = self._compose_transforms(r, d, gamma, beta, dtype)
        self._update_moving_statistics(mean, variance, filled, inputs)
        if fused:
            channels = x.shape[-1]
            gamma = tf.ones([channels], dtype) if gamma is None else gamma
            beta = tf.zeros([channels], dtype) if beta is None else beta
            outputs = _fused_normalization(x, mean, variance, gamma, beta, self.epsilon)
        else:
            outputs = keras.ops.batch_normalization(
                x, mean, variance, axis=self.axis, offset=beta, scale=gamma, epsilon=self.epsilon
            )
        return tf.cast(outputs, self.compute_dtype)

    def _fused_training_call(self, inputs, training, mask):
        """Whether this call can normalize with the fused kernel: a training step on a 4-D
        channels-last float input without mask or renorm (the kernel's contract); other training
        steps normalize with Keras's element-wise `batch_normalization`, and inference calls take
        Keras's path."""
        rank = inputs.shape.rank
        return bool(
            training
            and self.trainable
            and mask is None
            and not self._renorm
            and rank == 4
            and self.axis % rank == 3
            and inputs.dtype in (tf.float32, tf.bfloat16, tf.float16)
        )

    def _virtual_batch_call(self, inputs, mask):
        """A training call that normalizes each run of `virtual_batch_size` examples of the
        replica's batch with its own mean and variance ("ghost" batch normalization); the last run
        holds what is left. The moving statistics move towards the virtual batches' mean and
        variance averaged over their counted elements (the variance within a virtual batch: what
        the layer normalized with), as in tf.keras's `virtual_batch_size`. Gradients flow through
        each virtual batch's statistics, as plain batch norm's through the batch's."""
        dtype = keras.backend.result_type(inputs.dtype, "float32")
        x = tf.cast(inputs, dtype)
        rank = x.shape.rank
        channel_axis = self.axis % rank
        others = [a for a in range(1, rank) if a != channel_axis]  # reduced inside an example
        # A static batch size keeps the number of virtual batches static, as XLA needs it.
        batch = x.shape[0] if x.shape[0] is not None else tf.shape(x)[0]
        ids = tf.range(batch) // self.virtual_batch_size
        count = (batch + self.virtual_batch_size - 1) // self.virtual_batch_size

        def per_virtual_batch(per_example):  # [batch, channels] -> [virtual batches, channels]
            return tf.math.unsorted_segment_sum(per_example, ids, count)

        shape = [1] * rank
        shape[0], shape[channel_axis] = -1, x.shape[channel_axis]

        def per_element(per_batch):  # [virtual batches, channels] -> broadcastable to x
            return tf.reshape(tf.gather(per_batch, ids), shape)

        if mask is None:
            weights = None
            inside = tf.gather(tf.shape(x), tf.constant(others, tf.int32))
            elements = tf.cast(tf.reduce_prod(inside), dtype)
            counted = per_virtual_batch(tf.fill([batch, 1], elements))
        else:
            weights = tf.cast(tf.expand_dims(tf.cast(mask, tf.bool), -1), dtype)
            weights = tf.broadcast_to(weights, tf.shape(x))
            counted = per_virtual_batch(tf.reduce_sum(weights, others))
        weighted = x if weights is None else x * weights
        sums = per_virtual_batch(tf.reduce_sum(weighted, others))
        counted = tf.broadcast_to(counted, tf.shape(sums))
        mean = tf.math.divide_no_nan(sums, counted)
        deviation = x - per_element(mean)
        squares = tf.square(deviation) if weights is None else tf.square(deviation) * weights
        variance = tf.math.divide_no_nan(per_virtual_batch(tf.reduce_sum(squares, others)), counted)

        outputs = deviation * per_element(tf.math.rsqrt(variance + self.epsilon))
        parameter_shape = [1] + shape[1:]
        if self.scale:
            outputs *= tf.reshape(tf.cast(self.gamma, dtype), parameter_shape)
        if self.center:
            outputs += tf.reshape(tf.cast(self.beta, dtype), parameter_shape)

        total = tf.reduce_sum(counted, axis=0)
        filled = None if not self._may_be_empty(inputs, mask) else total > 0
        batch_mean = tf.math.divide_no_nan(tf.reduce_sum(counted * mean, axis=0), total)
        batch_variance = tf.math.divide_no_nan(tf.reduce_sum(counted * variance, axis=0), total)
        self._update_moving_statistics(batch_mean, batch_variance, filled, inputs)
        return tf.cast(outputs, self.compute_dtype)

    def _update_moving_statistics(self, mean, variance, filled, inputs):
        """Keras's moving-average updates from the batch statistics, shared by every replica.

        Each replica computes Keras's update from its own (group's) batch statistics. Where groups
        are smaller than the replicas those updates differ, so every replica then takes their mean
        over the replicas that counted something: one sum of the updated values over all replicas
        per call (a few kilobytes, which nothing in the step waits for). As every copy starts equal,
        every replica holds the same moving statistics after every step, and evaluation under the
        strategy, checkpoints and the saved model all read them. Where nothing was counted (this
        replica's group, or all of them) there is nothing to average in: the values stay exactly.
        """
        if self._renorm:
            tracked = [
                self.moving_mean,
                self.moving_variance,
                self.moving_stddev,
                self.renorm_mean,
                self.renorm_stddev,
            ]
            # Kept only where something may have counted nothing (`filled`).
            previous = [None if filled is None else tf.identity(v.value) for v in tracked]
            self._update_renorm_statistics(mean, variance)  # Keras's arithmetic, then agreed below
            updated = [tf.identity(v.value) for v in tracked]
        else:
            tracked = [self.moving_mean, self.moving_variance]
            previous = [tf.identity(v.value) for v in tracked]  # read once: updated and kept
            updated = [
                tf.cast(current, batch_value.dtype) * self.momentum
                + batch_value * (1.0 - self.momentum)
                for current, batch_value in zip(previous, (mean, variance))
            ]
        everyone = self._all_replicas_if_statistics_differ(inputs)
        if everyone is not None:
            updated, filled = _mean_over_replicas(updated, filled, everyone)
        for variable, value, kept in zip(tracked, updated, previous):
            value = tf.cast(value, variable.dtype)
            variable.assign(value if filled is None else tf.where(filled, value, kept))

    def _all_replicas_if_statistics_differ(self, inputs):
        """The one group of all replicas where replicas' batch statistics can differ (groups
        smaller than the replicas, virtual batches, local statistics), else None."""
        mesh = context.current_mesh()
        if mesh is None or self._group_size_for(mesh, inputs) == mesh.num_replicas:
            return None
        return self._checked_assignment(mesh, mesh.num_replicas)

    # ----------------------------------------------------------------- statistics

    def _moments(self, inputs, mask):
        """Keras's `_moments` hook, with one more result: `(mean, variance, filled)`.

        `filled` is a boolean tensor (per channel, or a scalar), False where the statistics cover no
        element: a group whose members' batches are all empty or fully masked, or, for local
        statistics, such a batch of the replica's own. The mean and variance are then 0, as Keras's
        are for a fully masked batch. `filled` is None when this replica's batch has elements by its
        static shape, so its group's does too.
        """
        groups = self._group_assignment(inputs)
        if groups is not None:
            return self._group_moments(inputs, mask, groups)
        # Nothing to communicate with: Keras's own (two-pass) local moments.
        mean, variance = super()._moments(inputs, mask)
        if not self._may_be_empty(inputs, mask):
            return mean, variance, None
        filled = tf.size(inputs) > 0 if mask is None else tf.reduce_any(tf.cast(mask, tf.bool))
        # An empty batch's moments are 0 / 0: NaN.
        return tf.where(filled, mean, 0.0), tf.where(filled, variance, 0.0), filled

    def _may_be_empty(self, inputs, mask):
        """Whether the batch may have no counted element: masked, or not statically non-empty."""
        dims = [inputs.shape[axis] for axis in self._reduction_axes]
        return mask is not None or not all(d is not None and d > 0 for d in dims)

    def _group_moments(self, inputs, mask, groups):
        """Mean and variance `[channels]` over this replica's group: one all-gather forward, one
        group sum backward.

        Each replica computes its own count, mean and variance (two passes, like Keras's local
        moments) and gathers every member's; a replica with no counted element has count 0, so the
        group's statistics are those of its other members' elements, whatever the batch sizes. The
        gradient is written out (`_moments_from_members`) rather than derived op by op: two
        full-size ops and one group sum per layer, where automatic differentiation of the same
        forward pass built about twenty more per replica, and on one host every replica runs them
        between the same two barriers.

        Returns:
          `(mean, variance, filled)` as `_moments`, `filled` False where the whole group counted
          nothing.
        """
        dtype = inputs.dtype if inputs.dtype == tf.float64 else tf.float32
        x = tf.cast(inputs, dtype)
        weights = None
        if mask is not None:
            weights = tf.cast(
                tf.broadcast_to(tf.expand_dims(tf.cast(mask, tf.bool), -1), tf.shape(x)), dtype
            )
        count, local_mean, local_variance = self._local_moments(tf.stop_gradient(x), weights)
        local = tf.stack([count, local_mean, local_variance])[tf.newaxis]
        members = collectives.all_gather(local, groups, in_graph=True)  # [group size, 3, channels]
        mean, variance, total = _moments_from_members(
            x, members, weights, groups, self._broadcast_shape(x)
        )
        filled = None
        if self._may_be_empty(inputs, mask):
            # As for local statistics (and Keras's fully masked ones): 0 and 0 where none counted.
            filled = total > 0
            mean, variance = tf.where(filled, mean, 0.0), tf.where(filled, variance, 0.0)
        return tf.cast(mean, inputs.dtype), tf.cast(variance, inputs.dtype), filled

    def _local_moments(self, x, weights):
        """Count, mean and variance `[channels]` of this replica's unmasked elements (0 if none)."""
        axes = self._reduction_axes
        if weights is None:
            mean, variance = tf.nn.moments(x, axes)
            count = tf.fill(tf.shape(mean), tf.cast(tf.size(x) // tf.shape(x)[self.axis], x.dtype))
            if self._may_be_empty(x, None):
                # An empty batch's moments are 0 / 0: NaN, which its zero count would not cancel.
                filled = count > 0
                mean, variance = tf.where(filled, mean, 0.0), tf.where(filled, variance, 0.0)
            return count, mean, variance
        count = tf.reduce_sum(weights, axis=axes)
        mean = tf.math.divide_no_nan(tf.reduce_sum(x * weights, axis=axes), count)
        deviation = x - tf.reshape(mean, self._broadcast_shape(x))
        variance = tf.math.divide_no_nan(
            tf.reduce_sum(tf.square(deviation) * weights, axis=axes), count
        )
        return count, mean, variance

    def _broadcast_shape(self, x):
        shape = [1] * x.shape.rank
        shape[self.axis] = -1
        return shape

    # ----------------------------------------------------------------- groups

    def _group_assignment(self, inputs):
        """This call's `[num_groups, group_size]` replica groups, or None for local statistics."""
        mesh = context.current_mesh()
        if mesh is None:
            return None
        group_size = self._group_size_for(mesh, inputs)
        if group_size == 1:
            return None
        return self._checked_assignment(mesh, group_size)

    def _group_size_for(self, mesh, inputs):
        if self.group_size is not None:
            return self.group_size
        if self.virtual_batch_size:
            return 1  # the span is reached inside each replica
        if self.synchronized:
            return mesh.num_replicas
        if self._resolved is not None and self._resolved[0] == mesh:
            return self._resolved[1]
        per_replica_batch = inputs.shape[0]
        if per_replica_batch is None and mesh.is_torus:
            raise ValueError(f"Layer {self.name!r}: group_size=None picks the group from the per-replica batch size, but the batch dimension is unknown here (inputs.shape={tuple(inputs.shape)}), and a TPU step needs static shapes anyway. Batch with drop_remainder=True, or pass group_size explicitly.")
        if per_replica_batch is None:
            # A batch of unknown size (a dataset batched without drop_remainder, as
            # image_dataset_from_directory makes): group the replicas of one host, whose sums stay
            # on the host; the statistics stay exact whatever the batches hold.
            local = _replicas_per_host(mesh)
            group_size = smallest_group_for_span(mesh, 1, local, tiled=mesh.is_torus)
            reason = f"the per-replica batch is unknown when the step is traced; the {local} replicas of one host"
        else:
            group_size = smallest_group_for_span(
                mesh, int(per_replica_batch), DEFAULT_SPAN, tiled=mesh.is_torus
            )
            reason = f"the smallest group of {per_replica_batch}-example replicas spanning {DEFAULT_SPAN} examples"
        _say_once(f"DistributedBatchNormalization group_size=None: groups of {group_size} of the {mesh.num_replicas} replicas ({reason}).")
        self._resolved = (mesh, group_size)
        return group_size

    def _checked_assignment(self, mesh, group_size):
        try:
            return mesh.group_assignment(group_size, tiled=mesh.is_torus)
        except ValueError as e:
            raise ValueError(f"Layer {self.name!r} (DistributedBatchNormalization): {e}") from None


# The paper's name for the same class. Models saved before the class took Keras's name recorded
# this one; the registry reads them too.
DistributedBatchNormalization = BatchNormalization
keras.saving.get_custom_objects()["tpu_scale>DistributedBatchNormalization"] = BatchNormalization


def _replicas_per_host(mesh):
    """How many of the mesh's replicas one host (this process) drives."""
    strategy = tf.distribute.get_strategy()
    local = len(strategy.extended.worker_devices)
    return local if 0 < local <= mesh.num_replicas and mesh.num_replicas % local == 0 else mesh.num_replicas


_SAID = set()  # messages already logged: each layer of a model resolves the same group


def _say_once(message):
    if message not in _SAID:
        _SAID.add(message)
        logger.info(message)


def _positive_int_or_none(value, name, unit):
    """`value` as an int, None kept; a ValueError naming `name` for anything but a positive int."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int ({unit}) or None, got {value!r}.")
    return int(value)


def _mean_over_replicas(values, filled, everyone):
    """`values` averaged over the replicas whose `filled` holds (all where it is None), and where
    any replica's does.

    One sum over all replicas of the values weighted by `filled` and of the weights; each replica
    gets the same sum, hence the same mean. Nothing here is differentiated.
    """
    dtype = tf.float64 if values[0].dtype == tf.float64 else tf.float32
    values = [tf.cast(tf.stop_gradient(v), dtype) for v in values]
    weight = tf.ones([], dtype) if filled is None else tf.cast(filled, dtype)
    weight = tf.broadcast_to(weight, tf.shape(values[0]))
    summed = collectives.group_sum(
        tf.stack([v * weight for v in values] + [weight]), everyone, latency_bound=True
    )
    counted = summed[-1]
    means = [tf.math.divide_no_nan(summed[i], counted) for i in range(len(values))]
    return means, (None if filled is None else counted > 0)


def _moments_from_members(x, members, weights, groups, broadcast_shape):
    """The group's mean, variance and count from its members' `[count, mean, variance]`.

    With `N` the group's count, `mean = sum(n_r m_r) / N` and `variance = sum(n_r (v_r + (m_r -
    mean)^2)) / N` (the variance of the members' elements taken together), so for every element
    `x_j` of the group `d mean / d x_j = 1 / N` and `d variance / d x_j = 2 (x_j - mean) / N`. Every
    member's mean and variance depend on every member's `x`, so the gradient first sums the members'
    upstream gradients over the group (the one reduction of the backward pass), then `dx = x * (2
    G_var / N) + (G_mean - 2 G_var mean) / N`, zero where masked. `members` reaches `x` only through
    this gradient: the gather that made it is never differentiated.
    """

    @tf.custom_gradient
    def moments(x, members):
        counts, means, variances = tf.unstack(members, axis=1)
        total_count = tf.reduce_sum(counts, axis=0)
        inverse_count = tf.math.divide_no_nan(tf.ones_like(total_count), total_count)
        mean = tf.reduce_sum(counts * means, axis=0) * inverse_count
        spread = variances + tf.square(means - mean)
        variance = tf.reduce_sum(counts * spread, axis=0) * inverse_count

        def grad(d_mean, d_variance, d_count):
            del d_count  # the count does not depend on x
            d_mean = tf.zeros_like(mean) if d_mean is None else d_mean
            d_variance = tf.zeros_like(variance) if d_variance is None else d_variance
            group_mean, group_variance = tf.unstack(
                collectives.group_sum(tf.stack([d_mean, d_variance]), groups, latency_bound=True)
            )
            scale = 2.0 * group_variance * inverse_count
            offset = group_mean * inverse_count - scale * mean
            dx = x * tf.reshape(scale, broadcast_shape) + tf.reshape(offset, broadcast_shape)
            if weights is not None:
                dx *= weights
            return dx, None

        return (mean, variance, total_count), grad

    return moments(x, members)


def _fused_normalization(x, mean, variance, gamma, beta, epsilon):
    """`gamma * (x - mean) / sqrt(variance + epsilon) + beta` on NHWC float32, by the fused kernel.

    The kernel in inference mode (`is_training=False`) takes the statistics as given, so any
    statistics work, the group's included; its gradient kernel returns the gradients for `x`,
    `gamma` and `beta`, and those for the statistics follow from two of them: with `inv = (variance
    + epsilon)^(-1/2)`, `d mean = -gamma * inv * sum(dy) = -gamma * inv * d beta` and `d variance =
    -gamma * inv^3 / 2 * sum(dy * (x - mean)) = -gamma * inv^2 / 2 * d gamma`.
    """

    @tf.custom_gradient
    def normalize(x, mean, variance, gamma, beta):
        y, _, _, _, _, _ = tf.raw_ops.FusedBatchNormV3(
            x=x,
            scale=gamma,
            offset=beta,
            mean=mean,
            variance=variance,
            epsilon=epsilon,
            exponential_avg_factor=1.0,
            data_format="NHWC",
            is_training=False,
        )

        def grad(dy):
            dx, d_gamma, d_beta, _, _ = tf.raw_ops.FusedBatchNormGradV3(
                y_backprop=dy,
                x=x,
                scale=gamma,
                reserve_space_1=mean,
                reserve_space_2=variance,
                reserve_space_3=tf.zeros([0], x.dtype),
                epsilon=epsilon,
                data_format="NHWC",
                is_training=False,
            )
            inverse = tf.math.rsqrt(variance + epsilon)
            d_mean = -gamma * inverse * d_beta
            d_variance = -0.5 * gamma * inverse * inverse * d_gamma
            return dx, d_mean, d_variance, d_gamma, d_beta

        return y, grad

    return normalize(x, mean, variance, gamma, beta)


def convert_batch_normalization(model, group_size=None):
    """A copy of `model` whose batch norms, at any depth, are this package's grouped ones.

    Every layer keeps its configuration and every weight is carried over, so the copy computes
    exactly what the original does in inference, and it is of the original's class, with all it
    carries: a keras_hub `ImageClassifier` keeps its preprocessor and head. Layers that already are
    the package's get the new `group_size`. Create the copy under `strategy.scope()` to place its
    variables on the strategy's replicas. The copy is not compiled.

    Plain functional and sequential models are cloned layer by layer, and reload from `.keras`
    with grouped batch norm. A model of a class of its own (a keras_hub `Backbone` or `Task`, a
    user's functional subclass, a layer that builds its own sublayers) is rebuilt from its config;
    the Keras `BatchNormalization` layers its class made then become grouped ones in place. Such a
    class records its arguments, not its layers, so its `.keras` file reloads with Keras's layer
    (inference is identical; the weights load either way): convert the reloaded model again to
    train with groups.

    `tpu_scale.layers.restore_batch_normalization` converts back to Keras's layer, for a model to
    share with users who do not have the package.

    Args:
      model: a `keras.Model`, e.g. `keras.applications.ResNet50()` or a keras_hub
        `ResNetImageClassifier`.
      group_size: the `group_size` of every converted layer (see `DistributedBatchNormalization`).

    Returns:
      A new, uncompiled model of `model`'s class with the same weights.

    Raises:
      ValueError: for a model whose class cannot be rebuilt from its config, naming it and the
        way that works.
    """
    return _converted(model, BatchNormalization, {"group_size": group_size})


def restore_batch_normalization(model):
    """A copy of `model` whose batch norms are Keras's own again: for a model to share with users
    who do not have this package. Inference is identical; the weights carry over.

    Args:
      model: a `keras.Model`, e.g. one made by `convert_batch_normalization`.

    Returns:
      A new, uncompiled model of `model`'s class with the same weights.
    """
    return _converted(model, keras.layers.BatchNormalization, {})


def _converted(model, target, arguments):
    if not isinstance(model, keras.Model):
        raise TypeError(f"Batch-norm conversion expects a keras.Model, got {type(model).__name__}.")
    if keras_hook.clones_as_itself(model):

        def clone(layer):
            if isinstance(layer, keras.Model):
                return _converted(layer, target, arguments)
            config = layer.get_config()
            _check_convertible(layer)
            if type(layer) in (keras.layers.BatchNormalization, BatchNormalization):
                config = {k: v for k, v in config.items() if k not in ("group_size", "virtual_batch_size")}
                return target.from_config({**config, **arguments})
            copy = layer.__class__.from_config(config)
            _convert_in_place(copy, target, arguments)
            return copy

        copy = keras.models.clone_model(model, clone_function=clone)
    else:
        copy = _rebuilt(model)
        _convert_in_place(copy, target, arguments)
    _copy_weights(model, copy)
    return copy


def _rebuilt(model):
    """A fresh instance of `model`'s own class from its config, or a ValueError naming the way."""
    way = "Use BatchNormalization from tpu_scale.layers in its definition instead, or convert the functional parts it is built from (for a keras_hub Task: its backbone) and build it from those."
    try:
        copy = type(model).from_config(model.get_config())
    except Exception as e:  # a class without a config to rebuild it from
        said = " ".join(str(e).split())[:200]  # Keras's own message runs over many lines
        raise ValueError(f"Batch-norm conversion copies a model by rebuilding it from its config, and {type(model).__name__} cannot be ({type(e).__name__}: {said}). Give the class a get_config() that records its arguments, or: {way}") from None
    build_config = model.get_build_config()
    if build_config is not None and not copy.built:  # a subclassed model, built by its first call
        copy.build_from_config(build_config)
    if type(copy) is not type(model):
        raise ValueError(f"Batch-norm conversion copies a model by rebuilding it from its config, and {type(model).__name__}.from_config gives a {type(copy).__name__}: what the class adds would be lost. {way}")
    return copy


def _convert_in_place(layer, target, arguments):
    """Makes every Keras batch norm inside `layer` (a copy the conversion just made, whose class
    built its own sublayers) a `target`, keeping its variables.

    The layers a class creates in its constructor cannot be swapped through a config, only made
    the other class: the package's layer is Keras's with a few attributes more and no other
    state, so the object keeps everything Keras gave it (variables, tracking, name).
    """
    for sublayer in [layer, *keras_hook.all_layers(layer)]:
        _check_convertible(sublayer)
        if type(sublayer) not in (keras.layers.BatchNormalization, BatchNormalization):
            continue
        if target is BatchNormalization:
            if not keras_has_renorm() and getattr(sublayer, "renorm", False):
                raise ValueError(f"Layer {sublayer.name!r} uses batch renormalization, which needs a Keras whose BatchNormalization has it.")
            sublayer.__class__ = BatchNormalization
            sublayer.group_size = _positive_int_or_none(
                arguments["group_size"], "group_size", "replicas per group"
            )
            sublayer.virtual_batch_size = None
            sublayer._resolved = None
        else:
            sublayer.__class__ = keras.layers.BatchNormalization
            for name in ("group_size", "virtual_batch_size", "_resolved"):
                sublayer.__dict__.pop(name, None)


def _check_convertible(layer):
    """A ValueError for a batch norm of a class of its own, which the conversion cannot make
    grouped without losing what that class adds (never left behind unconverted, unsaid)."""
    if isinstance(layer, keras.layers.BatchNormalization) and type(layer) not in (
        keras.layers.BatchNormalization,
        BatchNormalization,
    ):
        raise ValueError(f"Layer {layer.name!r} is a {type(layer).__name__}, a batch norm of a class of its own: the conversion would lose what the class adds. Make the class subclass tpu_scale.layers.BatchNormalization instead of keras.layers.BatchNormalization, and build the model with it.")


def _copy_weights(source, target):
    source_weights, target_weights = source.weights, target.weights
    if len(source_weights) != len(target_weights):
        raise RuntimeError(f"The converted model has {len(target_weights)} weights but the original has {len(source_weights)}; the model may share layers in a way cloning cannot reproduce.")
    for src, dst in zip(source_weights, target_weights):
        if tuple(src.shape) != tuple(dst.shape):
            raise RuntimeError(f"Weight {src.path} {tuple(src.shape)} does not match {dst.path} {tuple(dst.shape)} in the copy: {type(source).__name__}.get_config() does not record everything its layers were built with, so the rebuilt copy differs. Build the model with BatchNormalization from tpu_scale.layers instead, or convert the parts that rebuild exactly.")
        dst.assign(src.value)


# Per model: the variables averaged last time and the compiled step that averages them.
_AVERAGING_STEPS = weakref.WeakKeyDictionary()


def average_moving_statistics(model):
    """Gives every replica the mean over all replicas of the model's batch-norm moving statistics.

    Under a strategy every replica keeps its own copy of a Keras `BatchNormalization` layer's
    moving mean and variance, updated from its own batch, so the copies drift apart (this
    package's `DistributedBatchNormalization` keeps them equal at every step, and needs no call).
    The strategy's `evaluate` normalizes each example with the statistics of the replica it lands
    on, while the saved model, the checkpoints and the model
    called outside `strategy.run` read replica 0's: the same weights would report different
    metrics. After this call every replica holds the mean of the copies, every group weighted by
    its number of replicas (what `tf.keras` read back from its moving statistics). The
    `tpu_scale.callbacks.AverageMovingStatistics` callback calls it wherever `fit` hands the model
    on.

    One all-reduce of every layer's moving statistics, made by the strategy. Under several workers
    every worker must call it at the same point (callbacks do).

    Args:
      model: a Keras model; every built `keras.layers.BatchNormalization` inside it at any depth
        is averaged (not `DistributedBatchNormalization`, whose copies already agree).

    Returns:
      The number of variables averaged: 0 on one replica or without Keras batch normalization.
    """
    strategy = model.distribute_strategy
    if strategy.num_replicas_in_sync == 1:
        return 0
    variables = [
        variable
        for layer in keras_hook.all_layers(model)
        if isinstance(layer, keras.layers.BatchNormalization)
        and not isinstance(layer, DistributedBatchNormalization)
        and layer.built
        for variable in layer.non_trainable_variables
    ]
    if not variables:
        return 0
    key = (strategy, tuple(id(v) for v in variables))
    cached = _AVERAGING_STEPS.get(model)
    if cached is None or cached[0] != key:
        cached = (key, _averaging_step(strategy, variables))
        _AVERAGING_STEPS[model] = cached
    cached[1]()
    return len(variables)


def _averaging_step(strategy, variables):
    sizes = [int(np.prod(v.shape)) for v in variables]

    def average():
        # One flat buffer, one all-reduce: a reduction per variable builds one collective per
        # statistic (two a layer) on every replica.
        flat = tf.concat([tf.reshape(tf.cast(v.value, tf.float32), [-1]) for v in variables], 0)
        replica = tf.distribute.get_replica_context()
        means = tf.split(replica.all_reduce(tf.distribute.ReduceOp.MEAN, flat), sizes)
        for variable, mean in zip(variables, means):
            # A mirrored variable updated in replica context: each replica writes its own copy.
            variable.assign(tf.cast(tf.reshape(mean, variable.shape), variable.dtype))

    @tf.function
    def step():
        strategy.run(average)

    return step
