"""What ``layerskip bench`` runs: method specs (our drafters and `transformers` peers), the early-exit sweep grid,
and the benchmark's settings.

Importing this module does not load transformers: the command parses and checks its arguments first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from infer.decode.engine import DecodeConfig
from infer.drafters import drafter_spec, parse_spec, split_spec
from infer.drafters.autoregressive import AutoregressiveDrafter
from infer.drafters.early_exit import EarlyExitDrafterConfig
from infer.drafters.spec import Spec
from infer.measure.quality import QualityConfig
from infer.model.sampling import SamplingConfig
from layerskip_core.cli import split_named
from layerskip_core.errors import UserError
from layerskip_core.layers import check_exit_layer
from layerskip_core.settings import Resolved
from layerskip_core.shipped import SHIPPED

PEERS = ("hf_generate", "hf_static", "hf_early_exit", "prompt_lookup")
PEER_OPTIONS = {"hf_early_exit": ("E", "k"), "prompt_lookup": ("k",)}
BATCH_PEERS = ("hf_generate", "hf_static")
"""Peers that decode a batch: transformers' assisted decoding (its early-exit assistant, prompt lookup) refuses one."""
BASELINE = AutoregressiveDrafter.name
STARTS = ("cold", "warm")
"""``BenchConfig.start``: timed drafters start with nothing remembered, or from the toolkit cache read-only."""
MODEL = "{model}"
"""In a drafter option, the label of the model it runs on (per-model plan files)."""


@dataclass(frozen=True)
class PeerSpec:
    """A `transformers` peer as written (``hf_early_exit:E=8:k=5``)."""

    name: str
    """One of ``PEERS``."""
    exit_layer: int | None = None
    """E of ``hf_early_exit`` (its assistant's exit layer)."""
    num_draft: int | None = None
    """k: the assistant's or prompt lookup's tokens per step (None: the peer's default)."""


@dataclass(frozen=True)
class Method:
    """One thing to time: its label (as written) and its spec, one of our drafters' or a `transformers` peer's."""

    label: str
    """Display name, e.g. 'early_exit:E=8:k=6' or 'hf_early_exit:E=8'."""
    spec: Spec | PeerSpec | None
    """What runs; None for a drafter spec whose options name '{model}': made per model by ``spec_for``."""

    @property
    def is_peer(self) -> bool:
        return isinstance(self.spec, PeerSpec)

    @property
    def name(self) -> str:
        """Drafter name or peer name."""
        return self.label.partition(":")[0] if self.spec is None else \
            self.spec.name if self.is_peer else self.spec.drafter

    @property
    def target_exit(self) -> int | None:
        """Lossy early exit of plain decoding (``autoregressive:target_exit=E``): the generation's target exit."""
        if self.spec is None:
            return split_spec(self.label)[2]
        return None if self.is_peer else self.spec.target_exit

    def spec_for(self, model: str) -> Spec:
        """The drafter spec on the model labelled ``model``."""
        return self.spec if self.spec is not None else parse_spec(self.label.replace(MODEL, model))


def parse_methods(drafters: str, peers: str | None) -> list[Method]:
    """Parse '--drafters' and '--peers' lists; the autoregressive baseline is always included."""
    methods: list[Method] = []
    if any(not s.strip() for s in drafters.split(",")) and drafters.strip():
        raise UserError(f"--drafters {drafters!r} has an empty entry; give comma-separated drafter specs such as "
                        "autoregressive,early_exit:E=8:k=6")
    for text in split_drafters(drafters):
        if MODEL in text:  # per-model values are checked at load
            split_spec(text)
            methods.append(Method(text, None))
        else:
            methods.append(Method(text, parse_spec(text)))
    # The baseline runs first on every prompt: the others are judged against its output right away.
    baseline = Method(BASELINE, parse_spec(BASELINE))
    methods = [baseline] + [m for m in methods if m.spec != baseline.spec]
    exits = sorted({m.spec.config.exit_layer for m in methods if _early_exit(m)})
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


