"""The one module that touches Keras's private API: routes `model.fit`'s gradient sum to the torus
sum.

Every Keras 3 optimizer on the TensorFlow backend sums its gradients in
`keras.src.backend.tensorflow.optimizer.TFOptimizer._all_reduce_sum_gradients`, in replica context,
under every `tf.distribute` strategy (TPU included). `install(strategy, ...)` replaces that method
once per process and registers the strategy with its settings; the replacement runs
`tpu_scale.torus.all_reduce_sum` only for registered strategies, and Keras's own code for every
other one. `create_strategy` registers the strategies it makes with `gradient_reduction="torus"`;
users never call this module themselves.

It also holds the package's other uses of Keras internals: `is_functional_or_sequential(model)`
(Keras exports no name for its functional model class), `all_layers(model)` (every nested layer),
`set_initial_epoch(model, epoch)` (how a backup callback tells `fit` where to resume, as Keras's
own BackupAndRestore does), `learning_rate_of(optimizer)` (the schedule itself, not its current
value), `check_jit_compile(strategy)` (XLA on several logical CPU replicas: a clear error before the
first step) and two workarounds, indexed with the others in `_workarounds.py`:
`build_from_one_replica` (keras-team/keras#19246) and `accumulation_under_strategies`
(keras-team/keras#20582: `gradient_accumulation_steps` under a strategy; the strategies of
`create_strategy` call `run_train_step` from their `run`).

Keras versions: the hook needs `TFOptimizer._all_reduce_sum_gradients` and the module function
`filter_empty_gradients`; `check_keras()` fails with the versions that have them when they are
missing.
"""

import threading
import weakref

import keras
import tensorflow as tf

from tpu_scale import torus, weight_update

TESTED_KERAS = "3.15"
SUPPORTED_KERAS = ">=3.3,<4"

_lock = threading.Lock()
_settings = weakref.WeakKeyDictionary()  # strategy -> Settings


GRADIENT_DTYPES = (None, "float32", "bfloat16")


class Settings:
    """How one strategy's gradients are summed: the algorithm, the fused buffer size, the wire
    dtype.

    Args:
      algorithm: `"auto"` (the planner's choice, see `tpu_scale.plan.choose_algorithm`), `"native"`
        or one of `tpu_scale.torus.ALGORITHMS`.
      pack_bytes: size of the fused gradient buffers (`None` or 0: one buffer per dtype).
      gradient_dtype: `"bfloat16"` to carry the phases between hosts in bfloat16 (sums within a host
        stay float32); None or `"float32"`: every phase in the gradients' own dtype.
    """

    def __init__(
        self,
        algorithm=torus.DEFAULT_ALGORITHM,
        pack_bytes=torus.DEFAULT_PACK_BYTES,
        gradient_dtype=None,
    ):
        if algorithm != "auto" and algorithm not in torus.CHOICES:
            raise ValueError(f"algorithm={algorithm!r}; choose 'auto' or one of {torus.CHOICES}.")
        if pack_bytes is not None and pack_bytes < 0:
            raise ValueError(
                f"pack_bytes must be positive, or None / 0 for one buffer; got {pack_bytes}."
            )
        if gradient_dtype not in GRADIENT_DTYPES:
            raise ValueError(
                f"gradient_dtype={gradient_dtype!r}; choose one of {GRADIENT_DTYPES} (bfloat16 "
                "halves "
                f"the bytes between hosts)."
            )
        self.algorithm = algorithm
        self.pack_bytes = pack_bytes
        self.gradient_dtype = None if gradient_dtype == "float32" else gradient_dtype

    def __repr__(self):
        return (
            f"Settings(algorithm={self.algorithm!r}, pack_bytes={self.pack_bytes}, "
            f"gradient_dtype={self.gradient_dtype!r})"
        )


