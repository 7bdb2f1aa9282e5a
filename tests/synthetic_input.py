"""Random, already-normalized batches with no I/O, for the tests: `SyntheticImageNetInput`."""

from typing import Optional

import tensorflow as tf


class SyntheticImageNetInput:
    """Random, already-normalized batches with no I/O: the input-free upper bound of a training
    step.

    Use it to measure the training step without the cost of the input pipeline.

    Args:
      global_batch_size: the batch size over all replicas.
      image_size: output height and width.
      num_classes: labels are drawn from `[0, num_classes)`.
      dtype: image dtype (uint8: raw pixels around mid-grey, as `ImageNetInput(dtype="uint8")`).
      seed: seed of the random batch.
    """

    def __init__(
        self, global_batch_size, *, image_size=224, num_classes=1000, dtype=tf.float32, seed=0
    ):
        self.global_batch_size = global_batch_size
        self.image_size = image_size
        self.num_classes = num_classes
        self.dtype = tf.dtypes.as_dtype(dtype)
        self.seed = seed

    def dataset(
        self, input_context: Optional[tf.distribute.InputContext] = None
    ) -> tf.data.Dataset:
        """One random batch, repeated forever.

        Args:
          input_context: as for `ImageNetInput.dataset`; only the per-replica batch size is used.

        Returns:
          A `tf.data.Dataset` of `(images, labels)`.
        """
        batch_size = self.global_batch_size
        if input_context is not None:
            batch_size = input_context.get_per_replica_batch_size(self.global_batch_size)
        seed = [self.seed, 0 if input_context is None else input_context.input_pipeline_id]
        images = tf.random.stateless_normal(
            [batch_size, self.image_size, self.image_size, 3], seed, dtype=tf.float32
        )
        labels = tf.random.stateless_uniform(
            [batch_size], seed, minval=0, maxval=self.num_classes, dtype=tf.int32
        )
        if self.dtype == tf.uint8:  # raw pixels, as ImageNetInput(dtype="uint8") gives them
            images = tf.clip_by_value(tf.round(127.5 + 60.0 * images), 0, 255)
        batch = (tf.cast(images, self.dtype), labels)
        # The batch is a constant of the dataset graph: repeating it costs no host work.
        return tf.data.Dataset.from_tensors(batch).repeat()
