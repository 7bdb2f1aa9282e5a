"""Tests of the writer on Apache Beam (`tpu_scale.data.beam_writer`) against the local writer.

The folder is real: the first 300 of scikit-learn's handwritten digits as JPEG and PNG files
(`tpu_scale.testing.write_digits_folder`, with the broken files it puts among them: a cut-off JPEG,
a text file named .jpg, a note), plus a camera photo with an EXIF orientation tag, a CMYK JPEG, a
photo in a nested folder and an empty class folder. Both writers convert it with the same seed; the
Beam runs use the DirectRunner in its two forms (in memory, and two worker processes).
"""

import io
import json
import os
import sys

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from tpu_scale.data import convert as write_module
from tpu_scale.data import write_tfrecords
from tpu_scale.testing.digits import write_digits_folder

IN_MEMORY = "runner=DirectRunner,direct_running_mode=in_memory"
TWO_PROCESSES = "runner=DirectRunner,direct_num_workers=2,direct_running_mode=multi_processing"
# The worker processes' start-up lines (INFO) are noise in a test's output.
QUIET = ",default_sdk_harness_log_level=WARNING"


def needs_beam():
    pytest.importorskip(
        "apache_beam", reason='the Beam writer needs Apache Beam: pip install -e ".[beam]"'
    )


def _photo(orientation=1, mode="RGB"):
    from sklearn.datasets import load_sample_image

    photo = Image.fromarray(load_sample_image("china.jpg")[50:146, 100:228]).convert(mode)
    tags = Image.Exif()
    tags[0x0112] = orientation
    buffer = io.BytesIO()
    photo.save(buffer, "JPEG", quality=90, exif=tags.tobytes())
    return buffer.getvalue()


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("beam") / "images")
    write_digits_folder(root, count=300)
    for name, jpeg in [("rotated.jpg", _photo(orientation=6)), ("cmyk.jpg", _photo(mode="CMYK"))]:
        with open(os.path.join(root, "digit_1", name), "wb") as f:
            f.write(jpeg)
    os.makedirs(os.path.join(root, "digit_2", "2019"))
    with open(os.path.join(root, "digit_2", "2019", "nested.jpg"), "wb") as f:
        f.write(_photo())
    os.makedirs(os.path.join(root, "no_images_yet"))
    return root


@pytest.fixture(scope="module")
def local(image_dir, tmp_path_factory):
    output_dir = str(tmp_path_factory.mktemp("local") / "records")
    return write_tfrecords(image_dir, output_dir, seed=7, num_threads=2), output_dir


def examples_by_split(output_dir):
    """Each split's examples, parsed: a sorted list of (feature key, values) tuples."""
    splits = {}
    for path in sorted(tf.io.gfile.glob(os.path.join(output_dir, "*-of-*"))):
        split = os.path.basename(path).split("-")[0]
        for record in tf.data.TFRecordDataset(path):
            features = tf.train.Example.FromString(record.numpy()).features.feature
            example = tuple(
                sorted(
                    (key, tuple(getattr(value, value.WhichOneof("kind")).value))
                    for key, value in features.items()
                )
            )
            splits.setdefault(split, []).append(example)
    return {split: sorted(examples) for split, examples in splits.items()}


def files(output_dir):
    """{file name: bytes} of a conversion."""
    names = sorted(name.rstrip("/") for name in tf.io.gfile.listdir(output_dir))
    out = {}
    for name in names:
        with tf.io.gfile.GFile(os.path.join(output_dir, name), "rb") as f:
            out[name] = f.read()
    return out


def leftovers(parent):
    return [name for name in tf.io.gfile.listdir(parent) if ".incomplete-" in name]


def same_summary(beam, local):
    paths = {"output_dir", "split_paths", "label_map_path", "skipped_report_path"}
    for field in vars(local):
        if field not in paths:
            assert getattr(beam, field) == getattr(local, field), field
    assert beam.describe().replace(beam.output_dir, "OUT") == local.describe().replace(
        local.output_dir, "OUT"
    )


