"""Field trials: emulated devices (``trial``: cgroups, network namespaces, tc) and the
HTML report of a run or trial (``report``)."""
