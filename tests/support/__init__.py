"""What the tests share: builders of inputs, stand-in processes, servers started for a
test, hardware checks. Tests import from here (``from support import engine_samples``),
never from one another: tests/conftest.py puts tests/ on the import path.
"""
