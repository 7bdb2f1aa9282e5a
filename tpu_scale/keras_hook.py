"""The Keras seam: the one module that touches Keras's private API, and the map of how it does.

A gradient's path from `model.fit` (or any program) to the update, under a strategy of
`create_strategy`:

1. Keras's `train_step`, or the user's own, calls `optimizer.apply`: Keras's own optimizer, or
   `DistributedOptimizer` around it when the run shards the update or accumulates gradients.
2. Keras's `_all_reduce_sum_gradients` asks the replica context for the sum; TensorFlow hands it to
   the strategy's cross-device ops, `tpu_scale.TorusAllReduce` (`torus/all_reduce.py`): the schedule of
   `torus_schedule`, its phases run by `collectives`. No Keras code is involved in the sum.
3. `DistributedOptimizer` with `weight_update_sharding`: the same schedule's reduce-scatter phases,
   the optimizer's own `update_step` on each replica's 1/N, the all-gather phases
   (`weight_update`, `sharded_update`); with `gradient_accumulation_steps`, one merge call per
   micro-batch and the window's condition in cross-replica context (`accumulation_needs_phases`).

No Keras class is changed and no optimizer's class is; `check_keras()` runs in `create_strategy()`
and fails there, naming the tested range and the fix, when this Keras lacks a name below
(`_NEEDED`).

Every use of `keras.src` and of Keras's private names (Keras versions seen: 3.12.4, 3.15.1,
3.16.0.dev2026102704). None is replaced:

  what                                        how        why
  `_backend_increment_gradient_accumulators`, called     `DistributedOptimizer`: Keras's own steps
  `_backend_reset_gradient_accumulators`,     on the     of `apply`, one accumulation phase at a
  `_clip_gradients`, `_apply_weight_decay`,   wrapped    time (#20582), and the update around a
  `_backend_update_step`, `_filter_empty_     optimizer  sharded one
  gradients`, `_overwrite_variables_directly_
  with_gradients`, `_update_model_variables_
  moving_average`, `_overwrite_model_
  variables_with_average_value`
  `add_variable_from_reference`               shadowed   a sharded build records the slots Keras
                                              on the     would make (`weight_update.record_slot`),
                                              wrapped    for the length of that `build` call only
                                              object
  `_accumulated_gradients`, `_iterations`,    read/set   accumulation windows; sharded state
  `_get_variable_index`, `_trainable_variables`
  `BaseOptimizer._backend_apply_gradients`    read       whether Keras still branches in replica
                                                         context (`accumulation_needs_phases`)
  `_distribution_strategy`                    read       the strategy an optimizer was made under
  `_learning_rate`                            read       `learning_rate_of` (the schedule itself)
  `Model._flatten_layers`, `_initial_epoch`   called/set `all_layers`; resuming `fit` at an epoch
  `keras.src.models.functional.Functional`    read       `is_functional_or_sequential`,
                                                         `clones_as_itself`
  `BatchNormalization._moments`               overridden grouped statistics, as Keras's own
                                              (subclass) synchronized BN does (layers/)
  `BatchNormalization._reduction_axes`        read       the axes `_moments` reduces
  `_renorm_correction_and_moments`,           called     batch renormalization on group
  `_compose_transforms`,                                 statistics, in Keras's own arithmetic
  `_update_renorm_statistics`                            (Keras versions with `renorm`)
Public ways in: `build`, `update_step`, `save_own_variables` and `load_own_variables` (Keras's
optimizer contract), `Strategy.run`, callbacks.
"""

import dataclasses
import functools
import inspect
import re
from typing import Optional

import keras
import tensorflow as tf

from tpu_scale.torus import all_reduce as torus

# The Keras releases the package is tested on (CI runs the oldest, the current and the nightly).
from tpu_scale.torus import weight_update

TESTED_KERAS = ("3.12.4", "3.15.1", "3.16.0.dev2026102704")
SUPPORTED_KERAS = ">=3.12,<3.17"
_SUPPORTED_RANGE = ((3, 12), (3, 17))

GRADIENT_DTYPES = (None, "float32", "bfloat16")
GRADIENT_REDUCTIONS = ("torus", "native")


