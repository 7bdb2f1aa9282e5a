"""Keras layers of the recipe, one concept per module.

DistributedBatchNormalization   batch norm over groups of replicas (batch_normalization.py);
  = BatchNormalization          the same class, under Keras's name (its weights' names are Keras's)
convert_batch_normalization     an existing model's batch norms made grouped, weights kept
restore_batch_normalization     and back to Keras's own, for sharing
average_moving_statistics       every replica on the mean of Keras batch norms' moving statistics
ImageNormalization              uint8 (or float) pixels -> normalized values, on the device
SpaceToDepth                    2x2 pixel blocks into channels (the space-to-depth stem's input)
"""

from tpu_scale.layers.batch_normalization import (
    DEFAULT_SPAN,
    BatchNormalization,
    DistributedBatchNormalization,
    average_moving_statistics,
    convert_batch_normalization,
    restore_batch_normalization,
)
from tpu_scale.layers.image_normalization import ImageNormalization
from tpu_scale.layers.space_to_depth import SpaceToDepth

__all__ = [
    "DEFAULT_SPAN",
    "BatchNormalization",
    "DistributedBatchNormalization",
    "ImageNormalization",
    "SpaceToDepth",
    "average_moving_statistics",
    "convert_batch_normalization",
    "restore_batch_normalization",
]
