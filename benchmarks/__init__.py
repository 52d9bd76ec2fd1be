"""jmp_train benchmarks: ``python -m benchmarks`` (see ``benchmarks/README.md``)."""
