"""Tests of the writer (`data.write_tfrecords`, `python -m tpu_scale.data.convert`) on real images.

The images are scikit-learn's digits (1797 greyscale 8x8 scans of handwritten digits, 10 classes,
shipped inside the package), upscaled to 32x32 and saved as JPEG and PNG files in one folder per
class, with the kinds of bad files a photo folder collects beside them. Each file is named after its
index in the digits arrays, so every stored record can be traced back to its source image and class.
"""

import io
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image  # noqa: E402  (pillow is a test requirement)

from tpu_scale.data import ImageNetInput, write_tfrecords
from tpu_scale.data import convert as write_module
from tpu_scale.data.reencode import as_rgb_jpeg
from tpu_scale.data.schema import read_label_map

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BAD_FILES = {
    "truncated or corrupt JPEG": ["3/cut_in_half.jpg"],
    "not a decodable image": ["4/text_named.jpg"],
    "unsupported file type": ["4/notes.txt", "5/scan.tiff"],
}


def _digits():
    datasets = pytest.importorskip("sklearn.datasets")
    digits = datasets.load_digits()
    return digits.images, digits.target


def _digit_image(pixels):
    grey = np.rint(pixels * (255.0 / 16.0)).astype(np.uint8)
    return Image.fromarray(grey).resize((32, 32), Image.BILINEAR)


def _encoded(image, image_format):
    buffer = io.BytesIO()
    image.save(buffer, image_format)
    return buffer.getvalue()


