"""Harness shared by the benchmarks and the tests (not part of the installed package): a
threaded server (``testing``), the chaos pool and its worker (``chaos``, ``chaos_worker``)
and process statistics (``proc_stats``). Imported as ``tooling`` with ``benchmarks/`` on
``sys.path``: a script in benchmarks/ has it there, pytest adds it (pyproject's
``pythonpath``). The dependency runs one way: tests import benchmarks/, never the reverse.
"""
