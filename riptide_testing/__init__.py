"""Tooling for the tests and benchmarks, not part of the library: the chaos soak (chaos.py), its
auditor (audit.py) and the faults it injects into a job's processes (faults.py).

It is a top-level package next to bench/ and tests/, left out of the installed distribution
(pyproject.toml lists the library's packages). It imports from the repository root: pytest puts
the root on sys.path (pyproject.toml's `pythonpath`), the benchmarks insert it, and the soak puts it
on the PYTHONPATH of the job it starts.
"""
