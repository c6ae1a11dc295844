"""Probes of what a model computes: collapse, swap effect, per-layer training diagnostics."""