def _keras_optimizer_module():
    """Keras's TensorFlow optimizer module, checked for what the hook replaces."""
    try:
        from keras.src.backend.tensorflow import optimizer as module
    except ImportError as e:
        raise ImportError(
            _version_message(f"keras.src.backend.tensorflow.optimizer is missing ({e})")
        ) from e
    missing = [
        name
        for name, present in (
            (
                "TFOptimizer._all_reduce_sum_gradients",
                hasattr(getattr(module, "TFOptimizer", None), "_all_reduce_sum_gradients"),
            ),
            ("filter_empty_gradients", hasattr(module, "filter_empty_gradients")),
        )
        if not present
    ]
    if missing:
        raise ImportError(_version_message(f"{', '.join(missing)} not found"))
    return module


def _version_message(problem):
    return (
        f"tpu_scale's model.fit gradient sum cannot hook into Keras {keras.__version__}: "
        f"{problem}. "
        f"Install a Keras 3 release the package supports (pip install 'keras{SUPPORTED_KERAS}'; "
        "tested with "
        f"{TESTED_KERAS}), or create the strategy with gradient_reduction='native'."
    )


def check_keras():
    """Raises ImportError naming the supported Keras versions if the hook cannot be installed."""
    _keras_optimizer_module()


def _all_reduce_sum_gradients(self, grads_and_vars):
    """Keras's gradient sum, done by `torus.all_reduce_sum` for registered strategies."""
    import tensorflow as tf

    ctx = tf.distribute.get_replica_context()
    settings = _settings.get(ctx.strategy) if ctx is not None else None
    if settings is None:
        return _all_reduce_sum_gradients.original(self, grads_and_vars)
    grads_and_vars = list(grads_and_vars)
    # Keras's own filter: warns about missing gradients, raises when there are none.
    _keras_optimizer_module().filter_empty_gradients(grads_and_vars)
    summed = torus.all_reduce_sum(
        [g for g, _ in grads_and_vars],
        strategy=ctx.strategy,
        algorithm=settings.algorithm,
        pack_bytes=settings.pack_bytes,
        transport_dtype=settings.gradient_dtype,
    )
    return [(g, v) for g, (_, v) in zip(summed, grads_and_vars)]


def install(strategy, settings=None):
    """Makes Keras `model.fit` under `strategy` sum gradients with `torus.all_reduce_sum`.

    Replaces Keras's gradient-sum method once per process (idempotent) and registers `strategy`;
    every strategy not registered keeps Keras's own sum.

    Args:
      strategy: a `tf.distribute.Strategy` whose replicas sum gradients with the torus schedule.
      settings: a `Settings` (default: "auto" algorithm, default buffer size).

    Raises:
      ImportError: if this Keras lacks what the hook replaces (the message names the versions that
        work).
    """
    module = _keras_optimizer_module()
    with _lock:
        _settings[strategy] = settings or Settings()
        current = module.TFOptimizer._all_reduce_sum_gradients
        if current is not _all_reduce_sum_gradients:
            _all_reduce_sum_gradients.original = current
            module.TFOptimizer._all_reduce_sum_gradients = _all_reduce_sum_gradients


def settings_for(strategy):
    """The `Settings` `strategy` was registered with, or None when Keras sums its gradients
    natively."""
    return _settings.get(strategy)


def uninstall(strategy=None):
    """Unregisters `strategy`; with no strategy (or none left registered), restores Keras's own
    method."""
    module = _keras_optimizer_module()
    with _lock:
        if strategy is not None:
            _settings.pop(strategy, None)
        if strategy is None or not len(_settings):
            _settings.clear()
            if module.TFOptimizer._all_reduce_sum_gradients is _all_reduce_sum_gradients:
                module.TFOptimizer._all_reduce_sum_gradients = _all_reduce_sum_gradients.original


def is_installed():
    """True when Keras optimizers route their gradient sum through this module."""
    return (
        _keras_optimizer_module().TFOptimizer._all_reduce_sum_gradients is _all_reduce_sum_gradients
    )


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


# --------------------------------------------------------------------------- a workaround: Keras
# evaluate with a partial first batch (indexed in _workarounds.py)

_build_from_one_replica_applied = False