@pytest.mark.parametrize("options", [IN_MEMORY, TWO_PROCESSES + QUIET], ids=["in_memory", "2"])
def test_beam_writes_what_the_local_writer_writes(image_dir, local, tmp_path, options):
    needs_beam()
    local_summary, local_dir = local
    output_dir = str(tmp_path / "records")
    summary = write_tfrecords(image_dir, output_dir, seed=7, beam_options=options)
    same_summary(summary, local_summary)
    # The same examples in the same splits...
    expected = examples_by_split(local_dir)
    assert examples_by_split(output_dir) == expected
    assert sorted(expected) == ["train", "validation"] and len(expected["validation"]) > 0
    assert sum(map(len, expected.values())) == 303  # 300 digits and 3 photos
    # ...the same label map, counts and skipped-files report; in fact the same files, byte for
    # byte: the shard plan is the same, and each shard is written in the plan's order.
    assert files(output_dir) == files(local_dir)
    assert leftovers(str(tmp_path)) == []


def test_bad_files_are_named_in_the_summary_and_the_report(image_dir, local):
    # The Beam writer's summary, report and skipped.json are checked equal to these above.
    summary, output_dir = local
    path = lambda *parts: os.path.join(image_dir, *parts)  # noqa: E731
    expected = {
        "not a decodable image": [path("digit_5", "not_an_image.jpg")],
        "truncated or corrupt JPEG": [path("digit_3", "cut_off.jpg")],
        "unsupported file type": [path("digit_5", "notes.txt")],
    }
    assert summary.skipped == expected
    assert summary.empty_classes == ["no_images_yet"]
    with open(os.path.join(output_dir, "skipped.json")) as f:
        assert json.load(f) == {"skipped": expected, "empty_classes": ["no_images_yet"]}
    report = summary.describe()
    for name in ["not_an_image.jpg", "cut_off.jpg", "notes.txt", "no_images_yet"]:
        assert name in report
    assert f"all listed in {summary.skipped_report_path}" in report
    # The photo with its EXIF tag, the CMYK JPEG and the PNGs are stored re-encoded.
    assert summary.num_reencoded == 2 + sum(1 for i in range(300) if i % 7 == 0)


def test_command_line_with_beam_names_the_bad_files(image_dir, tmp_path, capsys):
    needs_beam()
    output_dir = str(tmp_path / "records")
    write_module.main(
        ["--image_dir", image_dir, "--output_dir", output_dir, "--seed", "7"]
        + ["--beam_pipeline_options", IN_MEMORY]
    )
    out = capsys.readouterr().out
    assert "Wrote 303 images of 10 classes" in out
    for name in ["not_an_image.jpg", "cut_off.jpg", "notes.txt", "no_images_yet", "skipped.json"]:
        assert name in out


@pytest.mark.parametrize(
    "options, message",
    [
        (
            "runner=DirectRunner,direct_num_wokers=2",
            r"Unknown Beam pipeline option\(s\): direct_num_wokers",
        ),
        ("direct_num_workers=two", r"Invalid Beam pipeline options: .*direct_num_workers.*'two'"),
        ("direct_running_mode=fast", r"Invalid Beam pipeline options: .*'fast'"),
        ("runner=NoSuchRunner", r"Beam runner 'NoSuchRunner' cannot be used: .*DirectRunner"),
        (" , ", "beam_pipeline_options is empty"),
        ("help", "help is not a pipeline option.*--help lists every option"),
    ],
)
def test_bad_options_are_named_before_anything_is_written(
    image_dir, tmp_path, capsys, options, message
):
    needs_beam()
    output_dir = str(tmp_path / "records")
    with pytest.raises(ValueError, match=message):
        write_tfrecords(image_dir, output_dir, beam_options=options)
    assert os.listdir(tmp_path) == []
    # The command line: one line naming the problem, exit status 1, no traceback.
    with pytest.raises(SystemExit) as exit_:
        write_module.main(
            [
                "--image_dir",
                image_dir,
                "--output_dir",
                output_dir,
                "--beam_pipeline_options",
                options,
            ]
        )
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert "error: " in err and "Traceback" not in err and "usage:" not in err
    assert os.listdir(tmp_path) == []


def test_local_writer_options_are_refused_with_beam(image_dir, tmp_path):
    needs_beam()
    with pytest.raises(ValueError, match="num_threads and progress are the local writer's"):
        write_tfrecords(image_dir, str(tmp_path / "out"), num_threads=2, beam_options=IN_MEMORY)