# --------------------------------------------------------------------------- settings


@dataclasses.dataclass
class Settings:
    """One strategy's gradient-sum settings, as `create_strategy` declared them.

    `create_strategy` makes one and keeps it as `strategy.settings`; the seam reads it there.

    Args:
      reduction: `"torus"` (the package's gradient sum) or `"native"` (the strategy's own).
      algorithm: with `"torus"`: `"auto"` (`torus.resolve_algorithm`'s rule for the hardware),
        `"native"` or one of `tpu_scale.torus.all_reduce.ALGORITHMS`.
      pack_bytes: size of the fused gradient buffers (`None` or 0: one buffer per dtype).
      gradient_dtype: `"bfloat16"` to carry the phases between hosts in bfloat16 (sums within a host
        stay float32); None or `"float32"`: every phase in the gradients' own dtype.
    """

    reduction: str = "torus"
    algorithm: str = torus.DEFAULT_ALGORITHM
    pack_bytes: Optional[int] = torus.DEFAULT_PACK_BYTES
    gradient_dtype: Optional[str] = None

    def __post_init__(self):
        if self.reduction not in GRADIENT_REDUCTIONS:
            raise ValueError(f"gradient_reduction={self.reduction!r}; choose one of {GRADIENT_REDUCTIONS}.")
        if self.algorithm not in torus.GRADIENT_ALGORITHMS:
            raise ValueError(f"algorithm={self.algorithm!r}; choose one of {torus.GRADIENT_ALGORITHMS}.")
        if self.pack_bytes is not None and self.pack_bytes < 0:
            raise ValueError(f"pack_bytes must be positive, or None / 0 for one buffer; got {self.pack_bytes}.")
        if self.gradient_dtype not in GRADIENT_DTYPES:
            raise ValueError(f"gradient_dtype={self.gradient_dtype!r}; choose one of {GRADIENT_DTYPES} (bfloat16 halves the bytes between hosts).")
        if self.gradient_dtype == "float32":
            self.gradient_dtype = None

    @property
    def torus_sum(self):
        """True when the strategy sums with the package's torus sum (`TorusAllReduce`)."""
        return self.reduction == "torus"


def settings_for(strategy):
    """The `Settings` of `strategy` (None for a strategy `create_strategy` did not make)."""
    return getattr(strategy, "settings", None) if strategy is not None else None


# --------------------------------------------------------------------------- start-up checks


def _tf_trainer_class():
    """Keras's TensorFlow trainer class (named `TensorFlowTrainer` up to 3.15, `Trainer` after)."""
    for cls in keras.Model.__mro__:
        if cls.__module__ == "keras.src.backend.tensorflow.trainer":
            return cls
    return None


def _tf_optimizer_class():
    try:
        from keras.src.backend.tensorflow.optimizer import TFOptimizer
    except ImportError:
        return None
    return TFOptimizer


_NEEDED = (
    ("TFOptimizer", lambda: _tf_optimizer_class()),
    ("BatchNormalization._moments", lambda: getattr(keras.layers.BatchNormalization, "_moments", None)),
    ("BaseOptimizer._backend_apply_gradients", lambda: getattr(keras.optimizers.Optimizer, "_backend_apply_gradients", None)),
    *(
        # The steps of Keras's `apply` that `DistributedOptimizer` runs on the inner optimizer.
        (f"BaseOptimizer.{name}", lambda name=name: getattr(keras.optimizers.Optimizer, name, None))
        for name in (
            "_backend_increment_gradient_accumulators", "_backend_reset_gradient_accumulators",
            "_clip_gradients", "_apply_weight_decay", "_backend_update_step", "_get_variable_index",
            "_filter_empty_gradients", "_overwrite_variables_directly_with_gradients",
            "_update_model_variables_moving_average", "_overwrite_model_variables_with_average_value",
        )
    ),
    ("Model._flatten_layers", lambda: getattr(keras.Model, "_flatten_layers", None)),
    *(
        # Batch renormalization's steps, in the Keras versions that have it (3.12 has not).
        (f"BatchNormalization.{name}", lambda name=name: getattr(keras.layers.BatchNormalization, name, None) if keras_has_renorm() else True)
        for name in ("_renorm_correction_and_moments", "_compose_transforms", "_update_renorm_statistics")
    ),
)


