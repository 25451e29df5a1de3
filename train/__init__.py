"""LayerSkip training: depth-scaled layer dropout and an early-exit loss over unmodified HF models.

Entry point: ``accelerate launch train/layerskip.py --config recipes/<recipe>.yaml [key=value ...]``.
"""
