"""Count host syncs: the points where Python waits for the device (or would, on a GPU).

A CUDA graph saves launch overhead only while the CPU runs ahead of the GPU; every read of a device
value on the host (``.item()``, ``int(t)``, ``bool(t)``, ``.tolist()``, indexing with a 0-dim tensor,
a device-to-host copy) drains the GPU's queue first, and so does a blocking copy from pageable host
memory to the device (``torch.tensor(list, device="cuda")``). :class:`SyncCounter` records them with a
function mode (Python-level reads, tensors built from host data on the device) and a dispatch mode
(``aten._local_scalar_dense`` and device-to-host / blocking host-to-device copies), so the same count
comes out on a CPU, where nothing actually waits, as on a GPU:

- ``reads``: a device value read on the host (counted once per read, whatever ops it dispatches);
- ``h2d``: a host-to-device copy that blocks, i.e. a tensor built from host data directly on the
  counted device (``torch.tensor(values, device=d)``; on CUDA pageable memory forces a sync), or a
  ``.to(cuda)`` copy that is not ``non_blocking`` from pinned memory;
- ``explicit``: a ``torch.cuda.synchronize()`` call (``torch.cuda.graph`` makes one when it captures);
- ``captures``: CUDA graphs the static executor captured during the decode (``measure_decode``; a capture
  synchronises the device and empties the allocator's cache, so it is a sync however it is made).

On a GPU only reads of tensors on the counted device are syncs (``.tolist()`` of a host tensor is not); on a CPU,
where host and device are one, every read is counted (an upper bound of the GPU's count).

Copies that the runner makes through pinned memory (``infer.model.runner.ints_to_device``) are not syncs
and are not counted. ``section(name)`` attributes what happens inside it to ``name``.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from infer.decode.cycle import CycleObserver

READS = frozenset({"tolist", "numpy", "item", "__bool__", "__int__", "__float__", "__index__"})
"""Tensor methods that read a device value on the host."""
FACTORIES = frozenset({"tensor", "as_tensor"})
"""Functions that build a tensor from host data (a blocking copy when given a device)."""


class _Functions(TorchFunctionMode):
    def __init__(self, counter: SyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        c = self.counter
        if c.inside == 0:
            if name in READS and args and isinstance(args[0], torch.Tensor) and c.on_device(args[0]):
                c.add("reads")
            elif name in FACTORIES and kwargs.get("device") is not None \
                    and torch.device(kwargs["device"]).type == c.device_type:
                c.add("h2d")
        c.inside += name in READS or name in FACTORIES  # a host tensor's read dispatches nothing counted either
        try:
            return func(*args, **kwargs)
        finally:
            c.inside -= name in READS or name in FACTORIES


class _Dispatch(TorchDispatchMode):
    def __init__(self, counter: SyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self.counter
        if c.inside == 0:
            if func is torch.ops.aten._local_scalar_dense.default:
                if c.on_device(args[0]):
                    c.add("reads")
            elif func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
                src, dst, non_blocking = copy_ends(func, args, kwargs)
                if src.device.type != "cpu" and dst.type == "cpu":
                    c.add("reads")  # device-to-host
                elif src.device.type == "cpu" and dst.type != "cpu" and not (non_blocking and src.is_pinned()):
                    c.add("h2d")
        return func(*args, **kwargs)


def copy_ends(func, args, kwargs) -> tuple[torch.Tensor, torch.device, bool]:
    """(source tensor, destination device, non_blocking) of an ``aten.copy_`` or ``aten._to_copy`` call.

    aten passes ``copy_``'s ``non_blocking`` as its third positional argument (``[dst, src, True]``) and
    ``_to_copy``'s as a keyword; either may also come the other way, so both places are read.
    """
    if func is torch.ops.aten.copy_.default:
        positional = bool(args[2]) if len(args) > 2 else False
        return args[1], args[0].device, bool(kwargs.get("non_blocking", positional))
    return args[0], torch.device(kwargs.get("device", args[0].device)), bool(kwargs.get("non_blocking", False))


class SyncCounter:
    """``with SyncCounter(device) as syncs: ...`` counts the host syncs of the code inside.

    ``device``: the device the model runs on (factory calls that build tensors there are counted).
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.device_type = torch.device(device).type
        self.counts: Counter[str] = Counter()
        self.by_section: dict[str, Counter[str]] = {}
        self.inside = 0
        self._section: str | None = None
        self._modes = (_Functions(self), _Dispatch(self))

    def on_device(self, tensor: torch.Tensor) -> bool:
        """Whether reading ``tensor`` on the host waits for the counted device: a tensor on that device (on a CPU,
        where host and device are one, every tensor but a meta one: an upper bound of a GPU's count)."""
        if tensor.device.type == "meta":
            return False
        return self.device_type == "cpu" or tensor.device.type == self.device_type

    def add(self, kind: str) -> None:
        self.counts[kind] += 1
        if self._section is not None:
            self.by_section.setdefault(self._section, Counter())[kind] += 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def section_total(self, name: str) -> int:
        return sum(self.by_section.get(name, Counter()).values())

    def switch(self, name: str | None) -> str | None:
        """Attribute what follows to ``name`` (None: to no section); returns the section it leaves."""
        previous, self._section = self._section, name
        return previous

    @contextmanager
    def section(self, name: str):
        """Attribute the syncs inside to ``name`` (sections do not nest)."""
        previous, self._section = self._section, name
        try:
            yield self
        finally:
            self._section = previous

    def __enter__(self) -> SyncCounter:
        self._synchronize = torch.cuda.synchronize
        torch.cuda.synchronize = self._explicit  # an explicit sync (a CUDA-graph capture makes one too)
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        torch.cuda.synchronize = self._synchronize

    def _explicit(self, *args, **kwargs):
        self.add("explicit")
        return self._synchronize(*args, **kwargs)


