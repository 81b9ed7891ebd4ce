"""A site aggregator that lies: it adds 1 to one masked word of every partial sum it sends
(``python -m tests.hostile_site serve --site NAME ...``, the same command line as
``coordinator serve``). Attacker code, outside the product: tests/test_sites.py runs it."""

from __future__ import annotations

import numpy as np

import coordinator.site_service as site_service
from coordinator.cli import main
from senseshield.engine.partial import pack_arrays, unpack_arrays

_honest = site_service.partial_message


def _tampered(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
    msg, pieces = _honest(*args, **kwargs)
    arrays = unpack_arrays(msg.arrays)
    total = arrays["acc_total"].copy()
    total[0] += total.dtype.type(1)  # modulo the ring: a sum that is not its contributors'
    arrays["acc_total"] = total
    return msg.model_copy(update={"arrays": pack_arrays(arrays)}), pieces


site_service.partial_message = _tampered

if __name__ == "__main__":
    np.seterr(over="ignore")
    main()
