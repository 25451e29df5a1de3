"""Plumbing shared by ``train`` and ``infer``: user errors, the package cache, model resolution,
prompt sets and their task policies, device and dtype parsing.

``train`` and ``infer`` are siblings on top of this package; neither imports the other's runner,
engine or drafters for plumbing.
"""