@functools.cache
def keras_has_renorm():
    """Whether this Keras's `BatchNormalization` has batch renormalization (Keras 3.12 has not)."""
    return "renorm" in inspect.signature(keras.layers.BatchNormalization.__init__).parameters


def keras_version():
    """This Keras's (major, minor) version."""
    found = re.match(r"(\d+)\.(\d+)", keras.__version__)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


def _version_message(problem):
    return f"tpu_scale cannot train with Keras {keras.__version__}: {problem}. The package supports keras{SUPPORTED_KERAS} (tested with {', '.join(TESTED_KERAS)}): pip install 'keras{SUPPORTED_KERAS}'."


def check_keras():
    """Checks, at start-up, that this Keras is in the supported range and has every private name the
    seam uses.

    Raises:
      ImportError: naming the supported range, the tested versions and the fix (pin Keras).
    """
    low, high = _SUPPORTED_RANGE
    if not low <= keras_version() < high:
        raise ImportError(_version_message("this version is outside the supported range"))
    if keras.backend.backend() != "tensorflow":
        raise ImportError(f"tpu_scale trains with Keras's TensorFlow backend; KERAS_BACKEND is {keras.backend.backend()!r}. Set KERAS_BACKEND=tensorflow before importing Keras.")
    missing = [name for name, find in _NEEDED if find() is None]
    if missing:
        raise ImportError(_version_message(f"{', '.join(missing)} not found"))


# --------------------------------------------------------------------------- the wrapper