def build_from_one_replica():
    """Lets Keras build a model for `evaluate`/`predict` from one replica's first batch.

    Why: before evaluating or predicting under a strategy, Keras 3 takes the first distributed
    batch and asks the strategy for its mean over the replicas (`strategy.reduce("MEAN", batch,
    axis=None)`), only to learn the input shapes. When the data end within the first global batch
    (a validation set smaller than the global batch), the replicas' batches differ in size, some
    empty, and the mean fails: "Inputs to operation AddN of type AddN must have the same size and
    shape. Input 0: [14,64,64,3] != input 1: [0,64,64,3]". The replacement reads the same first
    batch and takes the largest of this process's replica batches instead of their mean; the
    build itself is Keras's own.

    Upstream: keras-team/keras#19246; seen with Keras 3.15.1 on TF 2.21. How to tell it can go:
    `tests/test_workarounds.py::test_evaluate_a_validation_set_smaller_than_the_batch` passes
    with Keras's own `_maybe_symbolic_build`.

    Applied once per process by `create_strategy`; idempotent. Here rather than in
    `_workarounds.py` because it replaces a private Keras method.
    """
    global _build_from_one_replica_applied
    if _build_from_one_replica_applied:
        return
    from keras.src.backend.tensorflow import trainer

    def maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = self._distribute_strategy
        if strategy is None:
            return  # Keras defers the build to the first traced step
        if iterator is not None:
            for _, _, it in iterator:
                data_batch = _largest_replica_batch(strategy, next(it))
                break
        with strategy.scope():
            self._symbolic_build(data_batch=data_batch)

    def _largest_replica_batch(strategy, batch):
        flat = tf.nest.flatten(batch)
        if not flat or not all(isinstance(v, tf.distribute.DistributedValues) for v in flat):
            return batch
        local = [strategy.experimental_local_results(v) for v in flat]
        sizes = [int(tf.shape(value)[0]) if value.shape.rank else 1 for value in local[0]]
        largest = sizes.index(max(sizes))
        return tf.nest.pack_sequence_as(batch, [values[largest] for values in local])

    trainer.TensorFlowTrainer._maybe_symbolic_build = maybe_symbolic_build
    _build_from_one_replica_applied = True


# --------------------------------------------------------------------------- a workaround: Keras
# gradient accumulation under a strategy (indexed in _workarounds.py)

_phases = {}  # id(optimizer) -> "accumulate" | "update", while a train step is traced
_accumulation_applied = False
_ACCUMULATE, _UPDATE = "accumulate", "update"


def accumulation_under_strategies():
    """Lets `gradient_accumulation_steps` train under a `tf.distribute` strategy in `model.fit`.

    Why: Keras 3 applies an accumulated update inside `ops.cond(is_update_step, update,
    accumulate)` in replica context (`BaseOptimizer._backend_apply_gradients`). Both branches
    synchronize the replicas (`merge_call` for the gradient sum and `extended.update`), which a
    MirroredStrategy cannot do inside a control-flow branch: `RuntimeError: Exception encountered
    when calling Cond.call(). merge_call called while defining a new graph or a tf.function`.

    The fix moves the condition out of the replicas: `run_train_step` (called by the strategies of
    `create_strategy` from their `run`) traces Keras's train step twice, once per phase, and picks
    one with a `tf.cond` in cross-replica context, where a strategy may run replica functions
    inside a branch (as Keras's own `steps_per_execution` loop does). This module's
    `_backend_apply_gradients` reads the phase being traced and does, without a condition, what
    Keras does in that branch: "accumulate" adds each replica's local gradient to its own
    accumulators (no cross-replica sum); "update" adds the last micro-batch, divides by
    `gradient_accumulation_steps`, clips, applies weight decay, sums over the replicas once (the
    torus or the strategy's own sum) and applies the optimizer, then zeroes the accumulators.
    What Keras keeps is unchanged: its counter counts micro-batches (`optimizer.iterations`
    divides it by the number of steps, so it counts updates), a learning-rate schedule is
    evaluated at the micro-batch count, clipping sees each replica's accumulated gradient before
    the sum, and batch-norm statistics are each micro-batch's. Outside a phase (no strategy from
    `create_strategy`, or no accumulation) Keras's own method runs. A restore in the middle of a
    window (the accumulators are optimizer variables, saved with the weights, but only the first
    replica's) drops that window instead of counting one replica's partial sum on every replica
    (`_load_own_variables`).

    Upstream: keras-team/keras#20582 ("Rethink the conditional in the gradient accumulation",
    open); seen with Keras 3.15.1 on TF 2.21. How to tell it can go:
    `tests/test_accumulation.py::test_keras_own_accumulation_fails_under_a_strategy` fails (Keras's
    own code then trains under MirroredStrategy).

    Applied once per process by `create_strategy`; idempotent. Here rather than in
    `_workarounds.py` because it replaces a private Keras method.
    """
    global _accumulation_applied
    if _accumulation_applied:
        return
    from keras.src.backend.tensorflow import optimizer as module

    _backend_apply_gradients.original = module.TFOptimizer._backend_apply_gradients
    module.TFOptimizer._backend_apply_gradients = _backend_apply_gradients
    _load_own_variables.original = module.TFOptimizer.load_own_variables
    module.TFOptimizer.load_own_variables = _load_own_variables
    _accumulation_applied = True


