"""Hostile and unlucky files in a folder of class folders: each is skipped, named and counted, and
the conversion finishes with its memory bounded.

The folder holds real images beside: a 30000 x 30000 JPEG with an EXIF orientation tag and a
30000 x 30000 PNG (small files whose headers were patched: nothing decodes 900 million pixels
here), a file named with bytes that are not UTF-8, one whose name holds a newline and a forged log
line, a 3 GiB file named `.jpg` (sparse: it takes no disk), a pipe named `.jpg`, and a link to an
image outside the folder. The command line runs in a process of its own, whose peak resident
memory is measured.
"""

import io
import json
import os
import struct
import subprocess
import sys
import textwrap
import warnings
import zlib

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from tpu_scale.data import write_tfrecords
from tpu_scale.data.convert import convert_image, read_capped
from tpu_scale.data.image_folder import LINK_OUTSIDE, NOT_A_FILE, TOO_LARGE
from tpu_scale.data.names import shown, stored
from tpu_scale.data.reencode import TOO_MANY_PIXELS, Skip, header_size

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BOMB_SIDE = 30000
NON_UTF8 = b"bad_utf8_\xff\xfe.jpg"
FORGED = "bad\nI1207 12:00:00.000000 1 convert.py:1] Wrote 9999 images (forged).jpg"
HUGE_BYTES = 3 * 2**30


def _jpeg(image, **options):
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", **options)
    return buffer.getvalue()


def _photo(seed):
    # Smooth colour gradients with noise: a small stand-in for a photograph.
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 255, 48)
    pixels = np.stack([*np.meshgrid(ramp, ramp[::-1]), np.full((48, 48), 128.0)], axis=-1)
    return Image.fromarray(
        np.clip(pixels + rng.normal(0, 20, pixels.shape), 0, 255).astype(np.uint8)
    )


def bomb_jpeg():
    """A valid 16 x 16 JPEG with an EXIF orientation tag (6: turned a quarter), its frame header
    patched to say 30000 x 30000."""
    tags = Image.Exif()
    tags[0x0112] = 6
    jpeg = _jpeg(Image.new("RGB", (16, 16), "red"), exif=tags.tobytes())
    frame = jpeg.index(b"\xff\xc0")  # SOF0: marker, length (2), precision (1), height, width
    return jpeg[: frame + 5] + struct.pack(">HH", BOMB_SIDE, BOMB_SIDE) + jpeg[frame + 9 :]


def bomb_png():
    """A valid 16 x 16 PNG whose header (IHDR, with its CRC) says 30000 x 30000."""
    buffer = io.BytesIO()
    Image.new("L", (16, 16)).save(buffer, "PNG")
    png = buffer.getvalue()
    header = struct.pack(">II", BOMB_SIDE, BOMB_SIDE) + png[24:29]  # width, height, then the rest
    return png[:16] + header + struct.pack(">I", zlib.crc32(b"IHDR" + header)) + png[33:]


def write_hostile_folder(root, outside):
    """Two classes of real JPEGs and every hostile file; returns {what: path as listed}."""
    root, outside = os.fsencode(root), os.fsencode(outside)
    for index in range(12):
        folder = os.path.join(root, b"cats" if index % 2 else b"dogs")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, b"photo_%02d.jpg" % index), "wb") as f:
            f.write(_jpeg(_photo(index)))
    files = {
        "bomb jpeg": (b"cats/bomb_exif.jpg", bomb_jpeg()),
        "bomb png": (b"dogs/bomb.png", bomb_png()),
        "non-utf-8": (b"cats/" + NON_UTF8, _jpeg(_photo(100))),
        "newline": (b"dogs/" + FORGED.encode(), _jpeg(_photo(101))),
    }
    paths = {}
    for what, (name, data) in files.items():
        with open(os.path.join(root, name), "wb") as f:
            f.write(data)
        paths[what] = os.fsdecode(os.path.join(root, name))
    paths["huge"] = os.fsdecode(os.path.join(root, b"dogs/huge.jpg"))
    with open(paths["huge"], "wb") as f:
        f.truncate(HUGE_BYTES)  # sparse: 3 GiB of zeros that take no disk
    paths["pipe"] = os.fsdecode(os.path.join(root, b"cats/pipe.jpg"))
    os.mkfifo(paths["pipe"])  # read, it would block the reader forever
    os.makedirs(outside, exist_ok=True)
    with open(os.path.join(outside, b"elsewhere.jpg"), "wb") as f:
        f.write(_jpeg(_photo(102)))
    paths["link"] = os.fsdecode(os.path.join(root, b"cats/link_out.jpg"))
    os.symlink(os.path.join(outside, b"elsewhere.jpg"), paths["link"])
    return paths


EXPECTED_SKIPS = {
    TOO_MANY_PIXELS: ["bomb jpeg", "bomb png"],
    TOO_LARGE: ["huge"],
    NOT_A_FILE: ["pipe"],
    LINK_OUTSIDE: ["link"],
}


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    base = tmp_path_factory.mktemp("hostile")
    return str(base / "images"), write_hostile_folder(base / "images", base / "outside")


