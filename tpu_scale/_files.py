"""Folders on a local disk or a remote filesystem (`gs://...`): the package's one set of helpers.

Local folders go through `os` and `shutil` (renames are atomic there, and `fsync` exists);
everything else through `tf.io.gfile`.
"""

import logging
import os
import shutil

import tensorflow as tf

logger = logging.getLogger(__name__)


def is_local(path):
    """Whether `path` is on a local filesystem (no `scheme://` prefix)."""
    return "://" not in os.fspath(path)


def remove_tree(path, *, best_effort=False):
    """Removes the folder `path` with everything in it; nothing happens if it does not exist.

    Args:
      path: a local or remote folder.
      best_effort: log a warning instead of raising when the removal fails (for leftovers that
        nothing reads again).

    Raises:
      OSError or tf.errors.OpError: the removal failed, unless `best_effort`.
    """
    try:
        if is_local(path):
            shutil.rmtree(path, ignore_errors=True)
        elif tf.io.gfile.exists(path):
            tf.io.gfile.rmtree(path)
    except (OSError, tf.errors.OpError) as e:
        if not best_effort:
            raise
        logger.warning("Could not remove %s (%s); it is not needed any more.", path, e)