def _accumulating_optimizer(fn):
    """The optimizer of the Keras model whose `train_step` `fn` is, when it accumulates; else
    None."""
    model = getattr(fn, "__self__", None)
    if getattr(fn, "__name__", None) != "train_step" or not isinstance(model, keras.Model):
        return None
    optimizer = getattr(model, "optimizer", None)
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
    optimizer = _accumulating_optimizer(fn) if _accumulation_applied else None
    if optimizer is None:
        return run(fn, args=args, kwargs=kwargs, options=options)
    if optimizer.use_ema:
        raise ValueError(
            f"{type(optimizer).__name__}(gradient_accumulation_steps="
            f"{optimizer.gradient_accumulation_steps}, use_ema=True) cannot train under a "
            "tf.distribute strategy: Keras updates the moving average in a branch that "
            "synchronizes the replicas. Use either gradient_accumulation_steps or use_ema."
        )

    def phase(name):
        def step():
            _phases[id(optimizer)] = name
            try:
                return run(fn, args=args, kwargs=kwargs, options=options)
            finally:
                _phases.pop(id(optimizer), None)

        return step

    steps = optimizer.gradient_accumulation_steps
    is_update = tf.equal((optimizer._iterations + 1) % steps, 0)
    if tf.executing_eagerly():
        return phase(_UPDATE if bool(is_update) else _ACCUMULATE)()
    return tf.cond(is_update, phase(_UPDATE), phase(_ACCUMULATE))


def _backend_apply_gradients(self, grads, trainable_variables):
    """Keras's update with gradient accumulation, one phase at a time (see
    `accumulation_under_strategies`)."""
    phase = _phases.get(id(self))
    if phase is None or not self.gradient_accumulation_steps:
        return _backend_apply_gradients.original(self, grads, trainable_variables)
    accumulators = [
        self._accumulated_gradients[self._get_variable_index(v)] for v in trainable_variables
    ]
    if phase == _ACCUMULATE:
        self._backend_increment_gradient_accumulators(grads, accumulators)
        return
    steps = self.gradient_accumulation_steps
    grads = [(g + a) / steps for g, a in zip(grads, accumulators)]
    grads = self._clip_gradients(grads)
    self._apply_weight_decay(trainable_variables)
    self._backend_update_step(grads, trainable_variables, self.learning_rate)
    self._backend_reset_gradient_accumulators()


