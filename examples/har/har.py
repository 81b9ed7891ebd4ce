"""A small 1-D CNN for windows of 3-axis accelerometer data (the worked example's model).

Name it in a job as ``examples/har/har.py:har_cnn`` (a file path, from the repository root)
or, with ``examples/har`` on ``PYTHONPATH``, as ``har:har_cnn``. ``input_shape`` is
``(3, 64)`` for the data of ``make_data.py`` (3 axes, 64 samples per window); ``channels``
comes from the job's ``model_args``.
"""

from __future__ import annotations

from torch import nn


def har_cnn(input_shape: tuple[int, ...], num_classes: int, channels: int = 16) -> nn.Module:
    """[Conv1d(k5) -> BatchNorm1d -> ReLU] -> MaxPool2 -> [Conv1d(k5) -> BatchNorm1d -> ReLU]
    -> global average pool -> Linear(-> classes).

    1,782 values with ``channels=16`` and 6 classes (1,718 parameters plus BatchNorm running
    statistics), small enough to encrypt every value with CKKS on a Raspberry-Pi-class
    device. BatchNorm matters here: without it, plain SGD (lr 0.05, batch 16) stays at the
    majority class for the first epochs on some devices. Needs ``input_shape == (C, L)``
    with ``L >= 8``.
    """
    if len(input_shape) != 2 or input_shape[1] < 8:
        raise ValueError(f"input_shape {tuple(input_shape)} must be (C, L) with L >= 8")
    if channels < 1:
        raise ValueError(f"channels={channels} must be >= 1")
    c, _ = input_shape
    return nn.Sequential(
        nn.Conv1d(c, channels, 5, padding=2),
        nn.BatchNorm1d(channels),
        nn.ReLU(),
        nn.MaxPool1d(2),
        nn.Conv1d(channels, channels, 5, padding=2),
        nn.BatchNorm1d(channels),
        nn.ReLU(),
        nn.AdaptiveAvgPool1d(1),
        nn.Flatten(),
        nn.Linear(channels, num_classes),
    )
