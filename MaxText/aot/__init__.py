"""Compiling the train step ahead of time, and train_compile.py's step-time estimate from the compiled program's HLO."""
