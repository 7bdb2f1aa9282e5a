"""The Keras seam: the one module that touches Keras's private API, and the map of how it does.

A gradient's path from `model.fit` to the update, under a strategy of `create_strategy`:

1. The optimizer is created under `strategy.scope()` and passed to `compile`: it is Keras's own.
2. `fit` calls the trainer's `_maybe_symbolic_build`, replaced here (`_install_fit_hook`): for a
   model made under a strategy of the package, it adopts the model's optimizer (`adopt`: this
   object's class becomes `Seam` + its own class, so `type()` and `__class__` agree), then Keras
   builds it (`Seam.build`): Keras's own `build`, or with `weight_update_sharding` the same build
   with its slots made 1/N per replica (`weight_update.build`).
3. Each step is `strategy.run(train_step)` (the strategy's public `run`); with
   `gradient_accumulation_steps`, `run_train_step` traces one step per phase and picks one with a
   `tf.cond` in cross-replica context (keras-team/keras#20582).
4. Keras's `train_step` -> `optimizer.apply` -> `Seam._backend_apply_gradients` (the phase's
   branch of Keras's accumulation) -> Keras's clipping, weight decay and `_backend_update_step`.
5. `Seam._all_reduce_sum_gradients`: the torus sum (`torus.all_reduce_sum`: the schedule of
   `torus_schedule`, its phases run by `collectives`); sharded, instead, `sharded_update.update`:
   the same schedule's reduce-scatter phases, the optimizer's own `update_step` on each replica's
   1/N, the all-gather phases.
6. Keras's `_distributed_tf_update_step`: `update_step` per variable (none left when sharded).

Everything an adopted optimizer does differently is in `Seam`; optimizers of models under any
other strategy are untouched, and so is every other model's `fit`. `check_keras()` runs in
`create_strategy()` and fails there, naming the tested range and the fix, when this Keras lacks a
name below (`_NEEDED`).

Every use of `keras.src` and of Keras's private names (Keras versions seen: 3.12.4, 3.15.1,
3.16.0.dev2026102704). One method is replaced, process-wide; no public class's method is:

  what                                        how        why
  TF trainer `_maybe_symbolic_build`          replaced   adopts a package strategy's optimizer
                                                         before Keras builds it; keras-team/
                                                         keras#19246 (evaluate with a partial
                                                         first batch); other models: Keras's own
  `TFEpochIterator._distributed_dataset`      read       that spec, without starting an iterator
  `TFOptimizer._all_reduce_sum_gradients`     overridden the torus sum; the sharded update
  `BaseOptimizer._backend_apply_gradients`    overridden accumulation under strategies (#20582)
  `_backend_increment_gradient_accumulators`, called     Keras's own accumulation steps, in phase
  `_backend_reset_gradient_accumulators`,
  `_clip_gradients`, `_apply_weight_decay`,
  `_backend_update_step`, `_accumulated_gradients`
  `_iterations`, `_get_variable_index`        read       accumulation windows; sharded state
  `_distribution_strategy`                    read       the strategy an optimizer was made under
  `_learning_rate`                            read       `learning_rate_of` (the schedule itself)
  `Model._flatten_layers`, `_initial_epoch`   called/set `all_layers`; resuming `fit` at an epoch
  `Model._compile_metrics._user_metrics`      read       unweighted metrics refused on padded
                                                         evaluation (`check_padded_evaluation`)
  `keras.src.models.functional.Functional`    read       `is_functional_or_sequential`
  `BatchNormalization._moments`               overridden grouped statistics, as Keras's own
                                                         synchronized BN does (layers/)
  `BatchNormalization._reduction_axes`        read       the axes `_moments` reduces
  `_renorm_correction_and_moments`,           called     batch renormalization on group
  `_compose_transforms`,                                 statistics, in Keras's own arithmetic
  `_update_renorm_statistics`                            (Keras versions with `renorm`)
Public ways in: `build`, `add_variable_from_reference`, `update_step`, `save_own_variables` and
`load_own_variables` (Keras's optimizer contract), `Strategy.run`, callbacks.
"""