def write_digit_folders(root, indices=None, *, bad_files=True):
    """Class folders `root/<digit>/digit_<index>.jpg|png`; returns {file name: digit}."""
    images, targets = _digits()
    indices = range(len(targets)) if indices is None else indices
    sources = {}
    for index in indices:
        digit = int(targets[index])
        os.makedirs(os.path.join(root, str(digit)), exist_ok=True)
        # Alternating formats: JPEGs are stored as they are, PNGs re-encoded.
        image_format, extension = ("JPEG", "jpg") if index % 2 == 0 else ("PNG", "png")
        name = f"digit_{index:04d}.{extension}"
        with open(os.path.join(root, str(digit), name), "wb") as f:
            f.write(_encoded(_digit_image(images[index]), image_format))
        sources[name] = digit
    if bad_files:
        jpeg = _encoded(_digit_image(images[0]), "JPEG")
        with open(os.path.join(root, "3", "cut_in_half.jpg"), "wb") as f:
            f.write(jpeg[: len(jpeg) // 2])
        with open(os.path.join(root, "4", "text_named.jpg"), "w") as f:
            f.write("not an image, whatever the name says\n")
        with open(os.path.join(root, "4", "notes.txt"), "w") as f:
            f.write("notes\n")
        Image.fromarray(np.zeros((8, 8), np.uint8)).save(os.path.join(root, "5", "scan.tiff"))
        os.makedirs(os.path.join(root, "empty_class"))
    return sources


def read_records(pattern):
    """(file name, stored label, class name, image bytes) of every record of the files."""
    files = sorted(tf.io.gfile.glob(pattern))
    spec = {
        "image/encoded": tf.io.FixedLenFeature([], tf.string),
        "image/class/label": tf.io.FixedLenFeature([], tf.int64),
        "image/class/synset": tf.io.FixedLenFeature([], tf.string),
        "image/filename": tf.io.FixedLenFeature([], tf.string),
    }
    rows = []
    for record in tf.data.TFRecordDataset(files):
        features = tf.io.parse_single_example(record, spec)
        rows.append(
            (
                features["image/filename"].numpy().decode(),
                int(features["image/class/label"]),
                features["image/class/synset"].numpy().decode(),
                features["image/encoded"].numpy(),
            )
        )
    return rows


def record_counts(paths):
    return [sum(1 for _ in tf.data.TFRecordDataset(path)) for path in paths]


def leftovers(parent):
    return [name for name in os.listdir(parent) if ".incomplete-" in name or ".replaced" in name]


@pytest.fixture(scope="module")
def digits_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("digits") / "images"
    sources = write_digit_folders(str(root))
    return str(root), sources


@pytest.fixture(scope="module")
def converted(digits_folder, tmp_path_factory):
    image_dir, sources = digits_folder
    output_dir = str(tmp_path_factory.mktemp("converted") / "records")
    summary = write_tfrecords(image_dir, output_dir, num_threads=2)
    return summary, output_dir, sources


def test_split_is_stratified_disjoint_and_labels_match_the_source_classes(converted):
    summary, output_dir, sources = converted
    train = read_records(os.path.join(output_dir, "train-*"))
    validation = read_records(os.path.join(output_dir, "validation-*"))
    train_names = {row[0] for row in train}
    validation_names = {row[0] for row in validation}
    assert len(train_names) == len(train) and len(validation_names) == len(validation)
    assert not train_names & validation_names
    assert train_names | validation_names == set(sources)  # every good image, none of the bad files
    for name, stored_label, class_name, _ in train + validation:
        assert stored_label - 1 == sources[name]  # label_offset 1: ids are the digits themselves
        assert class_name == str(sources[name])
    # Stratified: each class holds out its own 10%, rounded.
    per_class = np.bincount(list(sources.values()), minlength=10)
    held_out = np.bincount([sources[name] for name in validation_names], minlength=10)
    np.testing.assert_array_equal(held_out, np.floor(per_class * 0.1 + 0.5).astype(int))
    assert summary.split_counts == {"train": len(train), "validation": len(validation)}


def test_images_are_stored_faithfully(converted, digits_folder):
    _, output_dir, _ = converted
    image_dir, _ = digits_folder
    images, _ = _digits()
    for name, _, class_name, encoded in read_records(os.path.join(output_dir, "validation-*")):
        with open(os.path.join(image_dir, class_name, name), "rb") as f:
            original = f.read()
        if name.endswith(".jpg"):
            assert encoded == original  # JPEGs byte for byte
        else:
            assert tf.io.is_jpeg(encoded)  # PNGs re-encoded, same pixels up to JPEG error
            expected = np.asarray(_digit_image(images[int(name[6:10])]), np.float32)
            decoded = tf.io.decode_jpeg(encoded, channels=1).numpy()[..., 0].astype(np.float32)
            assert np.abs(decoded - expected).mean() < 4.0


def test_label_map_and_labels_txt(converted):
    summary, output_dir, sources = converted
    label_map = read_label_map(output_dir)
    assert label_map == read_label_map(os.path.join(output_dir, "train-*"))
    assert label_map.class_names == tuple(str(digit) for digit in range(10))
    assert label_map.label_offset == 1 and label_map.num_classes == 10
    assert label_map.counts == summary.split_counts
    assert sum(label_map.class_counts["train"]) == summary.split_counts["train"]
    assert [a + b for a, b in zip(*label_map.class_counts.values())] == np.bincount(
        list(sources.values())
    ).tolist()
    with open(os.path.join(output_dir, "labels.json")) as f:
        content = json.load(f)
    assert content["classes"][3] == {"id": 3, "name": "3", "stored_label": 4}
    # Each shard's record count, as the reader counts its records.
    shards = sorted(tf.io.gfile.glob(os.path.join(output_dir, "*-of-*")))
    assert label_map.record_counts == {
        os.path.basename(path): sum(1 for _ in tf.data.TFRecordDataset(path)) for path in shards
    }
    with open(os.path.join(output_dir, "labels.txt")) as f:
        assert f.read() == "".join(f"{digit}\n" for digit in range(10))


def test_summary_counts_and_names_every_skipped_file(converted, digits_folder):
    summary, _, _ = converted
    image_dir, sources = digits_folder
    expected = {
        reason: [os.path.join(image_dir, *name.split("/")) for name in names]
        for reason, names in BAD_FILES.items()
    }
    assert summary.skipped == expected
    assert summary.empty_classes == ["empty_class"]
    assert summary.class_names == [str(digit) for digit in range(10)]  # the empty class takes no id
    assert summary.num_examples == len(sources) and summary.num_skipped == 4
    assert summary.num_reencoded == sum(name.endswith(".png") for name in sources)
    report = summary.describe(max_names=1)
    assert "empty_class" in report
    assert re.search(r"unsupported file type \(2\): '\S+notes\.txt' and 1 more", report)
    assert "cut_in_half.jpg" in report and "text_named.jpg" in report
    assert f"train: {summary.split_counts['train']} images in 8 shards" in report


def test_no_empty_shards(converted, tmp_path):
    summary, _, _ = converted
    assert all(count > 0 for count in record_counts(summary.paths))
    # More shards than images, and a shard whose only image is unusable: fewer shards, none empty.
    image_dir = tmp_path / "few"
    write_digit_folders(str(image_dir), indices=[0, 1, 2, 3], bad_files=False)
    (image_dir / "0" / "broken.jpg").write_bytes(b"\xff\xd8\xff broken")
    summary = write_tfrecords(
        str(image_dir), str(tmp_path / "out"), num_shards=16, validation_fraction=0
    )
    names = sorted(os.listdir(tmp_path / "out"))
    assert names == ["labels.json", "labels.txt", "skipped.json"] + [
        f"train-0000{i}-of-00004" for i in range(4)
    ]
    assert record_counts(summary.paths) == [1, 1, 1, 1]
    assert summary.skipped == {"truncated or corrupt JPEG": [str(image_dir / "0" / "broken.jpg")]}


def test_default_shard_count_follows_the_image_count():
    assert write_module.default_num_shards(3) == 3
    assert write_module.default_num_shards(1617) == 8
    assert write_module.default_num_shards(1_281_167) == 1252


def test_strict_fails_naming_the_files_and_writes_nothing(digits_folder, tmp_path):
    image_dir, _ = digits_folder
    with pytest.raises(ValueError, match="strict") as error:
        write_tfrecords(image_dir, str(tmp_path / "out"), strict=True)
    for name in ["notes.txt", "scan.tiff", "empty_class"]:
        assert name in str(error.value)
    assert os.listdir(tmp_path) == []
    # Undecodable images are only found by decoding them: strict stops at the first, naming it.
    clean = tmp_path / "clean"
    write_digit_folders(str(clean), indices=range(20), bad_files=False)
    (clean / "1" / "text_named.jpg").write_text("text")
    with pytest.raises(ValueError, match=r"strict: '[^']*text_named\.jpg' cannot be stored"):
        write_tfrecords(str(clean), str(tmp_path / "out"), strict=True)
    assert sorted(os.listdir(tmp_path)) == ["clean"]


def test_abort_mid_write_leaves_nothing_that_looks_finished(monkeypatch, tmp_path):
    image_dir = tmp_path / "images"
    write_digit_folders(str(image_dir), indices=range(40), bad_files=False)
    output_dir = tmp_path / "records"
    original = write_module._write_shard
    calls = []

    def failing_write_shard(path, *args):
        calls.append(path)
        if len(calls) == 3:
            raise OSError("disk full")
        return original(path, *args)

    monkeypatch.setattr(write_module, "_write_shard", failing_write_shard)
    with pytest.raises(OSError, match="disk full"):
        write_tfrecords(str(image_dir), str(output_dir), num_threads=1)
    assert len(calls) >= 3  # shards were written before the failure
    assert not output_dir.exists() and leftovers(tmp_path) == []

    # An abort while replacing a finished conversion keeps the old one intact.
    monkeypatch.setattr(write_module, "_write_shard", original)
    write_tfrecords(str(image_dir), str(output_dir), num_shards=2, validation_fraction=0)
    before = {name: (output_dir / name).read_bytes() for name in os.listdir(output_dir)}
    calls.clear()
    monkeypatch.setattr(write_module, "_write_shard", failing_write_shard)
    with pytest.raises(OSError, match="disk full"):
        write_tfrecords(str(image_dir), str(output_dir), overwrite=True, num_threads=1)
    assert {name: (output_dir / name).read_bytes() for name in os.listdir(output_dir)} == before
    assert leftovers(tmp_path) == []


def test_stale_staging_folders_of_killed_writers_are_removed(tmp_path, caplog):
    import socket

    from tpu_scale.data.output_dir import make_staging_dir

    image_dir = tmp_path / "images"
    write_digit_folders(str(image_dir), indices=range(20), bad_files=False)
    output_dir = tmp_path / "records"
    # A writer killed mid-way: its staging folder, with a shard, names a process that is gone.
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    killed = tmp_path / ".records.incomplete-killed"
    killed.mkdir()
    (killed / "train-00000.incomplete").write_bytes(b"half a shard")
    (killed / "writer").write_text(f"{socket.gethostname()} {gone.pid}")
    # An older writer's folder without a writer file, and one of a writer still running (this one).
    older = tmp_path / ".records.incomplete-older"
    older.mkdir()
    running = make_staging_dir(str(output_dir))
    # Another output's staging folder is not this writer's business.
    other = tmp_path / ".other.incomplete-1234"
    other.mkdir()
    with caplog.at_level("WARNING", logger="tpu_scale"):
        write_tfrecords(str(image_dir), str(output_dir), num_shards=2)
    assert sorted(leftovers(tmp_path)) == sorted([os.path.basename(running), other.name])
    removed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Removed")]
    assert len(removed) == 2
    assert any(str(killed) in m for m in removed) and any(str(older) in m for m in removed)
    assert "writer" not in os.listdir(output_dir)


def test_rerun_is_refused_unless_overwrite(tmp_path):
    image_dir = tmp_path / "images"
    write_digit_folders(str(image_dir), indices=range(30), bad_files=False)
    output_dir = tmp_path / "records"
    write_tfrecords(str(image_dir), str(output_dir), num_shards=4)
    with pytest.raises(ValueError, match="already holds a finished conversion.*overwrite"):
        write_tfrecords(str(image_dir), str(output_dir))
    summary = write_tfrecords(str(image_dir), str(output_dir), num_shards=2, overwrite=True)
    assert summary.replaced_existing
    assert sorted(name for name in os.listdir(output_dir) if name.startswith("train")) == [
        "train-00000-of-00002",
        "train-00001-of-00002",
    ]
    assert leftovers(tmp_path) == []
    other = tmp_path / "other"
    other.mkdir()
    (other / "thesis.tex").write_text("precious")
    with pytest.raises(ValueError, match="thesis.tex"):
        write_tfrecords(str(image_dir), str(other), overwrite=True)
    assert (other / "thesis.tex").read_text() == "precious"


def test_validation_dir_and_no_validation(tmp_path):
    write_digit_folders(str(tmp_path / "train"), indices=range(60), bad_files=False)
    validation_sources = write_digit_folders(
        str(tmp_path / "val"), indices=range(60, 80), bad_files=False
    )
    summary = write_tfrecords(
        str(tmp_path / "train"), str(tmp_path / "out"), validation_dir=str(tmp_path / "val")
    )
    assert summary.split_counts == {"train": 60, "validation": 20}
    rows = read_records(str(tmp_path / "out" / "validation-*"))
    assert {name: label - 1 for name, label, _, _ in rows} == validation_sources
    with pytest.raises(ValueError, match="not both"):
        write_tfrecords(
            str(tmp_path / "train"),
            str(tmp_path / "x"),
            validation_fraction=0.2,
            validation_dir=str(tmp_path / "val"),
        )
    (tmp_path / "val" / "cat").mkdir()
    (tmp_path / "val" / "cat" / "c.jpg").write_bytes(
        _encoded(_digit_image(_digits()[0][0]), "JPEG")
    )
    with pytest.raises(ValueError, match="no training images.*cat"):
        write_tfrecords(
            str(tmp_path / "train"), str(tmp_path / "y"), validation_dir=str(tmp_path / "val")
        )

    summary = write_tfrecords(str(tmp_path / "train"), str(tmp_path / "all"), validation_fraction=0)
    assert list(summary.split_counts) == ["train"] and summary.split_counts["train"] == 60
    assert not [n for n in os.listdir(tmp_path / "all") if n.startswith("validation")]


def test_reader_takes_offset_and_class_count_from_the_label_map(converted):
    _, output_dir, sources = converted
    inp = ImageNetInput(
        os.path.join(output_dir, "validation-*"),
        is_training=False,
        global_batch_size=64,
        image_size=16,
    )
    assert inp.label_offset == 1 and inp.num_classes == 10
    labels = np.concatenate([labels.numpy() for _, labels in inp.dataset()])
    validation = read_records(os.path.join(output_dir, "validation-*"))
    assert sorted(labels.tolist()) == sorted(sources[name] for name, _, _, _ in validation)
    with pytest.raises(ValueError, match=r"label_offset=0.*labels\.json.*label_offset=1"):
        ImageNetInput(
            os.path.join(output_dir, "train-*"),
            is_training=True,
            global_batch_size=8,
            label_offset=0,
        )


def test_package_exports_the_function():
    assert write_tfrecords is write_module.write_tfrecords


def test_command_line(tmp_path):
    image_dir = tmp_path / "images"
    write_digit_folders(str(image_dir), indices=range(40))
    # As a user's shell runs it: no TF_CPP_MIN_LOG_LEVEL.
    env = dict(os.environ, PYTHONPATH=REPO)
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    command = [
        sys.executable,
        "-m",
        "tpu_scale.data.convert",
        "--image_dir",
        str(image_dir),
    ]

    def run(*args):
        return subprocess.run(
            command + list(args), env=env, capture_output=True, text=True, timeout=300, check=False
        )

    done = run("--output_dir", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    # Four of each digit: one of each class goes to validation.
    assert re.search(r"train: 30 images in \d shards", done.stdout)
    assert re.search(r"validation: 10 images in \d shards", done.stdout)
    for name in ["cut_in_half.jpg", "text_named.jpg", "notes.txt", "scan.tiff", "empty_class"]:
        assert name in done.stdout
    assert read_label_map(str(tmp_path / "out")).num_classes == 10
    # The summary names the broken images, without a traceback.
    assert "Traceback" not in done.stderr

    strict = run("--output_dir", str(tmp_path / "strict"), "--strict")
    assert strict.returncode == 1
    assert "Traceback" not in strict.stderr and "notes.txt" in strict.stderr
    assert not (tmp_path / "strict").exists()

    again = run("--output_dir", str(tmp_path / "out"))
    assert again.returncode == 1 and "--overwrite" in again.stderr

    with pytest.raises(SystemExit):
        write_module.main(["--image_dir", str(tmp_path / "nothing"), "--output_dir", str(tmp_path)])


def test_progress_counts_every_image_once_and_the_command_line_shows_it(tmp_path, monkeypatch):
    image_dir = str(tmp_path / "images")
    write_digit_folders(image_dir, indices=range(40))  # and 2 broken image files
    calls = []
    write_tfrecords(
        image_dir, str(tmp_path / "out"), num_threads=3, progress=lambda *c: calls.append(c)
    )
    assert [done for done, _ in calls] == list(range(1, 43))
    assert {total for _, total in calls} == {42}

    class Stream(io.StringIO):
        def __init__(self, terminal):
            super().__init__()
            self.terminal = terminal

        def isatty(self):
            return self.terminal

    clock = iter(range(100))
    monkeypatch.setattr(write_module.time, "monotonic", lambda: float(next(clock)))
    log = Stream(terminal=False)
    line = write_module._ProgressLine(log, interval=2.5)  # started at t=0
    for done in range(1, 11):  # at t = 1, 2, ..., 10
        line(done, 10)
    # A log gets a line every 2.5 s and one at the end.
    assert log.getvalue().splitlines() == [
        "images: 3/10 (30%), 1/s, 7 s left",
        "images: 6/10 (60%), 1/s, 4 s left",
        "images: 9/10 (90%), 1/s, 1 s left",
        "images: 10/10 (100%), 1/s, 0 s left",
    ]
    terminal = Stream(terminal=True)
    line = write_module._ProgressLine(terminal, interval=0)
    line(1, 2)
    line(2, 2)
    # A terminal gets one line, rewritten in place, ended once all is done.
    assert terminal.getvalue().count("\n") == 1 and terminal.getvalue().count("\r") == 2


def test_small_classes_still_give_validation_and_one_class_is_refused(tmp_path):
    # Three digits per class: 10% rounds to none, yet every class keeps one for validation.
    write_digit_folders(str(tmp_path / "small"), indices=range(30), bad_files=False)
    summary = write_tfrecords(str(tmp_path / "small"), str(tmp_path / "out"))
    assert summary.split_counts == {"train": 20, "validation": 10}
    labels = [label for _, label, _, _ in read_records(str(tmp_path / "out" / "validation-*"))]
    assert sorted(labels) == list(range(1, 11))  # one of each class (label_offset 1)
    # A single class folder cannot train a classifier: refused, naming the class.
    os.makedirs(tmp_path / "one")
    first_class = sorted(os.listdir(tmp_path / "small"))[0]
    os.rename(tmp_path / "small" / first_class, tmp_path / "one" / "a")
    with pytest.raises(ValueError, match="one class folder only.*'a'.*at least two classes"):
        write_tfrecords(str(tmp_path / "one"), str(tmp_path / "out_one"))
    assert not os.path.exists(tmp_path / "out_one")


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_rotated_photos_are_stored_upright(tmp_path, orientation):
    """A camera JPEG with an EXIF orientation tag is stored as a viewer shows it (pillow's
    `ImageOps.exif_transpose` is the reference), on a real photograph."""
    from PIL import ImageOps
    from sklearn.datasets import load_sample_image

    photo = Image.fromarray(load_sample_image("flower.jpg")[100:196, 200:328])  # 96 x 128
    tags = Image.Exif()
    tags[0x0112] = orientation
    buffer = io.BytesIO()
    photo.save(buffer, "JPEG", quality=95, exif=tags.tobytes())
    jpeg = buffer.getvalue()

    stored, height, width, reencoded = as_rgb_jpeg(jpeg)
    expected = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(jpeg))).convert("RGB"))
    got = tf.io.decode_jpeg(stored).numpy()
    assert got.shape == expected.shape == (height, width, 3)
    assert reencoded == (orientation != 1)
    # Within one JPEG re-encoding (and the two decoders' chroma upsampling) of the reference...
    assert np.abs(got.astype(int) - expected.astype(int)).mean() < 5.0
    if orientation == 1:
        assert stored == jpeg  # stored byte for byte
    elif got.shape == np.asarray(photo).shape:
        # ...and far from the pixels as stored (a mirror or a half turn of a photograph).
        assert np.abs(got.astype(int) - np.asarray(photo).astype(int)).mean() > 20.0


