"""The privacy engine: pure functions over numpy arrays, no network or file I/O.

Modules: ``params`` (flat parameter layout), ``sensitivity`` (scores), ``clustering``,
``budgets``, ``measurements`` (robust probe summaries, pooling of agreeing devices), ``masks``
(SenseCrypt mask solver), ``mutual_info``, ``aggregation``.
"""
