"""Benchmarks behind `rtrl bench NAME`.

Each module exposes ``run(settings, quick, log) -> dict``; :mod:`rtrl.bench` adds the machine record
(threads, load, cores, Python speed) and prints the result as one JSON line. Measured results are kept
in ``benchmarks/results/NAME.jsonl`` and summarised in ``docs/results.md``.
"""