def _convert_measured(*args):
    """Runs the command line in a child of a fresh process, which reports the child's peak
    resident memory (`ru_maxrss` of its children: only that one). Returns (completed process,
    peak bytes)."""
    command = [sys.executable, "-m", "tpu_scale.data.convert", *args]
    wrapper = textwrap.dedent(
        f"""
        import json, resource, subprocess, sys
        done = subprocess.run({command!r}, capture_output=True, text=True, errors="replace")
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        print(json.dumps([done.returncode, done.stdout, done.stderr, peak]))
        """
    )
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONIOENCODING="utf-8")
    out = subprocess.run(
        [sys.executable, "-c", wrapper], capture_output=True, text=True, env=env, check=True
    )
    returncode, stdout, stderr, peak = json.loads(out.stdout.strip().splitlines()[-1])
    return subprocess.CompletedProcess(command, returncode, stdout, stderr), peak


def _filenames(output_dir):
    files = sorted(tf.io.gfile.glob(os.path.join(output_dir, "*-of-*")))
    spec = {"image/filename": tf.io.FixedLenFeature([], tf.string)}
    return [
        tf.io.parse_single_example(r, spec)["image/filename"].numpy().decode("utf-8")
        for r in tf.data.TFRecordDataset(files)
    ]


def test_the_command_skips_names_and_counts_every_hostile_file_in_bounded_memory(hostile, tmp_path):
    image_dir, paths = hostile
    output_dir = str(tmp_path / "records")
    done, peak = _convert_measured(
        "--image_dir", image_dir, "--output_dir", output_dir, "--num_threads", "2"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # The 3 GiB file was never read: the whole conversion, TensorFlow included (about 0.7 GiB
    # here), stays far below it, and below the 3.5 GiB the command's help states.
    assert peak < 2 * 2**30, f"peak resident memory {peak / 2**30:.2f} GiB"
    assert "Traceback" not in done.stderr
    skipped = sum(len(whats) for whats in EXPECTED_SKIPS.values())
    assert "Wrote 14 images of 2 classes" in done.stdout  # 12 photos, the two odd names
    assert f"Skipped {skipped} file(s):" in done.stdout
    for reason, whats in EXPECTED_SKIPS.items():
        assert f"{reason} ({len(whats)}): " in done.stdout
        for what in whats:
            assert shown(paths[what]) in done.stdout, what
    # No name starts a line of its own: the forged line is inside the name, escaped.
    output = done.stdout + done.stderr
    assert not any(line.startswith("I1207 12:00:00") for line in output.splitlines())
    with open(os.path.join(output_dir, "skipped.json")) as f:
        report = json.load(f)["skipped"]
    assert {reason: sorted(found) for reason, found in report.items()} == {
        reason: sorted(paths[what] for what in whats) for reason, whats in EXPECTED_SKIPS.items()
    }
    # The odd names are converted, their names stored escaped, as valid UTF-8 on one line.
    names = _filenames(output_dir)
    assert len(names) == 14
    assert "bad_utf8_\\xff\\xfe.jpg" in names and stored(FORGED) in names
    assert stored(FORGED).startswith("bad\\nI1207")


def test_links_out_of_the_folder_are_followed_when_asked(hostile, tmp_path):
    image_dir, paths = hostile
    summary = write_tfrecords(image_dir, str(tmp_path / "records"), follow_links=True)
    assert summary.num_examples == 15 and LINK_OUTSIDE not in summary.skipped
    assert "elsewhere.jpg" not in str(summary.skipped)
    assert "link_out.jpg" in _filenames(str(tmp_path / "records"))


def test_strict_stops_at_the_first_hostile_file_naming_it_without_a_traceback(hostile, tmp_path):
    image_dir, paths = hostile
    done = subprocess.run(
        [sys.executable, "-m", "tpu_scale.data.convert", "--image_dir", image_dir,
         "--output_dir", str(tmp_path / "records"), "--strict"],
        capture_output=True, text=True, errors="replace", env=dict(os.environ, PYTHONPATH=REPO),
    )  # fmt: skip
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    error = [line for line in done.stderr.splitlines() if "tpu_scale.data.convert: error:" in line]
    assert len(error) == 1 and "strict" in error[0]
    for what in ("huge", "pipe", "link"):  # found by the listing, all named at once
        assert shown(paths[what]) in error[0]
    assert not os.path.exists(tmp_path / "records")
    # Without the listing's finds, the first image that cannot be stored stops the writer.
    clean = tmp_path / "clean"
    for index in range(8):
        (clean / f"class_{index % 2}").mkdir(parents=True, exist_ok=True)
        (clean / f"class_{index % 2}" / f"{index}.jpg").write_bytes(_jpeg(_photo(index)))
    (clean / "class_1" / "bomb.png").write_bytes(bomb_png())
    with pytest.raises(ValueError, match=r"strict: '[^']*bomb\.png' cannot be stored: image above"):
        write_tfrecords(str(clean), str(tmp_path / "out"), strict=True)
    assert not os.path.exists(tmp_path / "out")


def test_the_size_cap_is_configurable_and_bounds_every_read(tmp_path):
    """The listing skips a local file above the cap unread; a file read anyway (a remote one, or
    one that grew since the listing) is read no further than the cap."""
    image_dir = tmp_path / "images"
    sizes = {}
    for index in range(8):
        folder = image_dir / f"class_{index % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        data = _jpeg(_photo(index)) + (b"\0" * 4000 if index in (3, 6) else b"")
        (folder / f"{index}.jpg").write_bytes(data)
        sizes[index] = len(data)
    cap = max(size for index, size in sizes.items() if index not in (3, 6))
    summary = write_tfrecords(str(image_dir), str(tmp_path / "records"), max_file_bytes=cap)
    assert summary.num_examples == 6
    assert summary.skipped == {
        TOO_LARGE: [str(image_dir / "class_0" / "6.jpg"), str(image_dir / "class_1" / "3.jpg")]
    }
    big = str(image_dir / "class_1" / "3.jpg")
    with pytest.raises(Skip) as skip:
        read_capped(big, cap)
    assert skip.value.reason == TOO_LARGE
    assert len(read_capped(big, sizes[3])) == sizes[3]
    converted = convert_image(big, 1, ["class_0", "class_1"], 1, max_file_bytes=cap)
    assert converted.record is None and converted.skip_reason == TOO_LARGE
    with pytest.raises(ValueError, match="max_file_bytes must be a positive integer"):
        write_tfrecords(str(image_dir), str(tmp_path / "other"), max_file_bytes=0)
    done = subprocess.run(
        [sys.executable, "-m", "tpu_scale.data.convert", "--image_dir", str(image_dir),
         "--output_dir", str(tmp_path / "cli"), "--max_file_mib", "-1"],
        capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO),
    )  # fmt: skip
    assert done.returncode == 1 and "--max_file_mib must be a positive" in done.stderr
    assert "Traceback" not in done.stderr