def _load_own_variables(self, store):
    """Keras's optimizer restore; under several replicas, a window in progress starts again.

    Each replica accumulates its own local gradients, but a saved accumulator holds only the
    first replica's. Restoring it into every replica would count that replica's partial sum once
    per replica, so after a restore in the middle of an accumulation window the accumulators are
    zeroed and the step counter goes back to the window's start: the window's micro-batches seen
    before the save are dropped, and the next `gradient_accumulation_steps` micro-batches form a
    full window. `optimizer.iterations` (and so every completed update) is unchanged.
    """
    if not weight_update.load_full_state(self, store):  # a sharded update's state is resharded
        _load_own_variables.original(self, store)
    steps = self.gradient_accumulation_steps
    strategy = getattr(self, "_distribution_strategy", None)
    if not steps or strategy is None or strategy.num_replicas_in_sync < 2:
        return
    done = int(self._iterations.numpy())
    if done % steps:
        self._iterations.assign(done - done % steps)
        self._backend_reset_gradient_accumulators()


# --------------------------------------------------------------------------- XLA on virtual CPUs


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
    from tensorflow.python.ops import control_flow_util

    if not control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        return
    devices = strategy.extended.worker_devices
    cpus = [d for d in devices if tf.DeviceSpec.from_string(d).device_type in (None, "CPU")]
    if len(cpus) > 1:
        raise ValueError(
            f"jit_compile=True cannot run on {len(cpus)} logical CPU replicas: XLA compiles the "
            "step for one device and cannot place the other replicas' variables on it (TensorFlow "
            "fails with 'Trying to access resource ... from device CPU:0'). Compile with "
            "jit_compile=False (model.compile(..., jit_compile=False)), or use one CPU replica "
            "(create_strategy(num_cpu_replicas=1)); XLA works on TPU and GPU replicas."
        )


# --------------------------------------------------------------------------- weight-update sharding

_sharding_hooked = False


def shard_weight_updates():
    """Routes SGD's and Adam's `build` (AdamW's too) and the optimizer's weight decay, update and
    save through `tpu_scale.weight_update`.

    Each wrapper runs Keras's own code unless the strategy (or the optimizer) is sharded; the
    restore goes through `_load_own_variables` (installed by `accumulation_under_strategies`).
    Called by `create_strategy(..., weight_update_sharding=True)`; idempotent.
    """
    global _sharding_hooked
    if _sharding_hooked:
        return
    from keras.src.backend.tensorflow import optimizer as module

    accumulation_under_strategies()  # the restore of a sharded state lives in its load
    sgd_build = keras.optimizers.SGD.build
    adam_build = keras.optimizers.Adam.build
    update_step = module.TFOptimizer._backend_update_step
    save = module.TFOptimizer.save_own_variables
    apply_decay = module.TFOptimizer._apply_weight_decay

    def build(self, variables):
        return weight_update.build_sgd(self, variables, sgd_build)

    def build_adam(self, variables):
        if weight_update.build_adam(self, variables, adam_build):
            self._momentums, self._velocities = [], []  # the sharded slots stand for them

    def backend_update_step(self, grads, trainable_variables, learning_rate):
        indices = [self._get_variable_index(v) for v in trainable_variables]
        ctx = tf.distribute.get_replica_context()
        settings = settings_for(ctx.strategy) if ctx is not None else None
        if not weight_update.update(
            self,
            grads,
            trainable_variables,
            indices,
            learning_rate,
            self._use_weight_decay,
            transport_dtype=settings.gradient_dtype if settings else None,
        ):
            update_step(self, grads, trainable_variables, learning_rate)

    def apply_weight_decay(self, variables):
        if not weight_update.decays_in_update(self):  # else each replica decays its shard
            apply_decay(self, variables)

    def save_own_variables(self, store):
        state = weight_update.full_state(self)
        if state is None:
            return save(self, store)
        for i, value in enumerate(state):
            store[str(i)] = value

    keras.optimizers.SGD.build = build
    keras.optimizers.Adam.build = build_adam
    module.TFOptimizer._backend_update_step = backend_update_step
    module.TFOptimizer.save_own_variables = save_own_variables
    module.TFOptimizer._apply_weight_decay = apply_weight_decay
    _sharding_hooked = True
