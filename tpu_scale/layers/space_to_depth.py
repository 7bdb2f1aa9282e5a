"""`SpaceToDepth` and the space-to-depth form of ResNet-50's 7x7 stride-2 stem.

A 7x7 stride-2 convolution over 3 channels keeps a TPU's matrix units mostly idle (3 input channels
against 128 lanes). Rearranging each 2x2 block of pixels into channels first (224x224x3 ->
112x112x12) turns it into an equivalent 4x4 stride-1 convolution over 12 channels, as the reference
ResNet-50 TPU submissions do. `stem_kernel_to_space_to_depth` and `stem_kernel_from_space_to_depth`
convert the weights both ways, so the two stems compute the same function.

Derivation: the standard stem pads 3 pixels on each side and computes output `i` from input pixels
`2i - 3 .. 2i + 3`. Padding the kernel with one leading zero row and column makes it 8x8 over pixels
`2i - 4 .. 2i + 3`, which are the 2x2 blocks `i - 2 .. i + 1`: a 4x4 kernel over blocks, padded by
2 blocks before and 1 after, at stride 1.
"""

import keras
import numpy as np
import tensorflow as tf

BLOCK = 2


@keras.saving.register_keras_serializable(package="tpu_scale")
class SpaceToDepth(keras.layers.Layer):
    """Moves each `block_size x block_size` patch of pixels into the channels.

    The layer form of `tf.nn.space_to_depth`.

    Args:
      block_size: the patch size; height and width must be multiples of it.
      **kwargs: base layer keyword arguments.

    Call arguments:
      inputs: `[batch, height, width, channels]`, channels last.
    """

    def __init__(self, block_size=BLOCK, **kwargs):
        super().__init__(**kwargs)
        self.block_size = int(block_size)
        self._convert_input_args = False
        self._allow_non_tensor_positional_args = True

    def build(self, input_shape):
        for size in input_shape[1:3]:
            if size is not None and size % self.block_size:
                raise ValueError(f"SpaceToDepth({self.block_size}) needs height and width divisible by {self.block_size}; got input shape {tuple(input_shape)}. Use an even image size.")
        self.built = True

    def call(self, inputs):
        return tf.nn.space_to_depth(inputs, self.block_size)

    def compute_output_spec(self, inputs):
        b, h, w, c = inputs.shape
        s = self.block_size
        shape = (b, None if h is None else h // s, None if w is None else w // s, c * s * s)
        return keras.KerasTensor(shape, dtype=inputs.dtype)

    def get_config(self):
        return {**super().get_config(), "block_size": self.block_size}


def stem_kernel_to_space_to_depth(kernel):
    """A 7x7 stride-2 stem kernel `[7, 7, C, O]` as the equivalent 4x4 kernel `[4, 4, 4C, O]`.

    The input channel order matches `SpaceToDepth(2)`: `(row in block, column in block, channel)`.
    """
    kernel = np.asarray(kernel)
    if kernel.shape[:2] != (7, 7):
        raise ValueError(f"Expected a [7, 7, C, O] stem kernel, got shape {kernel.shape}.")
    c, o = kernel.shape[2:]
    padded = np.zeros((8, 8, c, o), kernel.dtype)
    padded[1:, 1:] = kernel
    # [8, 8] -> [block row a, row in block p, block col b, col in block q] -> [a, b, p, q, C, O]
    blocks = padded.reshape(4, BLOCK, 4, BLOCK, c, o).transpose(0, 2, 1, 3, 4, 5)
    return blocks.reshape(4, 4, BLOCK * BLOCK * c, o)


def stem_kernel_from_space_to_depth(kernel):
    """The inverse of `stem_kernel_to_space_to_depth`: `[4, 4, 4C, O]` -> `[7, 7, C, O]`.

    Raises:
      ValueError: if the kernel's taps outside the 7x7 window (the leading row and column) are not
        zero, so that no standard 7x7 stem computes the same function.
    """
    kernel = np.asarray(kernel)
    if kernel.shape[:2] != (4, 4) or kernel.shape[2] % (BLOCK * BLOCK):
        raise ValueError(
            f"Expected a [4, 4, 4C, O] space-to-depth kernel, got shape {kernel.shape}."
        )
    c, o = kernel.shape[2] // (BLOCK * BLOCK), kernel.shape[3]
    padded = (
        kernel.reshape(4, 4, BLOCK, BLOCK, c, o).transpose(0, 2, 1, 3, 4, 5).reshape(8, 8, c, o)
    )
    if np.any(padded[0]) or np.any(padded[:, 0]):
        raise ValueError("This space-to-depth kernel uses taps outside the 7x7 window (its first pixel row or column), so no 7x7 stem computes the same function.")
    return padded[1:, 1:].copy()
