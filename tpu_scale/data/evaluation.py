"""Exact evaluation: every validation example counted once, on any number of replicas.

A distributed evaluation hands one batch to every replica per step. The examples rarely divide
into whole steps, and Keras (3.15) makes a new iterator for every `evaluate`, inside `fit` too, so
a pass that ends mid-step or a step count that overshoots would drop or repeat examples, and a
pass that runs out of data makes Keras warn. `exact_evaluation` makes every pass exactly `steps`
steps long: the pipeline's own batches, each replica's filled up to its size with zero-weight
examples (`_filled`, the one place a batch is filled: the input pipeline leaves its last batch
short), then whole zero-weight batches up to a whole number of steps, repeated for the next pass.
Every replica gets a whole batch at every step, so shapes are static. Compile the metrics as
`weighted_metrics`, so that the padding's zero weights leave them unchanged. (The one exception:
several input pipelines whose files' record counts are unknown each run to the end of their own
data, see `exact_evaluation`.)

A small evaluation set is decoded once: its pass is kept in host memory after the first one
(`cache`), so the validation `fit` runs every epoch does not start the input pipeline again.
"""

import collections
import math

import tensorflow as tf

from tpu_scale.distribute.context import is_tpu_strategy

# A pass whose decoded images take at most this many bytes per input pipeline is cached (`cache`).
CACHE_LIMIT_BYTES = 512 * 2**20

ExactEvaluation = collections.namedtuple(
    "ExactEvaluation", ["dataset", "steps", "cached"], defaults=[False]
)
ExactEvaluation.__doc__ = """What `exact_evaluation` returns: pass both to Keras.

Attributes:
  dataset: the distributed evaluation dataset (`validation_data=` of `fit`, `x` of `evaluate`).
  steps: the steps of one pass (`validation_steps=` of `fit`, `steps=` of `evaluate`), or None
    when each pass runs to the end of the data (several input pipelines, see `exact_evaluation`).
  cached: whether the passes after the first read the first one's batches from host memory (then
    the input's counts of records read and skipped are those of the first pass).
"""


