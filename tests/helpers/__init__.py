"""Importable helpers for tests that run the CLI in a child process (added to its PYTHONPATH)."""
