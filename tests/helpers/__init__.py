"""Helpers shared by the test suites (importable as ``helpers``: pytest puts tests/ on sys.path)."""
