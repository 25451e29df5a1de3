"""What ``layerskip bench`` runs: method specs (our drafters and `transformers` peers), the early-exit sweep grid,
and the benchmark's settings.

Importing this module loads neither torch nor transformers: the command parses and checks its arguments first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from layerskip_core.errors import UserError
from layerskip_core.settings import Resolved

if TYPE_CHECKING:
    from infer.sampling import SamplingConfig

PEERS = ("hf_generate", "hf_static", "hf_early_exit", "prompt_lookup")
PEER_OPTIONS = {"hf_early_exit": ("E", "k"), "prompt_lookup": ("k",)}
BASELINE = "autoregressive"
STARTS = ("cold", "warm")
"""``BenchConfig.start``: timed drafters start with nothing remembered, or from the toolkit cache read-only."""


@dataclass(frozen=True)
class Method:
    """One thing to time: one of our drafters, or a `transformers` peer."""

    label: str
    """Display name, e.g. 'early_exit:E=8:k=6' or 'hf_early_exit:E=8'."""
    name: str
    """Drafter name or peer name."""
    options: tuple[tuple[str, str], ...] = ()
    """Drafter/peer options as (key, value) strings."""
    target_exit: int | None = None
    """Lossy early exit of plain decoding (``autoregressive:target_exit=E``): the generation's target exit."""

    @property
    def is_peer(self) -> bool:
        return self.name in PEERS

    @property
    def opts(self) -> dict[str, str]:
        return dict(self.options)


def parse_methods(drafters: str, peers: str | None) -> list[Method]:
    """Parse '--drafters' and '--peers' lists; the autoregressive baseline is always included."""
    from infer.drafters import parse_spec

    methods: list[Method] = []
    if any(not s.strip() for s in drafters.split(",")) and drafters.strip():
        raise UserError(f"--drafters {drafters!r} has an empty entry; give comma-separated drafter specs such as "
                        "autoregressive,early_exit:E=8:k=6")
    for spec in [s for s in drafters.split(",") if s.strip()]:
        parsed = parse_spec(spec, validate="{model}" not in spec)  # per-model values are checked at load
        methods.append(Method(spec.strip(), parsed.drafter, tuple(parsed.options.items()), parsed.target_exit))
    # The baseline runs first on every prompt: the others are judged against its output right away.
    methods = [Method(BASELINE, BASELINE)] + [m for m in methods
                                               if not (m.name == BASELINE and not m.options and m.target_exit is None)]
    exits = sorted({int(m.opts.get("E", m.opts.get("exit_layer", 0))) for m in methods if m.name == "early_exit"})
    peer_specs = "hf_generate,prompt_lookup" + "".join(f",hf_early_exit:E={e}" for e in exits) if peers is None \
        else peers
    if any(not s.strip() for s in peer_specs.split(",")) and peer_specs.strip():
        raise UserError(f"--peers {peer_specs!r} has an empty entry; give comma-separated peers (or 'none')")
    for spec in [s for s in peer_specs.split(",") if s.strip()]:
        methods.append(parse_peer(spec))
    labels = [m.label for m in methods]
    if len(set(labels)) != len(labels):
        raise UserError(f"a method is listed twice: {labels}")
    return methods


def parse_peer(spec: str) -> Method:
    """``'hf_early_exit:E=8:k=5'`` -> a peer Method; names, keys and integer values checked here."""
    name, _, rest = spec.strip().partition(":")
    if name not in PEERS:
        raise UserError(f"unknown peer {name!r}; choose from {', '.join(PEERS)} (or --peers none)")
    opts = {}
    for part in [p for p in rest.split(":") if p] if rest else []:
        key, sep, value = part.partition("=")
        if not sep or key not in PEER_OPTIONS.get(name, ()):
            allowed = ", ".join(PEER_OPTIONS.get(name, ())) or "none"
            raise UserError(f"peer spec {spec!r}: bad option {part!r} (options of {name}: {allowed})")
        try:
            if int(value) < 1:
                raise ValueError(value)
        except ValueError:
            raise UserError(f"peer spec {spec!r}: {key}={value!r}: expected an integer >= 1") from None
        opts[key] = value
    if name == "hf_early_exit" and "E" not in opts:
        raise UserError("hf_early_exit needs an exit layer: hf_early_exit:E=8")
    return Method(spec.strip(), name, tuple(opts.items()))


