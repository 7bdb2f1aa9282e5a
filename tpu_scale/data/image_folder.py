"""Which files of a folder of class folders the writer converts, and which it skips.

`image_dir/<class>/...`: each visible sub-folder of `image_dir` is a class, and every file with an
image extension anywhere below it, in nested folders too, is one of its images (as Keras's
`image_dataset_from_directory` finds them). Hidden folders (a name starting with ".", such as
`.ipynb_checkpoints`) are neither classes nor searched; they, files beside the class folders and
files of other types are skipped and named, by reason.

What a file could do to the conversion is settled here, from the listing, before any file is read:
a file larger than `max_file_bytes` (whatever its name says; a 1 GiB file named `.jpg` would be read
whole), anything that is not a regular file (a pipe named `.jpg` would block the reader forever, a
device would never end) and a link whose target is outside the folder (which would read files the
folder's owner did not put there; `follow_links=True` takes them) are skipped and named, by reason.
Names that are not valid UTF-8 are listed as Python gives them (undecodable bytes as surrogates) and
read by those bytes; class names are stored in their escaped form (`names.stored`).
"""

import dataclasses
import os
import stat

import tensorflow as tf

from tpu_scale._files import is_local
from tpu_scale.data.names import shown, stored

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".gif", ".bmp", ".webp")

# Why a file or folder was skipped (keys of `ClassFolders.skipped`, and of the writer's summary).
UNSUPPORTED_TYPE = "unsupported file type"
NOT_IN_CLASS_FOLDER = "not in a class folder"
HIDDEN_FOLDER = "hidden folder (not searched)"
SEARCHED_FOLDER = "link to a folder already searched"
TOO_LARGE = "file above the size cap (max_file_bytes, --max_file_mib)"
NOT_A_FILE = "not a regular file (a pipe, device or socket)"
LINK_OUTSIDE = "link to outside the folder (follow_links, --follow_links, takes it)"

# Files above this are skipped unread: 64 MiB holds a 100-megapixel camera JPEG; an image file
# larger than that is rare, and a file that large only costs memory while it is read.
DEFAULT_MAX_FILE_BYTES = 64 * 2**20


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


@dataclasses.dataclass(frozen=True)
class _Limits:
    """What `list_class_folders` takes: the size cap, whether links may leave the folder, and the
    folder's real path they are measured against."""

    max_file_bytes: int
    follow_links: bool
    root: str


def _entries(folder):
    """`(name, path, is_folder, is_link)` of a folder's entries, sorted by name.

    A local folder is read with one `os.scandir`, which knows each entry's type from the listing
    (a link by its target, as `tf.io.gfile.isdir`); a remote one (`gs://...`) through
    `tf.io.gfile`, which asks the file system once per entry (and has no links).
    """
    if is_local(folder):
        with os.scandir(folder) as found:
            return sorted(
                (entry.name, entry.path, _is_dir(entry), entry.is_symlink()) for entry in found
            )
    names = sorted(name.rstrip("/") for name in tf.io.gfile.listdir(folder))
    return [
        (name, os.path.join(folder, name), tf.io.gfile.isdir(os.path.join(folder, name)), False)
        for name in names
    ]


def _is_dir(entry):
    try:
        return entry.is_dir()
    except OSError:  # a link loop, a folder we may not read: a file that will be named unreadable
        return False


def _leaves(path, limits):
    """Whether the link `path` points outside the folder being listed (and may not be followed)."""
    if limits.follow_links or not is_local(path):
        return False
    target = os.path.realpath(path)
    return os.path.commonpath([target, limits.root]) != limits.root


def _file_problem(path, limits):
    """Why the image file `path` is skipped before it is read (None: it is read).

    A local file's size and type come from one `stat` of its target; a remote file's size is
    checked as it is read (`conversion.convert_image` reads no more than the cap)."""
    if not is_local(path):
        return None
    try:
        status = os.stat(path)
    except OSError:
        return None  # a broken link or a file gone: its read says it is unreadable
    if not stat.S_ISREG(status.st_mode):
        return NOT_A_FILE
    if status.st_size > limits.max_file_bytes:
        return TOO_LARGE
    return None


def _images_below(folder, skipped, searched, limits):
    """The image paths below `folder`, depth first in sorted order; the rest goes to `skipped`.
    `searched` holds the real paths of the folders already searched, so that a link back to one of
    them is not followed around."""
    searched.add(_real_path(folder))
    images = []
    for name, path, is_folder, is_link in _entries(folder):
        if is_folder and name.startswith("."):
            skipped.setdefault(HIDDEN_FOLDER, []).append(path)
        elif is_link and _leaves(path, limits):
            skipped.setdefault(LINK_OUTSIDE, []).append(path)
        elif is_folder and _real_path(path) in searched:
            skipped.setdefault(SEARCHED_FOLDER, []).append(path)
        elif is_folder:
            images.extend(_images_below(path, skipped, searched, limits))
        elif name.lower().endswith(IMAGE_EXTENSIONS):
            problem = _file_problem(path, limits)
            if problem is None:
                images.append(path)
            else:
                skipped.setdefault(problem, []).append(path)
        else:
            skipped.setdefault(UNSUPPORTED_TYPE, []).append(path)
    return images


def list_class_folders(
    image_dir, flag="image_dir", *, max_file_bytes=DEFAULT_MAX_FILE_BYTES, follow_links=False
):
    """Lists the classes of `image_dir` and their images.

    Args:
      image_dir: a folder with one sub-folder of images per class.
      flag: how the caller names `image_dir` in an error.
      max_file_bytes: image files larger than this are skipped (`TOO_LARGE`) unread.
      follow_links: take links (to files or folders) whose target is outside `image_dir`;
        skipped (`LINK_OUTSIDE`) otherwise.

    Returns:
      A `ClassFolders`.

    Raises:
      ValueError: if `image_dir` is not a folder, or has no class folder.
    """
    if not tf.io.gfile.isdir(image_dir):
        raise ValueError(f"{flag} {shown(image_dir)} is not a directory.")
    if isinstance(max_file_bytes, bool) or not isinstance(max_file_bytes, int) or max_file_bytes < 1:
        raise ValueError(f"max_file_bytes must be a positive integer (the largest image file read, in bytes), got {max_file_bytes!r}.")
    limits = _Limits(max_file_bytes, follow_links, _real_path(image_dir))
    skipped, class_folders = {}, []
    for name, path, is_folder, is_link in _entries(image_dir):
        if is_folder and name.startswith("."):
            skipped.setdefault(HIDDEN_FOLDER, []).append(path)
        elif is_link and _leaves(path, limits):
            skipped.setdefault(LINK_OUTSIDE, []).append(path)
        elif is_folder:
            class_folders.append((name, path))
        else:
            skipped.setdefault(NOT_IN_CLASS_FOLDER, []).append(path)
    if not class_folders:
        raise ValueError(f"{shown(image_dir)} has no sub-folders: put each class's images in their own sub-folder (<image_dir>/<class name>/<image>.jpg).")
    files_by_class, empty_classes, folders_by_class = {}, [], {}
    for name, path in class_folders:
        # The class's name as records and label maps store it: one line of UTF-8.
        class_name = stored(name)
        if class_name in folders_by_class:
            raise ValueError(f"The class folders {shown(folders_by_class[class_name])} and {shown(path)} have the same name once escaped ({shown(class_name)}): rename one.")
        folders_by_class[class_name] = path
        images = _images_below(path, skipped, set(), limits)
        if images:
            files_by_class[class_name] = images
        else:
            empty_classes.append(class_name)
    return ClassFolders(files_by_class, empty_classes, skipped)