@keras.saving.register_keras_serializable(package="tpu_scale")
class DistributedOptimizer(keras.optimizers.Optimizer):
    """An optimizer that does under a `tf.distribute` strategy what a plain Keras one cannot.

    Wraps the user's optimizer, as Keras's `LossScaleOptimizer` does: it holds it
    (`inner_optimizer`), delegates `build`, the update (`update_step`), the learning rate and the
    step counter to it, and serializes as itself (`tpu_scale>DistributedOptimizer`, which loads in
    any process that imports `tpu_scale`). The gradient sum needs no wrapper: every strategy of
    `create_strategy` sums with `tpu_scale.TorusAllReduce`. Two things do:

    * `weight_update_sharding=True`: each of the N replicas runs the optimizer's own `update_step`
      on 1/N of the weights and holds 1/N of its state, between the reduce-scatter and the
      all-gather of the torus sum (`tpu_scale.torus.weight_update`; element-wise Keras optimizers and
      `tpu_scale.optimizers.LARS`). Checkpoints keep Keras's unsharded layout.
    * the inner optimizer's `gradient_accumulation_steps=k` under a strategy
      (keras-team/keras#20582): each replica accumulates its local gradients for k micro-batches,
      the cross-replica sum runs once per k, then the update. Keras updates inside a condition in
      replica context, where a strategy cannot synchronize its replicas; here the condition is in
      cross-replica context (as `LossScaleOptimizer` places its own), and each branch runs Keras's
      own steps on the replicas. Keras's counter counts micro-batches, a learning-rate schedule is
      evaluated at that count, clipping sees each replica's accumulated gradient before the sum,
      and batch-norm statistics are each micro-batch's, as in Keras.

    Everything else is the inner optimizer's own `apply`. Without a strategy (or with one replica)
    it is the inner optimizer.

        with strategy.scope():
            optimizer = tpu_scale.DistributedOptimizer(
                keras.optimizers.SGD(0.1, momentum=0.9, gradient_accumulation_steps=4),
                weight_update_sharding=True)
            model.compile(optimizer=optimizer, ...)

    Args:
      inner_optimizer: the `keras.optimizers.Optimizer` to wrap.
      weight_update_sharding: True to shard the update over the strategy's replicas.
      name: the wrapper's name.
    """

    def __init__(self, inner_optimizer, weight_update_sharding=False, name=None, **kwargs):
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise ValueError(f"DistributedOptimizer wraps a keras.optimizers.Optimizer; got {type(inner_optimizer).__name__}.")
        if isinstance(inner_optimizer, DistributedOptimizer):
            raise ValueError("This optimizer is already a tpu_scale.DistributedOptimizer: wrap it once.")
        unknown = {k: v for k, v in kwargs.items() if v not in (None, False) and k != "learning_rate"}
        if unknown:
            raise ValueError(f"DistributedOptimizer takes no {', '.join(unknown)}: set them on the optimizer it wraps.")
        super().__init__(learning_rate=0.0, name=name or "distributed_optimizer")
        self.inner_optimizer = inner_optimizer
        self.weight_update_sharding = bool(weight_update_sharding)

    # ----------------------------------------------------------------- Keras's contract

    def build(self, var_list):
        strategy = tf.distribute.get_strategy()
        if self.weight_update_sharding and strategy.num_replicas_in_sync > 1:
            self._build_sharded(list(var_list), strategy)
        else:
            self.inner_optimizer.build(var_list)
        super().build(var_list)

    def _build_sharded(self, variables, strategy):
        # The inner optimizer's own `build` runs as Keras wrote it, with its slots recorded
        # (`weight_update.record_slot`) instead of made: for the length of that call its
        # `add_variable_from_reference` is shadowed on this one object, and nothing else changes.
        inner = self.inner_optimizer
        weight_update.check_strategy(strategy)
        own = inner.add_variable_from_reference

        def add_variable_from_reference(reference_variable, name=None, initializer="zeros"):
            slot = weight_update.record_slot(inner, reference_variable, name)
            return slot if slot is not None else own(reference_variable, name=name, initializer=initializer)

        object.__setattr__(inner, "add_variable_from_reference", add_variable_from_reference)
        try:
            shard_optimizer = type(inner).from_config(inner.get_config())
            weight_update.build(inner, variables, strategy, inner.build, shard_optimizer)
        finally:
            object.__delattr__(inner, "add_variable_from_reference")

    @property
    def variables(self):
        # The inner optimizer's, as Keras lays them out: a checkpoint moves between a wrapped and an
        # unwrapped optimizer (the wrapper's own counter and rate are never used).
        return self.inner_optimizer.variables

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    def save_own_variables(self, store):
        # A sharded inner optimizer saves Keras's unsharded layout, gathered from the replicas.
        state = weight_update.full_state(self.inner_optimizer)
        if state is None:
            return self.inner_optimizer.save_own_variables(store)
        for i, value in enumerate(state):
            store[str(i)] = value

    def load_own_variables(self, store):
        if not weight_update.load_full_state(self.inner_optimizer, store):
            self.inner_optimizer.load_own_variables(store)
        # Keras loads the inner optimizer again after this (it walks the wrapper's attributes), so
        # a window in progress starts again when the next step is traced (`_restart_window`).
        self._restart_pending = True

    def get_config(self):
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "weight_update_sharding": self.weight_update_sharding,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"), custom_objects=custom_objects)
        return cls(inner, **config)

    # ----------------------------------------------------------------- the step

    def apply(self, grads, trainable_variables=None):
        inner = self.inner_optimizer
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        ctx = tf.distribute.get_replica_context()
        sharded = weight_update.is_sharded(inner)
        steps = inner.gradient_accumulation_steps
        if ctx is None or ctx.num_replicas_in_sync < 2 or not (sharded or steps):
            return inner.apply(grads, trainable_variables)
        variables = list(trainable_variables) if trainable_variables is not None else list(inner._trainable_variables)
        # What Keras's `apply` does before its update, then the update this wrapper exists for.
        grads, variables = inner._filter_empty_gradients(list(grads), variables)
        grads, variables = inner._overwrite_variables_directly_with_gradients(grads, variables)
        if not grads:
            inner._iterations.assign_add(1)
            return
        if inner.loss_scale_factor is not None:
            grads = [g if g is None else g / inner.loss_scale_factor for g in grads]
        if not steps:
            return self._update(grads, variables)
        if inner.use_ema:
            raise ValueError(f"{type(inner).__name__}(gradient_accumulation_steps={steps}, use_ema=True) cannot train under a tf.distribute strategy: Keras updates the moving average in a branch that synchronizes the replicas. Use either gradient_accumulation_steps or use_ema.")
        ctx.merge_call(lambda strategy, grads: self._window_step(strategy, grads, variables), args=(grads,))

    def _window_step(self, strategy, grads, variables):
        """In cross-replica context: one micro-batch of an accumulation window, the window's update
        on its last (`accumulation_needs_phases`)."""
        inner = self.inner_optimizer
        if getattr(self, "_restart_pending", False):
            self._restart_pending = False
            with tf.init_scope():  # now, once, outside the step being traced
                _restart_window(inner)
        is_update = tf.equal((inner._iterations + 1) % inner.gradient_accumulation_steps, 0)

        def update():
            strategy.extended.call_for_each_replica(lambda g: self._update_window(g, variables), args=(grads,))

        def accumulate():
            strategy.extended.call_for_each_replica(lambda g: self._accumulate(g, variables), args=(grads,))

        if tf.executing_eagerly():
            return update() if bool(is_update) else accumulate()
        tf.cond(is_update, update, accumulate)

    def _accumulators(self, variables):
        inner = self.inner_optimizer
        return [inner._accumulated_gradients[inner._get_variable_index(v)] for v in variables]

    def _accumulate(self, grads, variables):
        inner = self.inner_optimizer
        inner._backend_increment_gradient_accumulators(grads, self._accumulators(variables))
        inner._iterations.assign_add(1)

    def _update_window(self, grads, variables):
        inner = self.inner_optimizer
        steps = inner.gradient_accumulation_steps
        grads = [(g + a) / steps for g, a in zip(grads, self._accumulators(variables))]
        self._update(grads, variables)
        inner._backend_reset_gradient_accumulators()

    def _update(self, grads, variables):
        """Keras's update of `apply`, in its order (clipping, weight decay, the update, the moving
        average, constraints, the counter), with a sharded inner optimizer's update sharded."""
        inner = self.inner_optimizer
        grads = inner._clip_gradients(grads)
        inner._apply_weight_decay(variables)
        if weight_update.is_sharded(inner):
            # The optimizer's own step bookkeeping first (Nadam's `u_product`, which its shard
            # optimizer shares), on no variables; then the sharded sum, update and gather.
            inner._backend_update_step([], [], inner.learning_rate)
            ctx = tf.distribute.get_replica_context()
            indices = [inner._get_variable_index(v) for v in variables]
            settings = settings_for(ctx.strategy)
            dtype = settings.gradient_dtype if settings is not None else None
            weight_update.update(inner, ctx, list(zip(grads, variables)), indices, inner.learning_rate, dtype)
        else:
            inner._backend_update_step(grads, variables, inner.learning_rate)
        if inner.use_ema:
            inner._update_model_variables_moving_average(inner._trainable_variables)
            if inner.ema_overwrite_frequency:
                tf.cond(
                    tf.equal((inner.iterations + 1) % inner.ema_overwrite_frequency, 0),
                    lambda: inner._overwrite_model_variables_with_average_value(inner._trainable_variables),
                    lambda: None,
                )
        for variable in variables:
            if variable.constraint is not None:
                variable.assign(variable.constraint(variable))
        inner._iterations.assign_add(1)


