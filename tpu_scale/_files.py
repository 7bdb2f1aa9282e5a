"""Folders on a local disk or a remote filesystem (`gs://...`): the package's one set of helpers.

Local folders go through `os` and `shutil` (renames are atomic there, and `fsync` exists);
everything else through `tf.io.gfile`.
"""

import contextlib
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


def write_json(path, value):
    """Writes `value` as JSON to `path` atomically: a reader finds the old file or the new one,
    never a part (a full disk leaves the old file as it was).

    Local files go to a temporary file in the same folder, are flushed to disk and renamed over
    `path`; remote ones (`gs://...`) are written whole to a temporary name and renamed.

    Raises:
      OSError or tf.errors.OpError: the write failed; `path` is unchanged.
    """
    import json

    text = json.dumps(value, indent=2, default=str)
    if not is_local(path):
        partial = f"{path}.tmp-{os.getpid()}"
        with tf.io.gfile.GFile(partial, "w") as f:
            f.write(text)
        tf.io.gfile.rename(partial, path, overwrite=True)
        return
    import tempfile

    folder = os.path.dirname(os.path.abspath(path))
    handle, partial = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=folder)
    try:
        with os.fdopen(handle, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(partial)
        raise


def read_json(path):
    """The JSON value in `path`.

    Raises:
      ValueError: the file is not JSON (empty, truncated, damaged), naming it.
    """
    import json

    with tf.io.gfile.GFile(path) as f:
        text = f.read()
    try:
        return json.loads(text)
    except ValueError as e:
        raise ValueError(f"{path!r} is not valid JSON ({'empty' if not text.strip() else e})") from None