import dataclasses
import functools
import inspect
import re
import threading
from typing import Optional

import keras
import tensorflow as tf

from tpu_scale import torus, weight_update

# The Keras releases the package is tested on (CI runs the oldest, the current and the nightly).
TESTED_KERAS = ("3.12.4", "3.15.1", "3.16.0.dev2026102704")
SUPPORTED_KERAS = ">=3.12,<3.17"
_SUPPORTED_RANGE = ((3, 12), (3, 17))

GRADIENT_DTYPES = (None, "float32", "bfloat16")
GRADIENT_REDUCTIONS = ("torus", "native")


# --------------------------------------------------------------------------- settings


@dataclasses.dataclass
class Settings:
    """One strategy's training settings: how gradients are summed and whether the update is sharded.

    `create_strategy` makes one and keeps it as `strategy.settings`; the seam reads it there.

    Args:
      reduction: `"torus"` (the package's gradient sum) or `"native"` (the strategy's own).
      algorithm: with `"torus"`: `"auto"` (the planner's choice, `tpu_scale.plan.choose_algorithm`),
        `"native"` or one of `tpu_scale.torus.ALGORITHMS`.
      pack_bytes: size of the fused gradient buffers (`None` or 0: one buffer per dtype).
      gradient_dtype: `"bfloat16"` to carry the phases between hosts in bfloat16 (sums within a host
        stay float32); None or `"float32"`: every phase in the gradients' own dtype.
      weight_update_sharding: True to shard the optimizer's update and state over the replicas
        (`tpu_scale.weight_update`).
    """

    reduction: str = "torus"
    algorithm: str = torus.DEFAULT_ALGORITHM
    pack_bytes: Optional[int] = torus.DEFAULT_PACK_BYTES
    gradient_dtype: Optional[str] = None
    weight_update_sharding: bool = False

    def __post_init__(self):
        if self.reduction not in GRADIENT_REDUCTIONS:
            raise ValueError(f"gradient_reduction={self.reduction!r}; choose one of {GRADIENT_REDUCTIONS}.")
        if self.algorithm != "auto" and self.algorithm not in torus.CHOICES:
            raise ValueError(f"algorithm={self.algorithm!r}; choose 'auto' or one of {torus.CHOICES}.")
        if self.pack_bytes is not None and self.pack_bytes < 0:
            raise ValueError(f"pack_bytes must be positive, or None / 0 for one buffer; got {self.pack_bytes}.")
        if self.gradient_dtype not in GRADIENT_DTYPES:
            raise ValueError(f"gradient_dtype={self.gradient_dtype!r}; choose one of {GRADIENT_DTYPES} (bfloat16 halves the bytes between hosts).")
        if self.gradient_dtype == "float32":
            self.gradient_dtype = None

    @property
    def torus_sum(self):
        """True when `model.fit` sums gradients with the package's torus sum."""
        return self.reduction == "torus"


def settings_for(strategy):
    """The `Settings` of `strategy` (None for a strategy `create_strategy` did not make)."""
    return getattr(strategy, "settings", None) if strategy is not None else None


def install(strategy, settings=None):
    """Gives `strategy` the package's settings (default: the torus sum, "auto" algorithm), so that
    optimizers made under it from now on are adopted; `create_strategy` does this itself."""
    check_keras()
    strategy.settings = settings or Settings()


def uninstall(strategy):
    """Returns `strategy` to Keras's own gradient sum (optimizers made under it from now on)."""
    settings = settings_for(strategy)
    if settings is not None:
        strategy.settings = dataclasses.replace(settings, reduction="native")


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
    ("the TensorFlow trainer's _maybe_symbolic_build", lambda: getattr(_tf_trainer_class(), "_maybe_symbolic_build", None)),
    ("TFOptimizer._all_reduce_sum_gradients", lambda: getattr(_tf_optimizer_class(), "_all_reduce_sum_gradients", None)),
    ("BaseOptimizer._backend_apply_gradients", lambda: getattr(keras.optimizers.Optimizer, "_backend_apply_gradients", None)),
    ("BaseOptimizer._backend_increment_gradient_accumulators", lambda: getattr(keras.optimizers.Optimizer, "_backend_increment_gradient_accumulators", None)),
    ("BaseOptimizer._backend_reset_gradient_accumulators", lambda: getattr(keras.optimizers.Optimizer, "_backend_reset_gradient_accumulators", None)),
    ("BaseOptimizer._clip_gradients", lambda: getattr(keras.optimizers.Optimizer, "_clip_gradients", None)),
    ("BaseOptimizer._get_variable_index", lambda: getattr(keras.optimizers.Optimizer, "_get_variable_index", None)),
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
    seam uses; replaces the trainer's `_maybe_symbolic_build` once (`_install_fit_hook`).

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
    _install_fit_hook()