def test_without_beam_the_error_says_how_to_install_it(image_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "apache_beam", None)  # as if not installed: import fails
    with pytest.raises(ImportError, match=r'pip install -e "\.\[beam\]".*pip install apache-beam'):
        write_tfrecords(image_dir, str(tmp_path / "out"), beam_options=IN_MEMORY)
    with pytest.raises(SystemExit):
        write_module.main(
            ["--image_dir", image_dir, "--output_dir", str(tmp_path / "out")]
            + ["--beam_pipeline_options", IN_MEMORY]
        )
    assert "pip install apache-beam" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_strict_fails_after_the_pipeline_naming_the_image(tmp_path):
    needs_beam()
    image_dir = tmp_path / "images"
    write_digits_folder(str(image_dir), count=40)
    (image_dir / "digit_5" / "not_an_image.jpg").unlink()
    (image_dir / "digit_5" / "notes.txt").unlink()
    with pytest.raises(ValueError, match=r"strict: images that cannot be stored.*cut_off\.jpg"):
        write_tfrecords(str(image_dir), str(tmp_path / "out"), strict=True, beam_options=IN_MEMORY)
    assert sorted(os.listdir(tmp_path)) == ["images"]


def test_a_failing_pipeline_leaves_nothing_that_looks_finished(image_dir, tmp_path, monkeypatch):
    needs_beam()
    from tpu_scale.data import convert

    output_dir = tmp_path / "records"
    write_tfrecords(image_dir, str(output_dir), seed=7, beam_options=IN_MEMORY)
    before = files(str(output_dir))
    write_shard, log = convert.write_shard, tmp_path / "shards_begun"

    def failing_write_shard(path, images, num_classes):
        # Counted in a file: the runner runs a copy of this function (its arguments are pickled).
        with open(log, "a") as f:
            f.write(path + "\n")
        if len(log.read_text().splitlines()) == 3:
            raise OSError("disk full")
        return write_shard(path, images, num_classes)

    # The in-memory runner runs the pipeline's functions in this process; write_tfrecords hands
    # the pipeline convert's write_shard.
    monkeypatch.setattr(convert, "write_shard", failing_write_shard)
    with pytest.raises(Exception, match="disk full"):
        write_tfrecords(image_dir, str(output_dir), overwrite=True, beam_options=IN_MEMORY)
    assert len(log.read_text().splitlines()) >= 3
    assert files(str(output_dir)) == before  # the earlier conversion, intact
    assert leftovers(str(tmp_path)) == []


def test_folders_on_another_filesystem_go_through_gfile(image_dir, local):
    """TensorFlow's in-memory filesystem (`ram://`) stands in for a bucket (`gs://`): no `os`
    call reaches it, and folders cannot be renamed there (the output is published file by file)."""
    needs_beam()
    _, local_dir = local
    remote = "ram://beam_test"
    for folder, _, names in os.walk(image_dir):
        target = remote + "/images" + folder[len(image_dir) :]
        tf.io.gfile.makedirs(target)
        for name in names:
            tf.io.gfile.copy(os.path.join(folder, name), f"{target}/{name}")
    try:
        summary = write_tfrecords(
            remote + "/images", remote + "/records", seed=7, beam_options=IN_MEMORY
        )
        assert summary.skipped["truncated or corrupt JPEG"] == [
            remote + "/images/digit_3/cut_off.jpg"
        ]
        written = files(remote + "/records")
        expected = files(local_dir)
        assert written.keys() == expected.keys()
        # The same records; only the reported paths differ.
        assert {k: v for k, v in written.items() if k != "skipped.json"} == {
            k: v for k, v in expected.items() if k != "skipped.json"
        }
        assert sorted(tf.io.gfile.listdir(remote)) == ["images", "records"]  # no staging left
    finally:
        tf.io.gfile.rmtree(remote)


def test_rotated_and_cmyk_photos_are_turned_and_converted_alike(local):
    """The per-image function both writers call turns the EXIF-rotated photo upright (a quarter
    turn makes the 96x128 photo 128x96) and stores the CMYK JPEG as RGB."""
    _, output_dir = local
    rows = {
        dict(example)["image/filename"][0]: dict(example)
        for examples in examples_by_split(output_dir).values()
        for example in examples
    }
    rotated = rows[b"rotated.jpg"]
    assert (rotated["image/height"], rotated["image/width"]) == ((128,), (96,))
    cmyk = tf.io.decode_jpeg(rows[b"cmyk.jpg"]["image/encoded"][0])
    assert cmyk.shape == (96, 128, 3)
    plain = tf.io.decode_jpeg(rows[b"nested.jpg"]["image/encoded"][0])
    assert np.abs(cmyk.numpy().astype(int) - plain.numpy().astype(int)).mean() < 10
