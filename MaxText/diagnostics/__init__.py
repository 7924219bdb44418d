"""Diagnostics the training run calls: stack traces, the step watchdog, the profiler, Vertex AI TensorBoard, plots.

Each module is one concern and imports what it needs itself, so that `plot_metrics.py` starts without JAX.
"""
