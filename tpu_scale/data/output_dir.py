"""The writer's output folder: staged next to its final place and moved in only when complete.

An aborted conversion leaves a hidden `.<name>.incomplete-*` folder and nothing that looks finished;
a finished one is refused as an output unless it is to be replaced, and a folder holding anything
but shards and label files is never touched. The next conversion to the same output removes the
staging folders of earlier writers that are gone (`remove_stale_staging_dirs`).
"""

import fnmatch
import logging
import os
import socket
import tempfile
import uuid

import tensorflow as tf

from tpu_scale._files import is_local, remove_tree
from tpu_scale.data.schema import LABEL_MAP_FILE, LABELS_TXT_FILE

# Beside the shards and the label maps: the files the writer left out, and why (JSON).
SKIPPED_FILE = "skipped.json"


def _looks_like_conversion(names):
    patterns = ("train-*", "validation-*", LABEL_MAP_FILE, LABELS_TXT_FILE, SKIPPED_FILE)
    return bool(names) and all(any(fnmatch.fnmatch(n, p) for p in patterns) for n in names)


def check_output_dir(output_dir, overwrite):
    """Whether `output_dir` holds a conversion to replace; raises if it must not be touched.

    Args:
      output_dir: the writer's output folder (local or `gs://...`).
      overwrite: whether a finished conversion there may be replaced.

    Returns:
      True when `output_dir` holds a conversion that `publish` is to replace.

    Raises:
      ValueError: `output_dir` is a file, holds anything but a conversion, or holds a conversion
        and `overwrite` is False.
    """
    if not tf.io.gfile.exists(output_dir):
        return False
    if not tf.io.gfile.isdir(output_dir):
        raise ValueError(f"output_dir {output_dir!r} is a file: choose a folder.")
    names = [name.rstrip("/") for name in tf.io.gfile.listdir(output_dir)]
    if not names:
        return False
    if not _looks_like_conversion(names):
        raise ValueError(f"output_dir {output_dir!r} is not empty and holds files other than shards and label maps ({_first_names(sorted(names), 5)}): choose a new or empty folder.")
    if not overwrite:
        finished = LABEL_MAP_FILE in names
        raise ValueError(
            f"output_dir {output_dir!r} already holds "
            + (
                "a finished conversion (labels.json)"
                if finished
                else "TFRecord shards without labels.json (an older or unfinished conversion)"
            )
            + ": pass overwrite=True (--overwrite) to replace it, or choose another output_dir."
        )
    return True


def publish(staging_dir, output_dir, replace):
    """Moves the finished `staging_dir` into place as `output_dir`.

    Args:
      staging_dir: the folder of `make_staging_dir`, holding only the files to publish.
      output_dir: the writer's output folder.
      replace: what `check_output_dir` returned (an earlier conversion there is replaced).
    """
    tf.io.gfile.remove(os.path.join(staging_dir, _WRITER_FILE))
    if is_local(output_dir):
        old = None
        if tf.io.gfile.exists(output_dir):
            if replace:
                old = f"{staging_dir}.replaced"
                os.rename(output_dir, old)
            else:
                os.rmdir(output_dir)  # empty (checked before writing)
        os.rename(staging_dir, output_dir)
        if old:
            remove_tree(old)
        return
    if replace:
        tf.io.gfile.rmtree(output_dir)
    tf.io.gfile.makedirs(output_dir)
    names = sorted(n.rstrip("/") for n in tf.io.gfile.listdir(staging_dir))
    # labels.json last: its presence is what marks a finished conversion.
    for name in sorted(names, key=lambda n: n == LABEL_MAP_FILE):
        tf.io.gfile.rename(os.path.join(staging_dir, name), os.path.join(output_dir, name))
    tf.io.gfile.rmtree(staging_dir)


logger = logging.getLogger("tpu_scale")

# In each staging folder: "<host> <process id>" of the writer that fills it.
_WRITER_FILE = "writer"


def _staging_pattern(output_dir):
    parent, name = os.path.split(output_dir)
    return os.path.join(parent or ".", f".{name}.incomplete-*")


def make_staging_dir(output_dir):
    """Creates the hidden staging folder `.<name>.incomplete-*` beside `output_dir`.

    It records its writer (host and process id), so that a later writer can tell whether it was
    left by one that was killed (`remove_stale_staging_dirs`).

    Args:
      output_dir: the writer's output folder.

    Returns:
      The staging folder's path.
    """
    parent, name = os.path.split(output_dir)
    parent = parent or "."
    tf.io.gfile.makedirs(parent)
    if is_local(output_dir):
        staging = tempfile.mkdtemp(prefix=f".{name}.incomplete-", dir=parent)
    else:
        staging = os.path.join(parent, f".{name}.incomplete-{uuid.uuid4().hex[:8]}")
        tf.io.gfile.makedirs(staging)
    with tf.io.gfile.GFile(os.path.join(staging, _WRITER_FILE), "w") as f:
        f.write(f"{socket.gethostname()} {os.getpid()}")
    return staging


def _writer_is_running(staging_dir):
    """Whether the writer that made `staging_dir` may still be running: its process is alive on
    this host, or it ran on another host (which this one cannot ask)."""
    path = os.path.join(staging_dir, _WRITER_FILE)
    try:
        with tf.io.gfile.GFile(path) as f:
            host, pid = f.read().split()
    except (tf.errors.NotFoundError, ValueError):
        return False  # no (readable) record of its writer: an earlier writer's, long gone
    if host != socket.gethostname():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError):
        return True  # alive, another user's
    return True


def remove_stale_staging_dirs(output_dir):
    """Removes the staging folders (`.<name>.incomplete-*`) that earlier writers of `output_dir`
    left when they were killed, naming each in a warning of the "tpu_scale" logger.

    A folder whose writer still runs on this host, or ran on another host, is left alone (named in
    the log when it comes from another host).

    Args:
      output_dir: the writer's output folder.

    Returns:
      The removed folders.
    """
    removed = []
    for path in sorted(tf.io.gfile.glob(_staging_pattern(output_dir))):
        path = path.rstrip("/")
        if path.endswith(".replaced"):
            # An earlier output moved aside while its successor was published; stale once that
            # successor's staging folder is gone.
            stale = not tf.io.gfile.exists(path[: -len(".replaced")])
        else:
            stale = not _writer_is_running(path)
        if not stale:
            logger.info("Left the staging folder %r alone: its writer may still be running.", path)
            continue
        remove_tree(path)
        removed.append(path)
        logger.warning(
            # %r: escaped, so that a folder name holding a newline cannot forge a log line.
            "Removed %r, the staging folder of an earlier writer of %r that did not finish.",
            path,
            output_dir,
        )
    return removed


def _first_names(names, count):
    shown = ", ".join(repr(name) for name in names[:count])
    return shown + (f" and {len(names) - count} more" if len(names) > count else "")
