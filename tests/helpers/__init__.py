"""What the tests share: reference implementations, models, launchers of worker processes.

The ``*_worker`` modules also run as scripts, one per process of a
multi-process test (see :mod:`helpers.processes`).
"""
