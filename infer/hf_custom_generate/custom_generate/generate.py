"""The folder form of ``infer.hf_decoding`` for transformers' ``custom_generate``.

    from infer.hf_decoding import FOLDER
    model.generate(**inputs, custom_generate=str(FOLDER), trust_remote_code=True, drafter="early_exit",
                   exit_layer=8, max_new_tokens=64)

transformers copies this file into its module cache and calls ``generate(model=..., **generate's arguments)``; it
imports ``infer``, so the toolkit must be installed (or on ``PYTHONPATH``) where it runs. Keywords named like a
drafter option (``exit_layer``, ``num_draft``, ``plan``, ...) go to the drafter; the rest to ``generate``. Each call
builds the runner afresh (re-fusing the model's q/k/v and gate/up: a moment, no lasting copy); the callable form,
``custom_generate=hf_generate(...)``, builds it once per model.
"""

from transformers import GenerationMixin

from infer.drafters import all_options
from infer.hf_decoding import hf_generate


def generate(model, drafter="autoregressive", streamer=None, tokenizer=None, **kwargs):
    """``generate`` with ``custom_generate=hf_generate(drafter, **drafter options)`` (see ``infer.hf_decoding``)."""
    names = set(all_options())
    options = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
    custom = hf_generate(drafter, tokenizer=tokenizer, streamer=streamer, **options)
    return GenerationMixin.generate(model, custom_generate=custom, **kwargs)