def split_drafters(drafters: str) -> list[str]:
    """``--drafters`` into specs at its commas, except where a piece is only layer numbers: that piece continues the
    option before it (``dynamic_exit:exits=8,16,24,early_exit:E=8`` -> the exits 8, 16 and 24, then early_exit),
    as dynamic_exit's exits are documented to take ',' or '/'."""
    specs: list[str] = []
    for piece in [s.strip() for s in drafters.split(",") if s.strip()]:
        if specs and piece.isascii() and piece.replace("/", "").isdigit():
            specs[-1] += "," + piece
        else:
            specs.append(piece)
    return specs


def _early_exit(method: Method) -> bool:
    """An early-exit drafter at a given exit, without an adapter (whose E the adapter decides): quant_self's unset
    exit is the model's depth, no exit for transformers' assistant."""
    config = None if method.is_peer or method.spec is None else method.spec.config
    return isinstance(config, EarlyExitDrafterConfig) and config.adapter is None and config.exit_layer is not None


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
            opts[key] = int(value)
            if opts[key] < 1:
                raise ValueError(value)
        except ValueError:
            raise UserError(f"peer spec {spec!r}: {key}={value!r}: expected an integer >= 1") from None
    if name == "hf_early_exit" and "E" not in opts:
        raise UserError("hf_early_exit needs an exit layer: hf_early_exit:E=8")
    return Method(spec.strip(), PeerSpec(name, opts.get("E"), opts.get("k")))


def check_layers(methods: list[Method], num_layers: int) -> None:
    """Refuse a peer's exit layer beyond the model, before anything is timed (a drafter's is checked when its spec
    is resolved)."""
    for m in methods:
        if m.is_peer and m.spec.exit_layer is not None:
            check_exit_layer(m.spec.exit_layer, num_layers, f"{m.label}: exit layer")


def sweep_methods(exits: list[int], ks: list[int], vocabs: list[int] | None = None) -> list[Method]:
    """The LayerSkip E x k grid of early-exit drafters, times draft-vocabulary sizes N (0 = the full head; none given:
    the drafters' default)."""
    methods = []
    for n in vocabs or [None]:
        value = None if n is None else str(n) if n else "off"
        tail = f":draft_vocab={value}" if value else ""
        methods += [Method(f"early_exit:E={e}:k={k}{tail}",
                           drafter_spec("early_exit", {"exit_layer": e, "num_draft": k, "draft_vocab": value}))
                    for e in exits for k in ks]
    return methods


def parse_batch_sizes(text: str) -> list[int]:
    """``'1,4,8'`` -> [1, 4, 8]: batch sizes, each an integer >= 1, none twice (refused in one line otherwise)."""
    parts = [p.strip() for p in text.split(",")]
    try:
        sizes = [int(p) for p in parts]
    except ValueError:
        sizes = []
    if not sizes or any(b < 1 for b in sizes) or len(set(sizes)) != len(sizes):
        raise UserError(f"--batch-size {text!r}: expected one batch size or a comma-separated list of distinct "
                        "integers >= 1, e.g. 8 or 1,4,8")
    return sizes


def check_batch_peers(methods: list[Method], sizes: list[int]) -> None:
    """Refuse a peer that cannot decode a batch (``BATCH_PEERS`` can) when a batch size is above 1."""
    bad = [m.label for m in methods if m.is_peer and m.name not in BATCH_PEERS]
    if bad and max(sizes) > 1:
        raise UserError(f"--batch-size {max(sizes)}: peer {bad[0]} decodes one sequence (transformers' assisted "
                        f"decoding refuses batches); batched peers: {', '.join(BATCH_PEERS)}")