class UpdateSection(CycleObserver):
    """Attributes the syncs between a cycle's verification and the rows' advance (the drafters' ``update``, e.g.
    SWIFT's optimiser, and the tokens' bookkeeping) to the section 'update', the rest of the cycle to 'cycle'."""

    def __init__(self, counter: SyncCounter):
        self.counter = counter

    def verified(self, rows, outcomes) -> None:
        self.counter.switch("update")

    def advanced(self, rows, outcomes) -> None:
        self.counter.switch("cycle")


def measure_decode(engine, prompt_ids: list[int], config) -> dict:
    """Host syncs of one ``engine.generate``: per draft-verify cycle (propose + verify + accept), per token,
    in the drafter's ``update`` (e.g. SWIFT's optimiser; reported apart) and in the prefill.

    Returns ``{"per_cycle", "per_token", "draft_steps_per_cycle", "update_per_cycle", "prefill", "cycles",
    "tokens", "reads", "h2d", "explicit", "captures"}`` (a CUDA graph captured in a cycle counts as that cycle's sync).
    """
    counter = SyncCounter(engine.runner.device)
    observer = UpdateSection(counter)
    engine.observers.append(observer)
    static = engine.runner.static
    try:
        with counter:
            with counter.section("prefill"):
                gen = engine.start(prompt_ids, config)
            while not gen.done:
                captures = static.captures if static is not None else 0
                with counter.section("cycle"):
                    engine.step(gen)
                    for _ in range((static.captures if static is not None else 0) - captures):
                        counter.add("captures")
            result = engine.finish(gen)
    finally:
        engine.observers.remove(observer)
    cycles = max(1, result.stats.verify_calls)
    forwards = float(result.stats.drafter.draft_forwards)
    cycle = counter.section_total("cycle")
    return {"per_cycle": cycle / cycles, "per_token": cycle / max(1, result.stats.new_tokens - 1),
            "draft_steps_per_cycle": forwards / cycles,
            "update_per_cycle": counter.section_total("update") / cycles,
            "prefill": counter.section_total("prefill"), "cycles": result.stats.verify_calls,
            "tokens": result.stats.new_tokens, "reads": counter.counts["reads"], "h2d": counter.counts["h2d"],
            "explicit": counter.counts["explicit"], "captures": counter.counts["captures"]}