def _restart_window(optimizer):
    """After a restore under several replicas, an accumulation window in progress starts again.

    Each replica accumulates its own local gradients, but a saved accumulator holds only the first
    replica's: restoring it into every replica would count that replica's partial sum once per
    replica. So after a restore in the middle of a window the accumulators are zeroed and the step
    counter goes back to the window's start: the window's micro-batches seen before the save are
    dropped, and the next `gradient_accumulation_steps` micro-batches form a full window.
    `optimizer.iterations` (and so every completed update) is unchanged.
    """
    steps = optimizer.gradient_accumulation_steps
    strategy = getattr(optimizer, "_distribution_strategy", None)
    if not steps or strategy is None or strategy.num_replicas_in_sync < 2:
        return
    done = int(optimizer._iterations.numpy())
    if done % steps:
        optimizer._iterations.assign(done - done % steps)
        optimizer._backend_reset_gradient_accumulators()


# --------------------------------------------------------------------------- a workaround: Keras
# gradient accumulation under a strategy (indexed in _workarounds.py)

def accumulation_needs_phases():
    """True while Keras applies an accumulated update inside a condition in replica context.

    Why: Keras 3 applies it inside `cond(is_update_step, update, accumulate)` in
    `BaseOptimizer._backend_apply_gradients`. Both branches synchronize the replicas (`merge_call`
    for the gradient sum and `extended.update`), which a MirroredStrategy cannot do inside a
    control-flow branch: `RuntimeError: ... merge_call called while defining a new graph or a
    tf.function`. `DistributedOptimizer` moves the condition out of the replicas: one merge call
    per micro-batch, a `tf.cond` in cross-replica context, and in each branch Keras's own steps run
    on the replicas (`DistributedOptimizer._window_step`), as Keras's `LossScaleOptimizer` places
    its own condition. A plain optimizer with `gradient_accumulation_steps` under a strategy of the
    package fails while its step is traced, naming the wrapper (`strategy.run`).

    Upstream: keras-team/keras#20582 ("Rethink the conditional in the gradient accumulation",
    open); seen with Keras 3.12.4, 3.15.1 and 3.16.0.dev2026102704 on TF 2.21. It turns itself off
    when Keras's `_backend_apply_gradients` no longer branches on `is_update_step`; how to tell it
    can go: `tests/test_accumulation.py::test_keras_own_accumulation_fails_under_a_strategy` fails.
    """
    source = inspect.getsource(keras.optimizers.Optimizer._backend_apply_gradients)
    return "is_update_step" in source and "cond(" in source