def check_layers(methods: list[Method], num_layers: int, model: str) -> None:
    """Refuse an exit layer beyond the model (peers too), before anything is timed."""
    for m in methods:
        E = m.opts.get("E", m.opts.get("exit_layer"))
        if m.is_peer and E is not None and not 1 <= int(E) <= num_layers:
            raise UserError(f"{m.label}: exit layer {E} is out of range: {model} has {num_layers} layers, so use "
                            f"1 <= E <= {num_layers}")


def sweep_methods(exits: list[int], ks: list[int], vocabs: list[int] | None = None) -> list[Method]:
    """The LayerSkip E x k grid of early-exit drafters, times draft-vocabulary sizes N (0 = the full head; none given:
    the drafters' default)."""
    methods = []
    for n in vocabs or [None]:
        value = None if n is None else str(n) if n else "off"
        extra = (("draft_vocab", value),) if value else ()
        tail = f":draft_vocab={value}" if value else ""
        methods += [Method(f"early_exit:E={e}:k={k}{tail}", "early_exit", (("E", str(e)), ("k", str(k))) + extra)
                    for e in exits for k in ks]
    return methods


@dataclass
class BenchConfig:
    """What `layerskip bench` runs."""

    models: list[str]
    """Model folders or 'default', optionally labelled as NAME=PATH (the label names rows and '{model}')."""
    methods: list[Method]
    """Drafters and peers to time."""
    data: list[str]
    """Prompt sources (built-in names, jsonl files, text folders)."""
    run: Resolved
    """Device, dtype, executor and threads every method (peers included) runs with, resolved by the caller."""
    n: int = 8
    """Prompts per task, taken from the end of each set (held out from training)."""
    max_new_tokens: int = 128
    """Tokens generated per prompt."""
    repeats: int = 3
    """Timed repeats; tokens/s is the median over repeats."""
    sampling: SamplingConfig | None = None
    """Greedy (temperature 0: exactness is checked) or sampling settings, the same for every method (None: greedy)."""
    chat: str = "auto"
    """'auto' (chat template for gsm8k only), 'always' or 'never'."""
    stop_at_eos: bool = False
    """Stop at EOS; off by default so every method generates exactly max_new_tokens."""
    warmup: bool = True
    """Untimed runs per method before timing (``Engine.warm_up``: also builds every static forward and graph); their
    drafters neither read nor write remembered state, nor a save_plan file."""
    start: str = "cold"
    """What every timed drafter starts from: 'cold' (nothing remembered is read or written) or 'warm' (what earlier
    commands left in the toolkit cache, read but never changed); either way every repeat starts alike, unless a
    method's own ``remember=on`` says otherwise. Records name each run's ``start_state``."""

    def __post_init__(self) -> None:
        if self.n < 1 or self.max_new_tokens < 1 or self.repeats < 1:
            raise UserError("--n, --max-new-tokens and --repeats must be >= 1")
        if self.start not in STARTS:
            raise UserError(f"--start must be {' or '.join(STARTS)}, got {self.start!r}")
        if self.chat not in ("auto", "always", "never"):
            raise UserError("--chat must be auto, always or never")
        if not self.models or not self.data:
            raise UserError("give at least one --model and one --data source")
        if self.sampling is None:
            from infer.sampling import SamplingConfig  # torch-heavy: see the module docstring

            self.sampling = SamplingConfig()

    def generation(self, method: Method):
        """The DecodeConfig of ``method`` (its lossy ``target_exit``, if any, on top of the shared settings)."""
        from infer.engine import DecodeConfig

        return DecodeConfig(max_new_tokens=self.max_new_tokens, sampling=self.sampling,
                                stop_at_eos=self.stop_at_eos, target_exit=method.target_exit)

