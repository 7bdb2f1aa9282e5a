"""`ImageNormalization`: pixels on the 0-255 scale to normalized values, inside the model."""

import keras
import numpy as np
import tensorflow as tf

from tpu_scale.data.image_ops import IMAGENET_MEAN_RGB, IMAGENET_STDDEV_RGB


@keras.saving.register_keras_serializable(package="tpu_scale")
class ImageNormalization(keras.layers.Layer):
    """Normalizes pixels per channel: `(x - mean) / stddev`, in the layer's compute dtype.

    With `ImageNetInput(..., dtype="uint8")` the host sends raw pixels (a quarter of float32's
    bytes) and this layer, first in the model, does the normalization on the accelerator, as the
    input pipelines of the reference TPU and GPU systems do. The arithmetic is float32 whatever the
    inputs (uint8, float16, bfloat16 or float32) and the result is cast to the compute dtype, so
    under a `mixed_bfloat16` policy the model's first convolution gets bfloat16. On float inputs on
    the 0-255 scale it equals `tpu_scale.data.image_ops.normalize_image`.

    Args:
      mean: per-channel means on the 0-255 scale (ImageNet's by default).
      stddev: per-channel standard deviations on the 0-255 scale (ImageNet's by default).
      **kwargs: base layer keyword arguments (`name`, `dtype`, ...).

    Call arguments:
      inputs: images `[..., channels]`, any real or unsigned integer dtype, on the 0-255 scale.

    Reference:
      Ying et al., "Image Classification at Supercomputer Scale", 2018 (arXiv:1811.06992), section
      4.
    """

    def __init__(self, mean=IMAGENET_MEAN_RGB, stddev=IMAGENET_STDDEV_RGB, **kwargs):
        super().__init__(**kwargs)
        self.mean = tuple(float(m) for m in mean)
        self.stddev = tuple(float(s) for s in stddev)
        if len(self.mean) != len(self.stddev):
            raise ValueError(
                f"mean {self.mean} and stddev {self.stddev} must have one value per channel each."
            )
        if min(self.stddev) <= 0:
            raise ValueError(f"stddev must be positive, got {self.stddev}.")
        self._scale = 1.0 / np.asarray(self.stddev, np.float32)
        self._offset = -np.asarray(self.mean, np.float32) * self._scale
        # Integer inputs must reach call() as they are; Keras would otherwise cast them.
        self._convert_input_args = False
        self._allow_non_tensor_positional_args = True

    def build(self, input_shape):
        if input_shape[-1] is not None and input_shape[-1] != len(self.mean):
            raise ValueError(f"ImageNormalization has {len(self.mean)} channel statistics but its input has {input_shape[-1]} channels {tuple(input_shape)}. Pass mean= and stddev= per channel.")
        self.built = True

    def call(self, inputs):
        x = tf.cast(inputs, tf.float32)
        return tf.cast(x * self._scale + self._offset, self.compute_dtype)

    def compute_output_shape(self, input_shape):
        return input_shape

    def compute_output_spec(self, inputs):
        return keras.KerasTensor(inputs.shape, dtype=self.compute_dtype)

    def get_config(self):
        return {**super().get_config(), "mean": list(self.mean), "stddev": list(self.stddev)}