# --------------------------------------------------------------------------- adoption

_lock = threading.Lock()
_adopted_classes = {}  # a Keras optimizer class -> its adopted subclass (classes only, no state)


def adopt_for_fit(model):
    """Adopts `model`'s optimizer (and a `LossScaleOptimizer`'s inner one) when it was made under a
    strategy of `create_strategy`; every other optimizer stays Keras's own, untouched.

    Runs in `fit`, `evaluate` and `predict` before Keras builds the optimizer (`_install_fit_hook`),
    so a sharded update builds its 1/N state from the start. A program that builds or restores
    the optimizer before `fit` with `weight_update_sharding` (or runs its own loop that calls
    `optimizer.apply` inside `strategy.run`) adopts it first with `adopt(optimizer)`; a sharded
    strategy refuses an optimizer built unadopted, naming that fix.
    """
    optimizer = getattr(model, "optimizer", None)
    for one in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        settings = settings_for(getattr(one, "_distribution_strategy", None))
        if one is None or settings is None or isinstance(one, Seam):
            continue
        if one.built and settings.weight_update_sharding:
            raise ValueError(f"{type(one).__name__} was built before fit (optimizer.build or a restore), so it holds its whole state on every replica although the strategy shards the update (weight_update_sharding=True). Adopt it before building it: tpu_scale.keras_hook.adopt(model.optimizer), then optimizer.build(...) or load_weights(...).")
        adopt(one)


def adopt(optimizer):
    """Makes `optimizer` (made under a strategy of `create_strategy`) run through `Seam`.

    Only this object changes: its class becomes a subclass of its own class and `Seam`, with its
    own class's name and module, so `isinstance`, `get_config` and saved models are unchanged, and
    `type(optimizer)` and `optimizer.__class__` both name the adopted class. An optimizer already
    built (restored before `fit`) starts an accumulation window in progress again
    (`_restart_window`), as one restored after adoption does.
    """
    if isinstance(optimizer, Seam):
        return optimizer
    cls = type(optimizer)
    with _lock:
        adopted = _adopted_classes.get(cls)
        if adopted is None:
            namespace = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
            adopted = type(cls.__name__, (Seam, cls), namespace)
            _adopted_classes[cls] = adopted
    optimizer.__class__ = adopted
    if optimizer.built:
        _restart_window(optimizer)
    return optimizer


def keras_class(optimizer):
    """The optimizer's own class (for an adopted one, the class it was made as)."""
    cls = type(optimizer)
    return cls.__mro__[2] if issubclass(cls, Seam) and cls is not Seam else cls


