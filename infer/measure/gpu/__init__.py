"""The GPU check and the GPU comparison as a library: what scripts/gpu_check.py, gpu_compare.py and gpu_lease.py run."""
