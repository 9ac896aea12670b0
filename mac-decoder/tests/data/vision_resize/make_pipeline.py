"""End-to-end fixture: an RGBA image through the reference processor's steps, written with numpy
and Pillow (resize rule with patch_limit_on_one_side = 4, Pillow bicubic on RGBA, chessboard
composite after resize, black padding, (v/255 - 0.5)/0.5, 14x14 patches)."""
import math
import numpy as np
from PIL import Image

P, MERGE, LIMIT, SIDE = 14, 2, 65536, 4
rng = np.random.default_rng(3)
h, w = 90, 300
y, x = np.mgrid[0:h, 0:w]
arr = np.stack([(5 * x + y) % 256, (x * y) % 256, (200 - 3 * x) % 256, ((x // 7 + y // 5) * 53) % 256], -1)
arr = ((arr + rng.integers(0, 30, size=arr.shape)) % 256).astype(np.uint8)
arr[..., 3][arr[..., 3] < 50] = 0
Image.fromarray(arr, "RGBA").save("pipeline.in.png")

s1 = math.sqrt(LIMIT / (max(1.0, w // P) * max(1.0, h // P)))
s = min(1.0, s1, SIDE * P / w, SIDE * P / h)
nw, nh = min(max(1, int(w * s)), SIDE * P), min(max(1, int(h * s)), SIDE * P)
f = MERGE * P
pw, ph = (f - nw % f) % f, (f - nh % f) % f
img = Image.open("pipeline.in.png").resize((nw, nh), resample=Image.Resampling.BICUBIC)
a = np.array(img)
yy, xx = np.mgrid[0:nh, 0:nw]
bg = np.where((((yy // 8) + (xx // 8)) % 2 == 1)[..., None], 180, 255).astype(np.uint8).repeat(3, -1)
alpha = a[..., 3:4].astype(np.float32) / 255.0
rgb = (alpha * a[..., :3] + (1 - alpha) * bg).astype(np.uint8)
rgb = np.pad(rgb, ((0, ph), (0, pw), (0, 0)))[None]
v = (rgb / 255.0).astype(np.float32)
v -= np.array([0.5, 0.5, 0.5])
v *= 1.0 / np.array([0.5, 0.5, 0.5])
t, H, W, C = v.shape
patches = v.reshape(t, H // P, P, W // P, P, C).transpose(0, 1, 3, 5, 2, 4).reshape(-1, C, P, P)
patches.astype("<f4").tofile("pipeline.pixel_values.f32")
print(nw, nh, pw, ph, patches.shape)