class Seam:
    """What an optimizer made under a strategy of `create_strategy` does differently.

    Each method runs Keras's own code unless the strategy's `Settings` or a traced accumulation
    phase say otherwise (see the module docstring's map).
    """

    # ----------------------------------------------------------------- build and state

    def build(self, variables):
        strategy = tf.distribute.get_strategy()
        settings = settings_for(strategy)
        if self.built or settings is None or not settings.weight_update_sharding:
            return super().build(variables)
        inner = keras_class(self).from_config(self.get_config())
        weight_update.build(self, variables, strategy, super().build, inner)

    def add_variable_from_reference(self, reference_variable, name=None, initializer="zeros"):
        slot = weight_update.record_slot(self, reference_variable, name)
        if slot is not None:  # a sharded build: the state lives 1/N per replica instead
            return slot
        return super().add_variable_from_reference(reference_variable, name=name, initializer=initializer)

    def save_own_variables(self, store):
        state = weight_update.full_state(self)
        if state is None:
            return super().save_own_variables(store)
        for i, value in enumerate(state):
            store[str(i)] = value

    def load_own_variables(self, store):
        if not weight_update.load_full_state(self, store):
            super().load_own_variables(store)
        _restart_window(self)

    # ----------------------------------------------------------------- the step

    def _all_reduce_sum_gradients(self, grads_and_vars):
        ctx = tf.distribute.get_replica_context()
        settings = settings_for(ctx.strategy) if ctx is not None else None
        if settings is None:
            return super()._all_reduce_sum_gradients(grads_and_vars)
        grads_and_vars = list(grads_and_vars)
        if weight_update.is_sharded(self):
            # The sum, the update and the gather in one: nothing is left for Keras's update.
            indices = [self._get_variable_index(v) for _, v in grads_and_vars]
            weight_update.update(self, ctx, grads_and_vars, indices, self.learning_rate, settings.gradient_dtype)
            return []
        return super()._all_reduce_sum_gradients(grads_and_vars)

    def _backend_apply_gradients(self, grads, trainable_variables):
        phase = getattr(self, "_tpu_scale_phase", None)
        if phase is None or not self.gradient_accumulation_steps:
            return super()._backend_apply_gradients(grads, trainable_variables)
        # Keras's accumulation, one branch at a time (see `run_train_step`).
        accumulators = [self._accumulated_gradients[self._get_variable_index(v)] for v in trainable_variables]
        if phase == _ACCUMULATE:
            self._backend_increment_gradient_accumulators(grads, accumulators)
            return
        steps = self.gradient_accumulation_steps
        grads = [(g + a) / steps for g, a in zip(grads, accumulators)]
        grads = self._clip_gradients(grads)
        self._apply_weight_decay(trainable_variables)
        self._backend_update_step(grads, trainable_variables, self.learning_rate)
        self._backend_reset_gradient_accumulators()


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

_ACCUMULATE, _UPDATE = "accumulate", "update"


def accumulation_needs_phases():
    """True while Keras applies an accumulated update inside a condition in replica context.

    Why: Keras 3 applies it inside `cond(is_update_step, update, accumulate)` in
    `BaseOptimizer._backend_apply_gradients`. Both branches synchronize the replicas (`merge_call`
    for the gradient sum and `extended.update`), which a MirroredStrategy cannot do inside a
    control-flow branch: `RuntimeError: ... merge_call called while defining a new graph or a
    tf.function`. `run_train_step` moves the condition out of the replicas: it traces Keras's train
    step once per phase and picks one with a `tf.cond` in cross-replica context, where a strategy
    may run replica functions inside a branch (as Keras's own `steps_per_execution` loop does);
    `Seam._backend_apply_gradients` does, without the condition, what Keras does in that branch.
    What Keras keeps is unchanged: its counter counts micro-batches, a learning-rate schedule is
    evaluated at the micro-batch count, clipping sees each replica's accumulated gradient before
    the sum, and batch-norm statistics are each micro-batch's.

    Upstream: keras-team/keras#20582 ("Rethink the conditional in the gradient accumulation",
    open); seen with Keras 3.12.4, 3.15.1 and 3.16.0.dev2026102704 on TF 2.21. It turns itself off
    when Keras's `_backend_apply_gradients` no longer branches on `is_update_step`; how to tell it
    can go: `tests/test_accumulation.py::test_keras_own_accumulation_fails_under_a_strategy` fails.
    """
    source = inspect.getsource(keras.optimizers.Optimizer._backend_apply_gradients)
    return "is_update_step" in source and "cond(" in source


def _accumulating_optimizer(fn):
    """The optimizer of the Keras model whose `train_step` `fn` is, when it accumulates; else
    None."""
    model = getattr(fn, "__self__", None)
    if getattr(fn, "__name__", None) != "train_step" or not isinstance(model, keras.Model):
        return None
    optimizer = getattr(model, "optimizer", None)
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)  # a LossScaleOptimizer's
    if optimizer is None or not getattr(optimizer, "gradient_accumulation_steps", None):
        return None
    return optimizer


