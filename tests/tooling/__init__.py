"""Test tooling (not part of the installed package): a threaded server for tests
(``testing``), the chaos pool and its worker (``chaos``, ``chaos_worker``) and process
statistics (``proc_stats``). Imported as ``tooling`` with ``tests/`` on ``sys.path`` (pytest
puts it there; benchmarks that use it add it themselves).
"""