def test_jpeg_headers_are_read_as_pillow_reads_them_and_xmp_turns_a_photo_too():
    """The writer asks Pillow for a JPEG's header (size, components, orientation) only when the
    file holds an orientation tag; otherwise TensorFlow's decoder reads it, in the pipeline or on
    its own. Both readings give Pillow's answer for every kind of JPEG, and a photo whose only
    tag is XMP's `tiff:Orientation` is still stored upright."""
    from sklearn.datasets import load_sample_image

    from tpu_scale.data import reencode

    photo = Image.fromarray(load_sample_image("china.jpg")[150:214, 300:380])  # 64 x 80
    turned, upright = Image.Exif(), Image.Exif()
    turned[0x0112], upright[0x0112] = 6, 1
    xmp = (
        b'<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/'
        b'22-rdf-syntax-ns#"><rdf:Description xmlns:tiff="http://ns.adobe.com/tiff/1.0/" '
        b'tiff:Orientation="6"/></rdf:RDF></x:xmpmeta>'
    )
    jpegs = {
        "rgb": _encoded(photo, "JPEG"),
        "grey": _encoded(photo.convert("L"), "JPEG"),
        "cmyk": _encoded(photo.convert("CMYK"), "JPEG"),
        "progressive": _saved(photo, "JPEG", progressive=True),
        "exif upright": _saved(photo, "JPEG", exif=upright.tobytes()),
        "exif turned": _saved(photo, "JPEG", exif=turned.tobytes()),
        "xmp turned": _saved(photo, "JPEG", xmp=xmp),
    }
    for name, jpeg in jpegs.items():
        in_graph = reencode.decode_in_graph(tf.constant(jpeg))
        height, width, reencoded, channels = (v.numpy() for v in in_graph)
        decoded = reencode.Decoded(int(height), int(width), reencoded, int(channels))
        expected = reencode._pillow_header(jpeg)
        assert reencode._jpeg_header(jpeg) == expected, name
        assert reencode._jpeg_header(jpeg, decoded) == expected, name
    assert [reencode._pillow_header(jpegs[n])[2:] for n in ("grey", "cmyk", "xmp turned")] == [
        (1, 1),
        (4, 1),
        (3, 6),
    ]
    stored, height, width, reencoded = as_rgb_jpeg(jpegs["xmp turned"])
    assert reencoded and (height, width) == (80, 64)