def run_train_step(run, strategy, fn, args=(), kwargs=None, options=None):
    """`strategy.run(fn, ...)`, with Keras's train step split by accumulation phase.

    Args:
      run: the strategy class's own `run`.
      strategy: the strategy.
      fn, args, kwargs, options: as for `tf.distribute.Strategy.run`.

    Returns:
      What `run` returns.

    Raises:
      ValueError: when the step is compiled with XLA on several logical CPU devices
        (`check_jit_compile`), or accumulation is combined with `use_ema`.
    """
    check_jit_compile(strategy)
    optimizer = _accumulating_optimizer(fn)
    if optimizer is None or not isinstance(optimizer, Seam) or not accumulation_needs_phases():
        return run(fn, args=args, kwargs=kwargs, options=options)
    if optimizer.use_ema:
        raise ValueError(f"{keras_class(optimizer).__name__}(gradient_accumulation_steps={optimizer.gradient_accumulation_steps}, use_ema=True) cannot train under a tf.distribute strategy: Keras updates the moving average in a branch that synchronizes the replicas. Use either gradient_accumulation_steps or use_ema.")

    def phase(name):
        def step():
            optimizer._tpu_scale_phase = name
            try:
                return run(fn, args=args, kwargs=kwargs, options=options)
            finally:
                optimizer._tpu_scale_phase = None

        return step

    steps = optimizer.gradient_accumulation_steps
    is_update = tf.equal((optimizer._iterations + 1) % steps, 0)
    if tf.executing_eagerly():
        return phase(_UPDATE if bool(is_update) else _ACCUMULATE)()
    return tf.cond(is_update, phase(_UPDATE), phase(_ACCUMULATE))


# --------------------------------------------------------------------------- the one replaced
# method: the trainer's `_maybe_symbolic_build`


def build_from_one_replica_needed():
    """True while Keras's trainer learns input shapes from the replicas' mean first batch."""
    method = _tf_trainer_class()._maybe_symbolic_build
    source = inspect.getsource(getattr(method, "_tpu_scale_original", method))
    return '"MEAN"' in source


def _install_fit_hook():
    """Replaces the TensorFlow trainer's private `_maybe_symbolic_build`, once per process.

    It is the one Keras method the package replaces. Keras calls it in `fit`, `evaluate` and
    `predict` before it builds the model and the optimizer. For a model made under a strategy of
    `create_strategy`, the replacement (1) adopts the model's optimizer (`adopt_for_fit`), and (2)
    while Keras needs it, builds from one replica's input shapes (`build_from_one_replica`, the
    workaround for keras-team/keras#19246). Every other model runs Keras's own method unchanged.
    """
    cls = _tf_trainer_class()
    with _lock:
        current = cls._maybe_symbolic_build
        if getattr(current, "_tpu_scale_original", None) is not None:
            return
        one_replica = build_from_one_replica_needed()

        def _maybe_symbolic_build(self, iterator=None, data_batch=None):
            strategy = self._distribute_strategy
            if settings_for(strategy) is not None:
                adopt_for_fit(self)
                check_padded_evaluation(self, iterator)
                if one_replica and iterator is not None:
                    iterator, data_batch = None, build_from_one_replica(strategy, iterator)
            return current(self, iterator=iterator, data_batch=data_batch)

        _maybe_symbolic_build._tpu_scale_original = current
        cls._maybe_symbolic_build = _maybe_symbolic_build


def check_padded_evaluation(model, iterator):
    """Refuses unweighted metrics on an evaluation padded with zero-weight examples.

    `data.exact_evaluation` fills each replica's batch with examples of weight 0; metrics compiled
    as `metrics=` ignore weights and would count them.

    Raises:
      ValueError: naming the metrics and the fix (`weighted_metrics=`).
    """
    dataset = getattr(iterator, "_distributed_dataset", None)
    if not getattr(dataset, "tpu_scale_zero_weight_padding", False):
        return
    compiled = getattr(model, "_compile_metrics", None)
    unweighted = [m for m in tf.nest.flatten(getattr(compiled, "_user_metrics", None)) if m is not None]
    if unweighted:
        names = [m if isinstance(m, str) else getattr(m, "name", type(m).__name__) for m in unweighted]
        raise ValueError(f"This evaluation data (data.exact_evaluation) fills every replica's last batch with examples of weight 0, which the unweighted metrics {names} would count. Compile them as weighted metrics: model.compile(..., weighted_metrics={names!r}) (metrics=None).")


