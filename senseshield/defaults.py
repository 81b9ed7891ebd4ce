"""One default per option: the values every command line and :class:`senseshield.job.Job`
start from (``senseshield simulate``/``compare``/``fleet up``, ``coordinator serve``, the
job files). Importing this module is cheap (no torch), so the CLIs can show the defaults
in ``--help`` without loading the job machinery.
"""

from __future__ import annotations

import os

# where the services meet
BROKER = "mqtt://127.0.0.1:1883"
FLEET = "default"
MQTT = "5"
LOG_LEVEL = "info"

# a job (senseshield.job.Job's field defaults)
STRATEGY = "masked"  # every parameter masked through the key server; sensecrypt et al. by name
DATASET = "digits"
MODEL = "mlp"
CLIENTS = 20
ROUNDS = 5
LOCAL_EPOCHS = 2
BATCH_SIZE = 16
LR = 0.1
PARTITION = "iid"
SEED = 0
KEY_BITS = 2048
TRAIN_THREADS = 1
MIN_DEVICES = 2
ROUND_DEADLINE = 120.0

# the key server
MIN_CONTRIBUTORS = 2
MIN_ENCRYPTORS = 2  # never a sum of fewer than k encryptors (1 = the papers' rule)

JOB_FLAGS = {
    "strategy": STRATEGY, "dataset": DATASET, "model": MODEL, "rounds": ROUNDS, "local_epochs": LOCAL_EPOCHS,
    "batch_size": BATCH_SIZE, "lr": LR, "partition": PARTITION, "seed": SEED, "key_bits": KEY_BITS,
    "train_threads": TRAIN_THREADS,
}
"""The job options that are also flags, by name (``coordinator serve --strategy`` fills the
ones not given from here)."""


def shared_threads(processes: int = 1) -> int:
    """``--threads`` when not given: the machine's cores shared by ``processes`` processes
    that run on it (every core for one process; ``fleet up``: cores // agents, at least 1)."""
    return max(1, (os.cpu_count() or 1) // max(1, processes))
