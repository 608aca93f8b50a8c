"""The machinery behind ``pyengine bench`` (public face: :mod:`pyengine.bench`).

``cases`` (what is timed), ``measure`` (calibrated samples, limit probes, the slowdown
switch), ``stats`` (round statistics, outliers, bootstrap ratios, verdicts), ``runner``
(one build, normalized figures), ``report`` (table, stored-baseline comparison),
``ab`` and ``worker`` (two builds timed interleaved in one run). They import the rest of
pyengine relatively, except ``cases``, ``measure`` and ``worker``: the A/B worker loads
those by path against another build's installed pyengine, so they import it absolutely.
"""