def build_from_one_replica(strategy, iterator):
    """One replica's input shapes for Keras to build a model from, in place of its first batch.

    Why: before training, evaluating or predicting under a strategy, Keras 3 takes the first
    distributed batch and asks the strategy for its mean over the replicas (`strategy.reduce("MEAN",
    batch, axis=None)`), only to learn the input shapes. When the data end within the first global
    batch (a validation set smaller than the global batch), the replicas' batches differ in size,
    some empty, and the mean fails: "Inputs to operation AddN of type AddN must have the same size
    and shape". Keras's own method is handed one replica's shapes as its `data_batch` instead: the
    `tf.TensorSpec`s of the iterator's `element_spec` (a `PerReplicaSpec` splits into one spec per
    local replica with `tf.nest.flatten(..., expand_composites=True)`), with the batch dimension
    left open. The spec is read from the epoch iterator's distributed dataset, so no iterator is
    started (Keras discards the one it looked at and starts a new one for the epoch). Inputs whose
    spec is not one tensor per replica (ragged, sparse) fall back to reading the first batch and
    taking the largest of this process's replica batches.

    Upstream: keras-team/keras#19246; seen with Keras 3.12.4, 3.15.1 and 3.16.0.dev2026102704 on
    TF 2.21. It turns itself off when Keras's method no longer takes that mean
    (`build_from_one_replica_needed`); how to tell it can go:
    `tests/test_workarounds.py::test_evaluate_a_validation_set_smaller_than_the_batch` passes
    with Keras's own `_maybe_symbolic_build`.

    Args:
      strategy: the model's strategy.
      iterator: Keras's epoch iterator.

    Returns:
      The `data_batch` to hand Keras's `_maybe_symbolic_build`.
    """
    dataset = getattr(iterator, "_distributed_dataset", None)
    data_batch = None if dataset is None else _replica_specs(strategy, dataset.element_spec)
    if data_batch is None:
        for _, _, it in iterator:
            data_batch = _replica_specs(strategy, it.element_spec)
            if data_batch is None:
                data_batch = _largest_replica_batch(strategy, next(it))
            break
    return data_batch


def _replica_specs(strategy, element_spec):
    """One replica's `TensorSpec`s, batch dimension open; None unless each input is one dense tensor
    per local replica."""
    replicas = len(strategy.extended.worker_devices)
    specs = []
    for spec in tf.nest.flatten(element_spec):
        parts = [spec] if isinstance(spec, tf.TensorSpec) else tf.nest.flatten(spec, expand_composites=True)
        if len(parts) not in (1, replicas) or not all(isinstance(part, tf.TensorSpec) and part.shape.rank for part in parts):
            return None
        if len(parts) > 1 and len({part.dtype for part in parts}) > 1:
            return None
        specs.append(tf.TensorSpec([None, *parts[0].shape[1:]], parts[0].dtype))
    return tf.nest.pack_sequence_as(element_spec, specs)


def _largest_replica_batch(strategy, batch):
    flat = tf.nest.flatten(batch)
    if not flat or not all(isinstance(v, tf.distribute.DistributedValues) for v in flat):
        return batch
    local = [strategy.experimental_local_results(v) for v in flat]
    sizes = [int(tf.shape(value)[0]) if value.shape.rank else 1 for value in local[0]]
    largest = sizes.index(max(sizes))
    return tf.nest.pack_sequence_as(batch, [values[largest] for values in local])


# --------------------------------------------------------------------------- other Keras internals


def is_functional_or_sequential(model):
    """True for a Keras functional or `Sequential` model: one whose layer graph can be cloned."""
    from keras.src.models.functional import Functional

    return isinstance(model, (keras.Sequential, Functional))


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