# --------------------------------------------------------------------------- other Keras internals


def is_functional_or_sequential(model):
    """True for a Keras functional or `Sequential` model, or an instance of a subclass of either."""
    from keras.src.models.functional import Functional

    return isinstance(model, (keras.Sequential, Functional))


def clones_as_itself(model):
    """True for a model `keras.models.clone_model` copies into its own class: a plain functional
    or `Sequential` model. (It rebuilds a functional subclass, such as a keras_hub `Task` or
    `Backbone`, as a plain `Functional`, without what its class adds.)"""
    from keras.src.models.functional import Functional

    return type(model) in (keras.Sequential, Functional)


def all_layers(model):
    """Every layer inside `model`, at any depth (nested models and layers that hold layers)."""
    return model._flatten_layers(include_self=False, recursive=True)


def set_initial_epoch(model, epoch):
    """Makes the running (or next) `model.fit` start at `epoch`; None restores `fit`'s own argument.

    Keras's own `BackupAndRestore` resumes this way: `fit` reads `model._initial_epoch` after the
    callbacks' `on_train_begin`.
    """
    model._initial_epoch = epoch


def learning_rate_of(optimizer):
    """The optimizer's learning rate as it was given (a float or a schedule), or None."""
    return getattr(optimizer, "_learning_rate", None)


def check_jit_compile(strategy):
    """Raises a clear error before a step compiled with XLA runs on several logical CPU devices.

    XLA compiles the whole step for one device, and cannot reach the variables the other logical
    CPU devices of the process hold ("Trying to access resource .../replica_1/... from device
    CPU:0"). Such a step fails at its first run, whatever the gradient sum.

    Args:
      strategy: the strategy about to run a replica function.

    Raises:
      ValueError: inside a function compiled with XLA (`compile(jit_compile=True)`,
        `tf.function(jit_compile=True)`) when more than one of `strategy`'s local replicas is a
        CPU device.
    """
    if tf.executing_eagerly():
        return
    from tpu_scale.tf_seam import control_flow_util

    if not control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        return
    devices = strategy.extended.worker_devices
    cpus = [d for d in devices if tf.DeviceSpec.from_string(d).device_type in (None, "CPU")]
    if len(cpus) > 1:
        raise ValueError(f"jit_compile=True cannot run on {len(cpus)} logical CPU replicas: XLA compiles the step for one device and cannot place the other replicas' variables on it (TensorFlow fails with 'Trying to access resource ... from device CPU:0'). Compile with jit_compile=False (model.compile(..., jit_compile=False)), or use one CPU replica (create_strategy(num_cpu_replicas=1)); XLA works on TPU and GPU replicas.")
