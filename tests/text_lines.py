"""Seeded inputs for rapidocr's text-direction classifier (48x192, normalised to [-1, 1],
half of them turned 180 degrees: label ``i % 2``).

Two kinds, because they measure different things:

- ``noise_bars``: noise plus dark bars. Not text: the fp32 classifier is at chance on
  them (103/200 right) and 27 of 200 are ties within 0.05, so int8 agreement on them is
  a stress test of how quantization moves near-ties.
- ``rendered``: lines of random characters drawn with OpenCV's Hershey fonts (dark on
  light, sensor noise), prepared as rapidocr prepares a crop (height 48, width by aspect
  up to 192, zero padding right). The classifier reads them: fp32 gets 198/200 right.
"""

from __future__ import annotations

import string

import numpy as np

CHARS = string.ascii_letters + string.digits + "  .,:-"


def noise_bars(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, (n, 3, 48, 192)).astype(np.float32) * 0.3
    for i in range(n):
        for _ in range(rng.integers(3, 12)):
            r0, c0 = rng.integers(8, 30), rng.integers(0, 170)
            x[i, :, r0 : r0 + rng.integers(2, 14), c0 : c0 + rng.integers(2, 20)] = -0.9
        if i % 2:
            x[i] = x[i, :, ::-1, ::-1]
    return x


def rendered(n: int, seed: int) -> np.ndarray:
    try:
        import cv2
    except ImportError as e:  # scripts/test.sh installs opencv-python-headless
        raise FileNotFoundError("rendered text lines need opencv-python-headless") from e
    fonts = [cv2.FONT_HERSHEY_SIMPLEX, cv2.FONT_HERSHEY_DUPLEX, cv2.FONT_HERSHEY_COMPLEX,
             cv2.FONT_HERSHEY_TRIPLEX, cv2.FONT_HERSHEY_PLAIN, cv2.FONT_HERSHEY_COMPLEX_SMALL]
    rng = np.random.default_rng(seed)
    out = np.zeros((n, 3, 48, 192), np.float32)
    for i in range(n):
        text = "".join(rng.choice(list(CHARS), rng.integers(4, 20))).strip() or "edge"
        font = fonts[rng.integers(len(fonts))]
        scale, thick = rng.uniform(0.8, 1.6), int(rng.integers(1, 3))
        (w, h), base = cv2.getTextSize(text, font, scale, thick)
        img = np.empty((h + base + 8, w + 8, 3), np.uint8)
        img[:] = rng.integers(170, 256, 3)
        ink = tuple(int(c) for c in rng.integers(0, 90, 3))
        cv2.putText(img, text, (4, h + 4), font, scale, ink, thick, cv2.LINE_AA)
        img = np.clip(img + rng.normal(0, 6, img.shape), 0, 255).astype(np.uint8)
        if i % 2:
            img = img[::-1, ::-1]
        width = min(192, int(np.ceil(48 * img.shape[1] / img.shape[0])))
        line = cv2.resize(img, (width, 48)).astype(np.float32).transpose(2, 0, 1) / 255
        out[i, :, :, :width] = (line - 0.5) / 0.5
    return out


KINDS = {"noise_bars": noise_bars, "rendered": rendered}