def evaluation_steps(num_examples, global_batch_size, num_replicas):
    """Steps of one pass over `num_examples` on one input pipeline, the last one topped up.

    Args:
      num_examples: examples in the evaluation set.
      global_batch_size: examples per step over all replicas (a multiple of `num_replicas`).
      num_replicas: the replicas in sync.

    Returns:
      The number of steps, at least 1.
    """
    per_replica_batches = math.ceil(num_examples / (global_batch_size // num_replicas))
    return max(1, math.ceil(per_replica_batches / num_replicas))


def pass_bytes(eval_input, steps, examples_per_step):
    """Host bytes of one pass's decoded images on one input pipeline, or None when unknown.

    Args:
      eval_input: the evaluation input (its `image_size` and `dtype` give an image's bytes).
      steps: the steps of a pass.
      examples_per_step: the examples one pipeline feeds per step.
    """
    size, dtype = getattr(eval_input, "image_size", None), getattr(eval_input, "dtype", None)
    if size is None or dtype is None:
        return None
    return steps * examples_per_step * size * size * 3 * tf.dtypes.as_dtype(dtype).size


def exact_evaluation(eval_input, strategy, num_examples, *, cache=None):
    """The distributed evaluation dataset and steps that count every example exactly once.

    One input pipeline (one host): each pass is `evaluation_steps(...)` steps, each replica's
    batch filled up to the per-replica size with zero-weight examples and the pass topped up with
    whole zero-weight batches, then repeated, so every `evaluate` or validation in `fit` sees each
    example once whether it starts a new iterator or continues an old one. Compile the metrics as
    `weighted_metrics`: unweighted ones (`metrics=`) would count the zero-weight padding. Every
    replica gets a whole batch at every step, so shapes are static. Several input pipelines (one
    per host under `MultiWorkerMirroredStrategy`, one per host of a TPU pod slice) read their own
    files: where every file's record count is known (the label map of `write_tfrecords`), a pass
    is as many steps as the longest pipeline's and the others are topped up to it; otherwise each
    pass runs to the end of its data (`steps` is None, and Keras warns that the input ran out of
    data): each batch is still filled to the replica's size, but a pipeline's last step may hand
    some of its replicas no batch at all.

    Caching. Keras starts a new iterator for every `evaluate` (inside `fit` too), and an input
    pipeline takes a while to start (reading, parsing and decoding its first batch, per epoch of
    a run, where the pass itself is short). With `cache`, the first complete pass keeps its
    batches, fillers included, in host memory (`tf.data.Dataset.cache`), and every later pass
    reads them from there; an evaluation input has no randomness, so each pass gives the same batches. The rule (`cache=None`): cache
    when one pass's decoded images take at most `CACHE_LIMIT_BYTES` (512 MiB) per input pipeline
    (`pass_bytes`: e.g. 10,000 images at 64 px in float32), so that a user's own small validation
    set is decoded once and ImageNet's 50,000 at 224 px are not held in memory. The input's
    counts of records read and skipped then cover the first pass (and what Keras reads ahead).

    Example:

    ```python
    validation = data.exact_evaluation(inputs.validation, strategy, inputs.validation_examples)
    model.fit(train, epochs=epochs, steps_per_epoch=steps,
              validation_data=validation.dataset, validation_steps=validation.steps)
    model.evaluate(validation.dataset, steps=validation.steps)
    ```

    Args:
      eval_input: an `ImageNetInput` with `is_training=False` (or any object whose
        `dataset(input_context)` yields `(images, labels)` or `(images, labels, weights)` batches
        of the per-replica size, the last possibly smaller).
      strategy: the `tf.distribute` strategy the model runs under.
      num_examples: the examples in one pass (e.g. `Inputs.validation_examples`).
      cache: True keeps the first pass in host memory, False reads every pass from the input, None
        (the default) caches a pass of at most `CACHE_LIMIT_BYTES` (see above). Only with `steps`
        known (a pass that runs to the end of its data is not cached).

    Returns:
      An `ExactEvaluation(dataset, steps, cached)`.

    Raises:
      ValueError: if the input is a training input or `num_examples` is not positive.
    """
    if getattr(eval_input, "is_training", False):
        raise ValueError(
            "exact_evaluation needs an evaluation input: build it with is_training=False."
        )
    if not num_examples or num_examples < 1:
        raise ValueError(f"num_examples must be at least 1, got {num_examples!r}.")
    replicas = strategy.num_replicas_in_sync
    batch = eval_input.global_batch_size
    if batch % replicas:
        raise ValueError(f"The global batch size {batch} does not divide over {replicas} replicas; use a multiple of {replicas}, e.g. {replicas * max(1, batch // replicas)}.")
    per_replica = batch // replicas
    pipelines = _input_pipelines(strategy)
    if pipelines > 1:
        # Each pipeline reads its own files: the pass is as long as the longest pipeline's.
        source = getattr(eval_input, "source", None)
        counts = (
            source.records_per_shard(pipelines) if hasattr(source, "records_per_shard") else None
        )
        if counts is None:
            dataset = strategy.distribute_datasets_from_function(
                lambda context: eval_input.dataset(context).map(
                    lambda *batch: _filled(batch, per_replica)
                )
            )
            return ExactEvaluation(dataset, None)
        replicas_fed = replicas // pipelines
        steps = max(
            evaluation_steps(count, per_replica * replicas_fed, replicas_fed) for count in counts
        )
    else:
        replicas_fed = replicas
        steps = evaluation_steps(num_examples, batch, replicas)
    if cache is None:
        size = pass_bytes(eval_input, steps, per_replica * replicas_fed)
        cache = size is not None and size <= CACHE_LIMIT_BYTES

    def dataset(context):
        data = eval_input.dataset(context).map(lambda *batch: _filled(batch, per_replica))
        replicas_fed = context.num_replicas_in_sync // context.num_input_pipelines
        filler = tf.data.Dataset.from_tensors(_zero_weights(data.element_spec)).repeat()
        # The pass's own batches (at most steps * replicas_fed), then fillers to a whole number of
        # steps; repeated, so that the next pass starts at the first example again.
        one_pass = data.concatenate(filler).take(steps * replicas_fed)
        if cache:
            # Complete once an iterator has read the whole pass; an iterator left mid-pass (Keras
            # takes one batch to learn the input shapes) leaves it empty for the next one.
            one_pass = one_pass.cache()
        return one_pass.repeat()

    distributed = strategy.distribute_datasets_from_function(dataset)
    return ExactEvaluation(distributed, steps, bool(cache))


def _filled(batch, size):
    """`(images, labels[, weights])` filled up to `size` examples with zeros of weight 0, as
    `(images, labels, weights)` of static batch size `size`: how an evaluation's last, short batch
    is made whole."""
    images, labels, *weights = batch
    count = tf.shape(images)[0]
    weights = weights[0] if weights else tf.ones([count], tf.float32)
    missing = size - count

    def fill(t):
        zeros = tf.zeros(tf.concat([[missing], tf.shape(t)[1:]], 0), t.dtype)
        return tf.ensure_shape(tf.concat([t, zeros], 0), [size, *t.shape[1:]])

    return fill(images), fill(labels), fill(tf.cast(weights, tf.float32))


def _zero_weights(spec):
    """A whole batch that adds nothing to any weighted metric: zeros of weight 0."""
    return tuple(tf.zeros(s.shape, s.dtype) for s in spec)


def _input_pipelines(strategy):
    """How many input pipelines `distribute_datasets_from_function` makes: one per worker."""
    if is_tpu_strategy(strategy):
        return getattr(strategy.extended, "num_hosts", 1)
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None:
        return 1
    spec = resolver.cluster_spec().as_dict()
    return max(1, len(spec.get("worker", [])) + len(spec.get("chief", [])))
