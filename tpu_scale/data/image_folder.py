"""Which files of a folder of class folders the writer converts, and which it skips.

`image_dir/<class>/...`: each visible sub-folder of `image_dir` is a class, and every file with an
image extension anywhere below it, in nested folders too, is one of its images (as Keras's
`image_dataset_from_directory` finds them). Hidden folders (a name starting with ".", such as
`.ipynb_checkpoints`) are neither classes nor searched; they, files beside the class folders and
files of other types are skipped and named, by reason.
"""

import dataclasses
import os

import tensorflow as tf

from tpu_scale._files import is_local

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".gif", ".bmp", ".webp")

# Why a file or folder was skipped (keys of `ClassFolders.skipped`, and of the writer's summary).
UNSUPPORTED_TYPE = "unsupported file type"
NOT_IN_CLASS_FOLDER = "not in a class folder"
HIDDEN_FOLDER = "hidden folder (not searched)"
SEARCHED_FOLDER = "link to a folder already searched"


@dataclasses.dataclass
class ClassFolders:
    """What `list_class_folders` found.

    Attributes:
      files_by_class: each class with images, in sorted folder order: its image paths, sorted.
      empty_classes: the class folders without a single image.
      skipped: the paths skipped, by reason.
    """

    files_by_class: dict[str, list[str]]
    empty_classes: list[str]
    skipped: dict[str, list[str]]


def _real_path(path):
    return os.path.realpath(path) if is_local(path) else path


def _entries(folder):
    """`(name, path, is_folder)` of a folder's entries, sorted by name.

    A local folder is read with one `os.scandir`, which knows each entry's type from the listing
    (a link by its target, as `tf.io.gfile.isdir`); a remote one (`gs://...`) through
    `tf.io.gfile`, which asks the file system once per entry.
    """
    if is_local(folder):
        with os.scandir(folder) as found:
            return sorted((entry.name, entry.path, entry.is_dir()) for entry in found)
    names = sorted(name.rstrip("/") for name in tf.io.gfile.listdir(folder))
    return [
        (name, os.path.join(folder, name), tf.io.gfile.isdir(os.path.join(folder, name)))
        for name in names
    ]


def _images_below(folder, skipped, searched):
    """The image paths below `folder`, depth first in sorted order; the rest goes to `skipped`.
    `searched` holds the real paths of the folders already searched, so that a link back to one of
    them is not followed around."""
    searched.add(_real_path(folder))
    images = []
    for name, path, is_folder in _entries(folder):
        if is_folder and name.startswith("."):
            skipped.setdefault(HIDDEN_FOLDER, []).append(path)
        elif is_folder and _real_path(path) in searched:
            skipped.setdefault(SEARCHED_FOLDER, []).append(path)
        elif is_folder:
            images.extend(_images_below(path, skipped, searched))
        elif name.lower().endswith(IMAGE_EXTENSIONS):
            images.append(path)
        else:
            skipped.setdefault(UNSUPPORTED_TYPE, []).append(path)
    return images


def list_class_folders(image_dir, flag="image_dir"):
    """Lists the classes of `image_dir` and their images.

    Args:
      image_dir: a folder with one sub-folder of images per class.
      flag: how the caller names `image_dir` in an error.

    Returns:
      A `ClassFolders`.

    Raises:
      ValueError: if `image_dir` is not a folder, or has no class folder.
    """
    if not tf.io.gfile.isdir(image_dir):
        raise ValueError(f"{flag} {image_dir!r} is not a directory.")
    skipped, class_folders = {}, []
    for name, path, is_folder in _entries(image_dir):
        if is_folder and name.startswith("."):
            skipped.setdefault(HIDDEN_FOLDER, []).append(path)
        elif is_folder:
            class_folders.append((name, path))
        else:
            skipped.setdefault(NOT_IN_CLASS_FOLDER, []).append(path)
    if not class_folders:
        raise ValueError(f"{image_dir!r} has no sub-folders: put each class's images in their own sub-folder ({image_dir}/<class name>/<image>.jpg).")
    files_by_class, empty_classes = {}, []
    for name, path in class_folders:
        images = _images_below(path, skipped, set())
        if images:
            files_by_class[name] = images
        else:
            empty_classes.append(name)
    return ClassFolders(files_by_class, empty_classes, skipped)
