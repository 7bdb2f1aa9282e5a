"""`load_model`: a saved model of this package back in a fresh process."""

import os

import keras


def load_model(path, **kwargs):
    """Loads a `.keras` file saved with this package's layers, losses, optimizers or schedules.

    `import tpu_scale` registers the package's classes with Keras, so `keras.models.load_model`
    reads such a file too; this adds only the expansion of `~` in `path`.

    Args:
      path: a `.keras` file, e.g. the example's `<model_dir>/final.keras` (`~` is expanded).
      **kwargs: passed on to `keras.models.load_model` (`compile`, `custom_objects`, ...).

    Returns:
      The Keras model, compiled as it was saved unless `compile=False`.
    """
    if isinstance(path, str):
        path = os.path.expanduser(path)
    return keras.models.load_model(path, **kwargs)
