"""The folder form of ``infer.hf.decoding`` for transformers' ``custom_generate``.

    from infer.hf.decoding import FOLDER
    model.generate(**inputs, custom_generate=str(FOLDER), trust_remote_code=True, drafter="early_exit",
                   exit_layer=8, max_new_tokens=64)

transformers copies this file into its module cache and calls ``generate(model=..., **generate's arguments)``; it
imports ``infer``, so the toolkit must be installed (or on ``PYTHONPATH``) where it runs. Keywords named like a
drafter option (``exit_layer``, ``num_draft``, ``plan``, ...) go to the drafter; the rest to ``generate``. Each call
makes a new ``hf_generate`` callable, but the runner is kept per model (``infer.hf.runners``: built on the first
call, built again only when the model's weights changed), so later calls cost what the callable form costs.
``stop_strings`` with ``tokenizer`` are honoured here (transformers does not hand the tokenizer to a callable);
``token_healing`` is refused in one line (transformers heals before the loop, with a tokenizer it does not keep for a
custom one: heal with ``model.heal_tokens`` first); ``cache_implementation="paged"`` is refused (transformers would
run its own continuous batching instead of our loop). The streamer gets ``end()`` exactly once, also when something
fails before decoding starts.
"""

from transformers import GenerationMixin

from infer.drafters import all_options
from infer.hf.decoding import hf_generate
from layerskip_core.errors import UserError


class EndOnce:
    """A streamer that forwards ``put`` and passes on the first ``end()`` only."""

    def __init__(self, streamer):
        self.streamer, self.ended = streamer, False

    def put(self, value):
        self.streamer.put(value)

    def end(self):
        if not self.ended:
            self.ended = True
            self.streamer.end()


def generate(model, drafter="autoregressive", streamer=None, tokenizer=None, stop_strings=None, **kwargs):
    """``generate`` with ``custom_generate=hf_generate(drafter, **drafter options)`` (see ``infer.hf.decoding``)."""
    once = EndOnce(streamer) if streamer is not None else None
    try:
        config = kwargs.get("generation_config")
        if kwargs.get("token_healing") or getattr(config, "token_healing", False):
            raise UserError("token_healing is not available with hf_generate (transformers heals before the decoding "
                            "loop and does not keep the tokenizer for a custom one); heal the prompt first: "
                            "input_ids = model.heal_tokens(input_ids, tokenizer)")
        if kwargs.get("cache_implementation") == "paged":
            raise UserError("cache_implementation='paged' is not supported by hf_generate (transformers would run its "
                            "own continuous batching instead of our drafter); drop it")
        names = set(all_options())
        options = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
        custom = hf_generate(drafter, tokenizer=tokenizer, streamer=once, stop_strings=stop_strings, **options)
        return GenerationMixin.generate(model, custom_generate=custom, **kwargs)
    finally:
        if once is not None:
            once.end()