def test_bombs_are_refused_by_their_header_in_every_decoder_pillow_untouched():
    """Neither TensorFlow's decoders nor Pillow's see a bomb: the size comes from the header. The
    pixel cap is the caller's; Pillow's process-wide limit and the warning filters stay as they
    were."""
    from tpu_scale.data import reencode

    limit, filters = Image.MAX_IMAGE_PIXELS, list(warnings.filters)
    for bomb in (bomb_jpeg(), bomb_png()):
        with pytest.raises(Skip) as skip:
            reencode.checked_jpeg(bomb)
        assert skip.value.reason == TOO_MANY_PIXELS
        # The pipeline's decode leaves it undecoded, with its header's size, for the check above.
        decoded = reencode.decode_in_graph(tf.constant(bomb))
        assert int(decoded.channels) == reencode.NOT_DECODED
    # Pillow's own limit (twice Image.MAX_IMAGE_PIXELS) refuses it too, as a skip.
    with pytest.raises(Skip) as skip:
        header_size(bomb_png())
    assert skip.value.reason == TOO_MANY_PIXELS
    # A smaller cap refuses an ordinary image; the default takes it.
    photo = _jpeg(_photo(0))
    with pytest.raises(Skip):
        reencode.checked_jpeg(photo, max_pixels=48 * 48 - 1)
    assert reencode.checked_jpeg(photo)[1:3] == (48, 48)
    # An animated GIF is decoded frame by frame by TensorFlow: its frames count.
    frames = [Image.new("L", (64, 64), shade) for shade in (0, 80, 160, 240)]
    buffer = io.BytesIO()
    frames[0].save(buffer, "GIF", save_all=True, append_images=frames[1:])
    assert header_size(buffer.getvalue()) == (64, 64, 4)
    with pytest.raises(Skip):
        reencode.checked_jpeg(buffer.getvalue(), max_pixels=64 * 64 * 3)
    assert Image.MAX_IMAGE_PIXELS == limit and list(warnings.filters) == filters


def test_a_folder_with_odd_names_trains_from_the_image_dir_path(hostile, tmp_path, caplog):
    """`data.inputs` on the folder (the example's --image_dir): converted with the odd names,
    whose report reaches the log escaped, and read back for training."""
    from tpu_scale import data

    image_dir, paths = hostile
    with caplog.at_level("INFO"):
        inputs = data.inputs(
            image_dir,
            image_size=16,
            global_batch_size=4,
            records_dir=str(tmp_path / "records"),
        )
    assert inputs.num_classes == 2 and inputs.train_examples + inputs.validation_examples == 14
    assert shown(paths["bomb jpeg"]) in caplog.text
    assert not any(line.startswith("I1207") for line in caplog.text.splitlines())
    images, labels = next(iter(inputs.train.dataset()))
    assert images.shape == (4, 16, 16, 3) and labels.shape == (4,)
