"""LARS: layer-wise adaptive rate scaling, the large-batch optimizer of the recipe."""

import re

import keras
from keras import ops

# Batch-norm scales and offsets and biases: few parameters, no useful notion of a per-layer
# "weight norm" to adapt to, and decaying them only hurts. The rank rule below catches them
# whatever their layer is called; these patterns catch them by name as well.
DEFAULT_EXCLUDE_PATTERNS = ("batch_norm", "bias", "gamma", "beta")


@keras.saving.register_keras_serializable(package="tpu_scale")
class LARS(keras.optimizers.Optimizer):
    """Optimizer that implements LARS (layer-wise adaptive rate scaling).

    Each variable ("layer") gets its own learning rate, scaled by a trust ratio so that
    the size of its update is a fixed fraction of the size of its weights. For a
    variable `w` with gradient `g`:

    ```python
    trust_ratio = eta * norm(w) / (norm(g) + weight_decay * norm(w))
    # trust_ratio = 1 when norm(w) or norm(g) is zero.
    velocity = momentum * velocity + learning_rate * trust_ratio * (g + weight_decay * w)
    w = w - velocity
    ```

    Variables excluded from layer adaptation use `trust_ratio = 1`; variables excluded from
    weight decay use `weight_decay = 0`. By default batch-norm parameters and biases are
    excluded from both, so for them the update is plain momentum SGD:
    `velocity = momentum * velocity + learning_rate * g`.

    Weight decay here is part of the gradient (L2), as in the LARS paper; it is not the
    decoupled decay of `keras.optimizers.AdamW`. Give the model no kernel regularizers when
    `weight_decay` is set, or the penalty is applied twice.

    Example:

    ```python
    hparams = tpu_scale.schedules.reference_lars_hparams(global_batch_size=32768)
    schedule = tpu_scale.schedules.WarmupPolynomialDecay.from_epochs(
        **hparams, total_epochs=72, steps_per_epoch=1281167 // 32768)
    model.compile(optimizer=LARS(schedule, weight_decay=1e-4), ...)
    ```

    Under a `mixed_bfloat16` policy Keras keeps the model variables in float32; the
    velocities are float32 too, and the update is computed in the variable's dtype.

    Args:
        learning_rate: A float, a `keras.optimizers.schedules.LearningRateSchedule`
            (e.g. `tpu_scale.schedules.WarmupPolynomialDecay`) or a callable taking no
            arguments. With LARS this is large (tens): the trust ratio, of order `eta`,
            brings it down. Defaults to `1.0`.
        momentum: Float in `[0, 1)`. Defaults to `0.9`.
        weight_decay: Float >= 0, the L2 coefficient. Defaults to `0.0`.
        eta: Float > 0, the LARS trust coefficient. Defaults to `0.001`.
        exclude_from_weight_decay: List of regular expressions. A variable whose path
            (e.g. `"conv1_bn/gamma"`) matches any of them (`re.search`) gets no weight
            decay. `None` means `DEFAULT_EXCLUDE_PATTERNS`
            (`"batch_norm"`, `"bias"`, `"gamma"`, `"beta"`); `[]` excludes nothing by name.
        exclude_from_layer_adaptation: List of regular expressions, as above, for the
            trust ratio. `None` means the same list as `exclude_from_weight_decay`.
        exclude_vectors: Boolean. If `True`, every variable of rank 0 or 1 (batch-norm
            gammas and betas, biases) is excluded from both weight decay and layer
            adaptation, whatever its name. Defaults to `True`.
        clipnorm, clipvalue, global_clipnorm, use_ema, ema_momentum,
        ema_overwrite_frequency, loss_scale_factor, gradient_accumulation_steps, name:
            as for every `keras.optimizers.Optimizer`.

    Reference:
        - [You et al., 2017](https://arxiv.org/abs/1708.03888)
        - [Ying et al., 2018](https://arxiv.org/abs/1811.06992)
    """

    def __init__(
        self,
        learning_rate=1.0,
        momentum=0.9,
        weight_decay=0.0,
        eta=0.001,
        exclude_from_weight_decay=None,
        exclude_from_layer_adaptation=None,
        exclude_vectors=True,
        clipnorm=None,
        clipvalue=None,
        global_clipnorm=None,
        use_ema=False,
        ema_momentum=0.99,
        ema_overwrite_frequency=None,
        loss_scale_factor=None,
        gradient_accumulation_steps=None,
        name=None,
        **kwargs,
    ):
        momentum = _check_float(
            "momentum", momentum, 0.0, 1.0, high_open=True, hint="use e.g. momentum=0.9"
        )
        weight_decay = _check_float(
            "weight_decay",
            0.0 if weight_decay is None else weight_decay,
            0.0,
            None,
            hint="use e.g. weight_decay=1e-4, or 0.0 for none",
        )
        eta = _check_float("eta", eta, 0.0, None, low_open=True, hint="use e.g. eta=0.001")
        if isinstance(learning_rate, int) and not isinstance(learning_rate, bool):
            # The base class accepts only floats; `LARS(25)` is an obvious intent.
            learning_rate = float(learning_rate)
        super().__init__(
            learning_rate=learning_rate,
            weight_decay=weight_decay,
            clipnorm=clipnorm,
            clipvalue=clipvalue,
            global_clipnorm=global_clipnorm,
            use_ema=use_ema,
            ema_momentum=ema_momentum,
            ema_overwrite_frequency=ema_overwrite_frequency,
            loss_scale_factor=loss_scale_factor,
            gradient_accumulation_steps=gradient_accumulation_steps,
            name=name,
            **kwargs,
        )
        self.momentum = momentum
        self.eta = eta
        self.exclude_vectors = bool(exclude_vectors)
        # Stored under private names: `exclude_from_weight_decay` is also the name of an
        # inherited method, which keeps working (see `_decays`).
        self._wd_patterns = _check_patterns(
            "exclude_from_weight_decay", exclude_from_weight_decay, DEFAULT_EXCLUDE_PATTERNS
        )
        self._adapt_patterns = _check_patterns(
            "exclude_from_layer_adaptation", exclude_from_layer_adaptation, self._wd_patterns
        )

    def build(self, variables):
        """Creates one velocity per variable and decides, once, which rule each follows."""
        if self.built:
            return
        super().build(variables)
        # Decided here, on the Keras variables (whose `path` names the layer), rather than
        # in `update_step`, which sees per-replica `tf.Variable`s under a distribution
        # strategy. Indexed like `self.momentums`.
        self._decay_flags = [self._decays(v) for v in variables]
        self._adapt_flags = [self._adapts(v) for v in variables]
        self.momentums = self.add_optimizer_variables(variables, "momentum")

    def _excluded_by(self, variable, patterns):
        if self.exclude_vectors and len(variable.shape) <= 1:
            return True
        path = getattr(variable, "path", None) or variable.name
        return any(re.search(p, path) for p in patterns)

    def _decays(self, variable):
        """Whether `variable` gets weight decay (also honours `exclude_from_weight_decay()`)."""
        if self.weight_decay == 0.0 or self._excluded_by(variable, self._wd_patterns):
            return False
        return self._use_weight_decay(variable)

    def _adapts(self, variable):
        """Whether `variable` gets a trust ratio."""
        return not self._excluded_by(variable, self._adapt_patterns)

    def _apply_weight_decay(self, variables):
        # The base class would apply decoupled decay (w -= lr * wd * w) before `update_step`;
        # LARS folds the decay into the gradient and the trust ratio instead.
        return

    def layer_factors(self, index, weight_norm, grad_norm):
        """Variable `index`'s learning-rate factor (its trust ratio, or 1 when it is excluded from
        layer adaptation) and weight decay (0 when it is excluded), from its weight and gradient
        norms. With `scaled_update`, the rule in the two parts a sharded update needs
        (`tpu_scale.torus.weight_update`: the norms of a variable split across replicas are summed
        first)."""
        dtype = weight_norm.dtype
        decay = self.weight_decay if self._decay_flags[index] else 0.0
        weight_decay = ops.cast(decay, dtype)
        if not self._adapt_flags[index]:
            return ops.ones_like(weight_norm), weight_decay
        denominator = grad_norm + weight_decay * weight_norm
        # A fresh zero-initialized variable, or one with no gradient this step, has no scale to
        # adapt to: fall back to the plain learning rate rather than 0 or NaN.
        usable = ops.logical_and(ops.greater(weight_norm, 0.0), ops.greater(grad_norm, 0.0))
        safe_denominator = ops.where(usable, denominator, ops.ones_like(denominator))
        trust_ratio = ops.where(
            usable,
            ops.cast(self.eta, dtype) * weight_norm / safe_denominator,
            ops.ones_like(weight_norm),
        )
        return trust_ratio, weight_decay

    def scaled_update(self, gradient, variable, rate, weight_decay):
        """The element-wise part of the rule: `velocity = momentum * velocity + rate * (gradient +
        weight_decay * variable)`, `variable -= velocity`, with `rate` the learning rate times the
        layer's factor (scalars, or one value per element)."""
        dtype = variable.dtype
        velocity = self.momentums[self._get_variable_index(variable)]
        update = ops.cast(gradient, dtype) + weight_decay * ops.convert_to_tensor(variable)
        self.assign(
            velocity,
            ops.add(
                ops.multiply(velocity, ops.cast(self.momentum, dtype)),
                ops.multiply(update, rate),
            ),
        )
        self.assign_sub(variable, velocity)

    def update_step(self, gradient, variable, learning_rate):
        """Update step given gradient and the associated model variable."""
        index = self._get_variable_index(variable)
        dtype = variable.dtype
        gradient = ops.cast(ops.convert_to_tensor(gradient), dtype)
        weights = ops.convert_to_tensor(variable)
        factor, weight_decay = self.layer_factors(
            index, ops.sqrt(ops.sum(ops.square(weights))), ops.sqrt(ops.sum(ops.square(gradient)))
        )
        self.scaled_update(gradient, variable, ops.cast(learning_rate, dtype) * factor, weight_decay)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "momentum": self.momentum,
                "eta": self.eta,
                "exclude_from_weight_decay": list(self._wd_patterns),
                "exclude_from_layer_adaptation": list(self._adapt_patterns),
                "exclude_vectors": self.exclude_vectors,
            }
        )
        return config


def _check_float(name, value, low, high, low_open=False, high_open=False, hint=""):
    """Returns `value` as a float, or raises a ValueError naming the allowed range."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"`{name}` must be a number; received {name}={value!r}: {hint}.") from None
    too_low = value <= low if low_open else value < low
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high:
        interval = (
            ("(" if low_open else "[")
            + f"{low}, "
            + ("inf)" if high is None else f"{high}" + (")" if high_open else "]"))
        )
        raise ValueError(f"`{name}` must be in {interval}; received {name}={value}: {hint}.")
    return value


def _check_patterns(name, patterns, default):
    if patterns is None:
        return tuple(default)
    if isinstance(patterns, str):
        raise ValueError(f"`{name}` must be a list of regular expressions, not a string; received {name}={patterns!r}: use {name}=[{patterns!r}].")
    patterns = tuple(patterns)
    for p in patterns:
        try:
            re.compile(p)
        except (re.error, TypeError) as e:
            raise ValueError(f"`{name}` contains {p!r}, which is not a valid regular expression ({e}): fix or remove it.") from None
    return patterns
