"""Writes the Pillow resize fixtures of tests/vision_resample.rs (pillow + numpy)."""
import numpy as np
from PIL import Image

rng = np.random.default_rng(7)
CASES = [
    ("rgb_down", "RGB", (97, 61), (40, 25)),
    ("rgb_up", "RGB", (30, 20), (75, 50)),
    ("rgb_h_only", "RGB", (100, 7), (33, 7)),
    ("rgb_v_only", "RGB", (9, 100), (9, 31)),
    ("rgb_wide", "RGB", (300, 20), (224, 14)),
    ("rgba_down", "RGBA", (64, 48), (23, 17)),
    ("rgba_up", "RGBA", (10, 10), (27, 21)),
]
for name, mode, (w, h), (ow, oh) in CASES:
    ch = len(mode)
    y, x = np.mgrid[0:h, 0:w]
    planes = [(7 * x + 3 * y) % 256, (x * x + 2 * y * y) % 256, (255 - 4 * x + 6 * y) % 256]
    if ch == 4:
        planes.append(((x + y) * 37) % 256)
    arr = (np.stack(planes, -1) + rng.integers(0, 40, size=(h, w, ch))) % 256
    if ch == 4:
        arr[..., 3][arr[..., 3] < 60] = 0
        arr[..., 3][arr[..., 3] > 220] = 255
    img = Image.fromarray(arr.astype(np.uint8), mode)
    img.save(f"{name}.in.png")
    img.resize((ow, oh), resample=Image.Resampling.BICUBIC).save(f"{name}.out.png")
