"""The GPU check and the GPU comparison: their programs (``gpu_check``, ``gpu_compare``, ``gpu_bundle``,
``gpu_lease``; ``python3 -m tools.gpu.gpu_check``) and the library they share."""
