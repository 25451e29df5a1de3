"""The project's lab, apart from the product: what checks and measures the toolkit itself (the GPU check and
comparison, benchmarks, experiments, the results pages). It imports the packages and is never imported by them, and
is not installed: run its programs from the checkout's root as ``python -m tools.<folder>.<program>``
(docs/ARCHITECTURE.md, "tools/")."""
