"""Open a GGUF model: parse, validate, read the config, build the tokenizer and chat template."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..text.chat_template import ChatTemplate
from ..text.tokenizer import Tokenizer
from .config import ModelConfig, read_config
from .embedded import default_model_path
from .gguf_file import GGUFFile


@dataclass
class Model:
    path: Path
    gguf: GGUFFile
    config: ModelConfig
    tokenizer: Tokenizer
    template: ChatTemplate
    mtp_gguf: GGUFFile | None = None  # --spec mtp:PATH: the next-token layer's own file (mtp_file.py)
    dspark_gguf: GGUFFile | None = None  # --spec dspark:PATH: the DSpark block drafter's file (dspark_file.py)

    @property
    def fingerprint(self) -> str:
        """The model's identity; with a next-token layer or block drafter file, both files' (the KV pool's rows
        hold the layer's or the drafter's)."""
        return "+".join(g.fingerprint for g in (self.gguf, self.mtp_gguf, self.dspark_gguf) if g is not None)


def resolve_model_path(path: str | Path | None) -> Path:
    """The given path, or the embedded default model (assembled on first use)."""
    return Path(path).expanduser() if path else default_model_path()


def open_model(path: str | Path | None) -> Model:
    g = GGUFFile(resolve_model_path(path))
    config = read_config(g)
    tokenizer = Tokenizer.from_gguf(g)
    formats = config.family.formats  # the family's built-in template, for a file without one
    template = ChatTemplate.from_gguf(g, tokenizer, default=formats.chat if formats is not None else None)
    return Model(g.path, g, config, tokenizer, template)
