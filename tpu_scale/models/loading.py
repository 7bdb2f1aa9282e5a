"""`load_model`: a saved model of this package back in a fresh process."""

import os

import keras

# Each of these registers its serializable classes with Keras when imported.
import tpu_scale.layers  # noqa: F401
import tpu_scale.losses  # noqa: F401
import tpu_scale.optimizers  # noqa: F401
import tpu_scale.schedules  # noqa: F401


def load_model(path, **kwargs):
    """Loads a `.keras` file saved with this package's layers, losses, optimizers or schedules.

    Keras finds a custom class only once the module that registers it has been imported; in a
    fresh process `keras.models.load_model` on the example's `final.keras` fails with "Could not
    locate class 'DistributedBatchNormalization'". This imports every module of the package that
    registers a class (on import of this module), then calls Keras's loader.

    Args:
      path: a `.keras` file, e.g. the example's `<model_dir>/final.keras` (`~` is expanded).
      **kwargs: passed on to `keras.models.load_model` (`compile`, `custom_objects`, ...).

    Returns:
      The Keras model, compiled as it was saved unless `compile=False`.
    """
    if isinstance(path, str):
        path = os.path.expanduser(path)
    return keras.models.load_model(path, **kwargs)
