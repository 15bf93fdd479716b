"""Scaling model: one-shot, two-shot and ring all-reduce on n switch-connected nodes, and the tensor-parallel
decode step built on them, checked against published DGX Spark figures. A model, not a measurement.

Pure Python (numpy only): it does not import rocenante._C. Run it with `python -m rocenante.model`.
"""