def test_a_folder_of_images_is_converted_once_and_the_skipped_files_named(tmp_path, caplog):
    from tpu_scale import data

    image_dir = tmp_path / "images"
    write_digit_folders(str(image_dir), indices=range(30))
    records = str(tmp_path / "run" / "records")
    common = dict(image_size=16, global_batch_size=8, records_dir=records)
    with caplog.at_level("INFO"):
        inputs = data.inputs(str(image_dir), **common)
    assert inputs.train_data == os.path.join(records, "train-*")
    assert inputs.num_classes == 10 and inputs.label_map.path == os.path.join(records, "labels.json")
    assert "cut_in_half.jpg" in caplog.text  # the conversion's report, in the run's log
    label_map = os.path.join(records, "labels.json")
    written = os.stat(label_map).st_mtime_ns
    caplog.clear()
    with caplog.at_level("INFO"):
        again = data.inputs(str(image_dir), **common)
    assert os.stat(label_map).st_mtime_ns == written  # a resumed run reads the first records
    assert "written earlier" in caplog.text and "cut_in_half.jpg" not in caplog.text
    assert (again.train_examples, again.validation_examples) == (
        inputs.train_examples,
        inputs.validation_examples,
    )


def test_the_decoding_pipeline_stores_what_the_per_image_path_stores(tmp_path, monkeypatch):
    """The local writer reads and decodes in a `tf.data` pipeline; the reference is `convert_image`
    reading and decoding each file itself (the path Beam's workers run). Every format the writer
    takes, and every kind of broken file, give the same records, in the same shards and order, and
    the same skip reasons; only the broken files take `convert_image`'s own reading."""
    from sklearn.datasets import load_sample_image

    from tpu_scale.data.convert import convert_image, plan_conversion

    photo = Image.fromarray(load_sample_image("china.jpg")[150:214, 300:380])  # 64 x 80
    rotated = Image.Exif()
    rotated[0x0112] = 6
    jpeg = _encoded(photo, "JPEG")
    starts_of = {marker: jpeg.index(marker) for marker in (b"\xff\xc0", b"\xff\xc4")}
    files = {
        "rgb.jpg": jpeg,
        "grey.jpg": _encoded(photo.convert("L"), "JPEG"),
        "cmyk.jpg": _encoded(photo.convert("CMYK"), "JPEG"),
        "progressive.jpg": _saved(photo, "JPEG", progressive=True),
        "rotated.jpg": _saved(photo, "JPEG", exif=rotated.tobytes()),
        "photo.png": _encoded(photo, "PNG"),
        "grey.png": _encoded(photo.convert("L"), "PNG"),
        "photo.gif": _encoded(photo, "GIF"),
        "photo.bmp": _encoded(photo, "BMP"),
        "photo.webp": _saved(photo, "WEBP", lossless=True),
        "cut_off.jpg": jpeg[: len(jpeg) // 2],
        "cut_off.png": _encoded(photo, "PNG")[:300],
        "empty.jpg": b"",
        "text.jpg": b"not an image at all",
        "height_0.jpg": _patched(jpeg, starts_of[b"\xff\xc0"] + 5, b"\x00\x00"),
        "bad_huffman.jpg": _patched(jpeg, starts_of[b"\xff\xc4"] + 4, b"\xff"),
    }
    image_dir = tmp_path / "images"
    for i, (name, data) in enumerate(sorted(files.items())):
        (image_dir / f"class_{i % 2}").mkdir(parents=True, exist_ok=True)
        (image_dir / f"class_{i % 2}" / name).write_bytes(data)

    own_reads = []

    def counted(path, *args, read=None, **limits):
        if read is None:
            own_reads.append(os.path.basename(path))
        return convert_image(path, *args, read=read, **limits)

    monkeypatch.setattr(write_module, "convert_image", counted)
    summary = write_tfrecords(
        str(image_dir), str(tmp_path / "out"), num_shards=3, validation_fraction=0
    )
    shards = sorted(summary.split_paths["train"])  # named in the plan's order
    stored = [bytes(r.numpy()) for r in tf.data.TFRecordDataset(shards)]

    plan = plan_conversion(str(image_dir), 3, validation_fraction=0)
    expected, skipped = [], {}
    for shard in plan.shards:
        for path, class_id in shard.images:
            one = convert_image(path, class_id, plan.class_names, plan.label_offset)
            if one.record is None:
                skipped.setdefault(one.skip_reason, set()).add(os.path.basename(path))
            else:
                expected.append(one.record)
    assert stored == expected and len(stored) == 10
    assert {reason: {os.path.basename(p) for p in paths} for reason, paths in summary.skipped.items()} == skipped
    # Only broken files are read again (files without a header the pipeline left undecoded are
    # judged from the bytes it read).
    broken = {name for names in skipped.values() for name in names}
    assert own_reads and set(own_reads) <= broken
    assert {"cut_off.jpg", "bad_huffman.jpg"} <= set(own_reads)


def _saved(image, image_format, **options):
    buffer = io.BytesIO()
    image.save(buffer, image_format, **options)
    return buffer.getvalue()


def _patched(data, at, replacement):
    return data[:at] + replacement + data[at + len(replacement) :]
