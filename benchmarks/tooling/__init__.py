"""Harness shared by the benchmarks and the tests (not part of the installed package): a
threaded server (``testing``), the chaos pool and its worker (``chaos``, ``chaos_worker``),
process statistics (``proc_stats``), the vLLM connector's fake engine (``vllm_fake``) and the
vLLM tests' cluster helpers (``vllm_cluster``). Imported as ``tooling`` with ``benchmarks/`` on
``sys.path``: a script in benchmarks/ has it there, pytest adds it (pyproject's
``pythonpath``). The dependency runs one way: tests import benchmarks/, never the reverse.
"""