def model_labels(models: list[str]) -> list[str]:
    """One row name per ``--model``: its NAME of NAME=PATH, a model's name ('default', 'gemma3-270m'), else the shortest
    end of its folder path that
    tells it apart from the others (``runs/a/final``, ``runs/b/final`` -> ``a/final``, ``b/final``). Two models that
    still share a name (the same folder twice, or a NAME equal to another's) are refused."""
    named = [split_named(m) for m in models]
    parts = [Path(src).expanduser().resolve().parts if not name and src not in SHIPPED else None for name, src in named]

    def tail(i: int, n: int) -> str:
        name, src = named[i]
        return name or (src if parts[i] is None else "/".join(parts[i][-n:]))

    labels = [tail(i, 1) for i in range(len(models))]
    for n in range(2, max((len(p) for p in parts if p), default=1) + 1):
        clash = {x for x in labels if labels.count(x) > 1}
        labels = [tail(i, n) if labels[i] in clash else labels[i] for i in range(len(models))]
    repeated = sorted({x for x in labels if labels.count(x) > 1})
    if repeated:
        raise UserError(f"two --model arguments are both named {repeated[0]!r}, the same name for two rows; give "
                        "each its own name as NAME=PATH (e.g. --model base=default --model trained=runs/demo/final)")
    return labels


@dataclass
class BenchConfig:
    """What `layerskip bench` runs."""

    models: list[str]
    """Model folders or models fetched by name ('default', 'gemma3-270m'), optionally labelled as NAME=PATH (the label
    names rows and '{model}')."""
    methods: list[Method]
    """Drafters and peers to time."""
    data: list[str]
    """Prompt sources (built-in names, jsonl files, text folders)."""
    run: Resolved
    """Device, dtype, executor and threads every method (peers included) runs with, resolved by the caller."""
    n: int = 8
    """Prompts per task, taken from the end of each set (held out from training)."""
    skip: int = 0
    """Leave out the last ``skip`` prompts of each set first: tune on ``--skip N`` what is then reported on the
    held-out end without it (0: the last ``n``)."""
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
    labels: list[str] = field(init=False)
    """One row name per model (``model_labels``)."""
    start: str = "cold"
    """What every timed drafter starts from: 'cold' (nothing remembered is read or written) or 'warm' (what earlier
    commands left in the toolkit cache, read but never changed); either way every repeat starts alike, unless a
    method's own ``remember=on`` says otherwise. Records name each run's ``start_state``."""
    quality: QualityConfig = field(default_factory=QualityConfig)
    """The held-out split each model's verifier is scored on and the base model of the deltas (``quality``)."""
    batch_sizes: list[int] | None = None
    """Batched bench: every method decodes each task's prompts ``B`` at a time, for each ``B`` here (our drafters
    through ``BatchEngine``, the peers as left-padded batched ``generate``); None: one prompt at a time."""

    def __post_init__(self) -> None:
        if self.n < 1 or self.max_new_tokens < 1 or self.repeats < 1:
            raise UserError("--n, --max-new-tokens and --repeats must be >= 1")
        if self.start not in STARTS:
            raise UserError(f"--start must be {' or '.join(STARTS)}, got {self.start!r}")
        if self.chat not in ("auto", "always", "never"):
            raise UserError("--chat must be auto, always or never")
        if not self.models or not self.data:
            raise UserError("give at least one --model and one --data source")
        self.labels = model_labels(self.models)
        if self.batch_sizes is not None:
            check_batch_peers(self.methods, self.batch_sizes)
            if max(self.batch_sizes) > self.n:  # before any model loads: a row slot each is built per run
                raise UserError(f"--batch-size {max(self.batch_sizes)} is more than the {self.n} prompts per task "
                                "(--n): a batch has at most one row per prompt; lower it or raise --n")
        if self.quality.base is not None and self.quality.base not in self.labels:
            raise UserError(f"--base {self.quality.base!r} names no model; the models are {', '.join(self.labels)}")
        if self.sampling is None:
            self.sampling = SamplingConfig()

    def generation(self, method: Method | None = None):
        """The DecodeConfig of ``method`` (its lossy ``target_exit``, if any, on top of the shared settings; None:
        the full model's, the reference's)."""
        target = None if method is None else method.target_exit
        return DecodeConfig(max_new_tokens=self.max_new_tokens, sampling=self.sampling,
                                stop_at_eos=self.stop_at_eos, target_exit=target)

