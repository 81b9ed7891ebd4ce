"""Synthetic accelerometer windows for the worked example, one ``device-<i>.npz`` per device.

    python examples/har/make_data.py --devices 4 --out /tmp/har --seed 0

Six activities, each a distinct pattern on a 3-axis accelerometer sampled in windows of 64
(float32 ``x`` of shape ``(n, 3, 64)`` in g, int64 ``y`` in 0..5):

====  ============  ==========================================================
 0    still         gravity on z, small noise
 1    walking       ~2 Hz bounce on z and sway on x, moderate amplitude
 2    running       ~3.5 Hz, large amplitude on all axes
 3    stairs        ~1.5 Hz bounce on z plus a slow drift on y
 4    lying         gravity on x instead of z, small noise
 5    cycling       ~1 Hz circular motion on x/y
====  ============  ==========================================================

Noise is Gaussian (sigma 0.1 g when still or lying, 0.3 g when moving). Each device has its
own sensor bias (sigma 0.1 g) and scale (0.8-1.2) per axis and a non-IID mix of activities
(Dirichlet(0.5) proportions), so the federation is not trivial. The arrays hold ``x``/``y``
(the device's training data) and ``x_test``/``y_test`` (its own test windows).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

LENGTH = 64  #: samples per window (about 2.1 s at 30 Hz)
RATE = 30.0  #: Hz
ACTIVITIES = ("still", "walking", "running", "stairs", "lying", "cycling")

# activity -> (frequency Hz, amplitude per axis (x, y, z), gravity axis)
_PATTERNS = {
    0: (0.0, (0.0, 0.0, 0.0), 2),
    1: (2.0, (0.3, 0.1, 0.5), 2),
    2: (3.5, (0.8, 0.6, 1.2), 2),
    3: (1.5, (0.2, 0.3, 0.6), 2),
    4: (0.0, (0.0, 0.0, 0.0), 0),
    5: (1.0, (0.5, 0.5, 0.1), 2),
}


def window(activity: int, rng: np.random.Generator) -> np.ndarray:
    """One ``(3, LENGTH)`` window of ``activity``, with random phase, tempo and noise."""
    freq, amp, gravity_axis = _PATTERNS[activity]
    t = np.arange(LENGTH) / RATE
    f = freq * rng.uniform(0.85, 1.15)
    phase = rng.uniform(0, 2 * np.pi)
    x = np.zeros((3, LENGTH))
    x[gravity_axis] += 1.0
    for axis in range(3):
        shift = axis * np.pi / 2 if activity == 5 else 0.0  # circular motion for cycling
        x[axis] += amp[axis] * rng.uniform(0.8, 1.2) * np.sin(2 * np.pi * f * t + phase + shift)
    if activity == 3:
        x[1] += np.linspace(0, 0.3, LENGTH)
    x += rng.normal(0, 0.1 if freq == 0 else 0.3, size=x.shape)
    return x


def device_data(index: int, n: int, n_test: int, seed: int, alpha: float = 0.5
                ) -> dict[str, np.ndarray]:
    """Device ``index``'s arrays: ``n`` training and ``n_test`` test windows."""
    rng = np.random.default_rng([seed, index])
    mix = rng.dirichlet([alpha] * len(ACTIVITIES))
    bias = rng.normal(0, 0.1, size=(3, 1))
    scale = rng.uniform(0.8, 1.2, size=(3, 1))

    def sample(count: int) -> tuple[np.ndarray, np.ndarray]:
        y = rng.choice(len(ACTIVITIES), size=count, p=mix)
        x = np.stack([window(int(a), rng) * scale + bias for a in y])
        return x.astype(np.float32), y.astype(np.int64)

    x, y = sample(n)
    x_test, y_test = sample(n_test)
    return {"x": x, "y": y, "x_test": x_test, "y_test": y_test}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4, help="number of devices (files)")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--windows", type=int, default=240, help="training windows per device")
    parser.add_argument("--test-windows", type=int, default=60, help="test windows per device")
    args = parser.parse_args(argv)
    if args.devices < 1 or args.windows < 2 or args.test_windows < 1:
        parser.error("--devices must be >= 1, --windows >= 2 and --test-windows >= 1")
    args.out.mkdir(parents=True, exist_ok=True)
    for i in range(args.devices):
        path = args.out / f"device-{i}.npz"
        np.savez(path, **device_data(i, args.windows, args.test_windows, args.seed))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
