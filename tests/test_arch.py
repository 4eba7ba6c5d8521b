"""Model families as data (worker/model/arch/): every registered family is complete, the loader
resolves every family `ember bench make-model` can produce, and an unknown architecture is one
clear line, never a traceback."""

from __future__ import annotations

import dataclasses
import enum
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest

from ember.worker.backends.base import SeqChunk
from ember.worker.backends.numpy.backend import NumpyBackend
from ember.worker.bench import synth
from ember.worker.model import arch, loader
from ember.worker.model.arch.recipe import (
    BIAS_ROLES,
    ROLES,
    Family,
    MetadataKeys,
    Presence,
    Recipe,
    SlidingWindow,
)
from ember.worker.model.config import HyperConfig
from ember.worker.model.gguf_file import GGUFFile, ModelFileError
from ember.worker.model.loader import open_model
from ember.worker.model.weights import load_weights
from ember.worker.text.chat_template import BUILTIN_TEMPLATES, ChatTemplateError, builtin_source
from ember.worker.text.formats import ReasoningFormat, detect_tool_format, parse_override, resolve, tool_format

FAMILIES = sorted(arch.FAMILIES)
ARCH_DIR = Path(arch.__file__).parent


def test_every_family_file_is_registered_under_its_name():
    files = {p.stem for p in ARCH_DIR.glob("*.py") if p.stem not in ("__init__", "recipe")}
    assert files and files == {name.replace("-", "_") for name in arch.FAMILIES}  # gpt-oss: gpt_oss.py
    for name, family in arch.FAMILIES.items():
        assert isinstance(family, Family) and family.name == name


@pytest.mark.parametrize("name", FAMILIES)
def test_recipe_is_complete(name):
    recipe = arch.FAMILIES[name].recipe
    for f in dataclasses.fields(Recipe):
        value = getattr(recipe, f.name)
        if f.name == "sliding_window":
            assert value is None or isinstance(value, SlidingWindow)
        elif f.name == "moe":
            assert value is None or isinstance(value.gating, enum.Enum) and isinstance(value.norm_topk, bool)
        elif f.name in ("qk_norm", "mlp_bias", "attn_out_bias", "attn_sinks"):
            assert isinstance(value, bool), f.name
        elif f.name == "logit_softcap":
            assert value == 0.0  # the backends run none yet (Recipe refuses one)
        else:
            assert isinstance(value, enum.Enum), f"{name}: recipe field {f.name} is {value!r}"
    window = recipe.sliding_window
    assert window is None or (window.period > 0 and (window.local_rope_base is None or window.local_rope_base > 0))


@pytest.mark.parametrize("name", FAMILIES)
def test_tensor_names_are_exactly_the_recipes_roles(name):
    family = arch.FAMILIES[name]
    roles = family.recipe.layer_roles()
    assert set(family.tensors.layer) == set(roles) and set(roles) <= set(ROLES)
    for role, tensor in family.tensors.layer.items():
        bias = role in BIAS_ROLES or role == "bo" or role.endswith("_b")
        assert tensor.endswith(".bias" if bias else ".weight"), (role, tensor)
    for tensor in (family.tensors.token_embd, family.tensors.output_norm, family.tensors.output):
        assert tensor.endswith(".weight")


@pytest.mark.parametrize("name", FAMILIES)
def test_metadata_keys_are_the_families_own(name):
    family = arch.FAMILIES[name]
    sliding = ("sliding_window", "sliding_window_pattern", "rope_freq_base_swa")
    for f in dataclasses.fields(MetadataKeys):
        key = getattr(family.keys, f.name)
        if f.name in sliding and family.recipe.sliding_window is None:
            assert key is None, f.name
        else:
            assert isinstance(key, str) and key.startswith(f"{name}."), (f.name, key)


@pytest.mark.parametrize("name", [n for n in FAMILIES if arch.FAMILIES[n].hyper is not None])
def test_hyper_names_are_the_families_own(name):
    family = arch.FAMILIES[name]
    names = family.hyper
    assert names is not None
    assert set(HyperConfig.__struct_fields__) <= set(names.keys)  # every setting is read from a key
    assert all(key.startswith(f"{name}.") for key in names.keys.values())
    assert not set(names.layer) & set(family.tensors.layer)  # beside the generic roles, never over them
    for tensor in [*names.layer.values(), *names.model.values()]:
        assert tensor.endswith((".weight", ".bias")), tensor


def test_only_a_hyper_recipe_names_its_own_keys_and_tensors():
    deepseek4, llama = arch.FAMILIES["deepseek4"], arch.FAMILIES["llama"]
    with pytest.raises(ValueError, match="HYPER"):
        dataclasses.replace(deepseek4, hyper=None)
    with pytest.raises(ValueError, match="HYPER"):
        dataclasses.replace(llama, hyper=deepseek4.hyper)


DECLARED = [n for n in FAMILIES if arch.FAMILIES[n].formats is not None]


@pytest.mark.parametrize("name", DECLARED)
def test_default_formats_resolve(name):
    """A family's declared tool-call format is the one its built-in template shows (fenced JSON for a
    template that never reads `tools`), so serving a file through it is one consistent format."""
    formats = arch.FAMILIES[name].formats
    assert formats is not None and formats.chat in BUILTIN_TEMPLATES
    assert tool_format(formats.tool).name == formats.tool
    assert detect_tool_format(builtin_source(formats.chat)).name == formats.tool


@pytest.mark.parametrize("name", [n for n in DECLARED if arch.FAMILIES[n].formats.reasoning is not None])
def test_default_reasoning_format_resolves(name):
    reasoning = arch.FAMILIES[name].formats.reasoning
    resolved = parse_override(reasoning)
    assert isinstance(resolved, ReasoningFormat) and resolved.name == reasoning


def test_recipe_refuses_what_no_backend_runs():
    recipe = arch.FAMILIES["llama"].recipe
    with pytest.raises(ValueError, match="MLP biases"):
        dataclasses.replace(recipe, mlp_bias=True)
    with pytest.raises(ValueError, match="softcap"):
        dataclasses.replace(recipe, logit_softcap=30.0)


def _file_with(family: Family, layer_roles) -> SimpleNamespace:
    """A stand-in for GGUFFile as layer_tensors reads it: a path and tensor names."""
    return SimpleNamespace(path=Path("stand-in.gguf"),
                           tensors={family.tensors.layer_name(0, r): None for r in layer_roles})


def test_layer_tensors_follow_the_recipe():
    qwen3, llama = arch.FAMILIES["qwen3"], arch.FAMILIES["llama"]
    full = _file_with(qwen3, qwen3.recipe.layer_roles())
    assert list(arch.layer_tensors(full, qwen3, 0)) == [r for r in ROLES if r in qwen3.recipe.layer_roles()]
    with pytest.raises(ModelFileError, match="missing tensor blk.0.attn_q_norm.weight"):
        arch.layer_tensors(_file_with(qwen3, set(qwen3.recipe.layer_roles()) - {"q_norm"}), qwen3, 0)
    required = {r for r, need in llama.recipe.layer_roles().items() if need is Presence.REQUIRED}
    assert "bq" not in arch.layer_tensors(_file_with(llama, required), llama, 0)  # biases: optional for llama
    assert "bq" in arch.layer_tensors(_file_with(llama, required | set(BIAS_ROLES)), llama, 0)
    with pytest.raises(ModelFileError, match="missing tensor blk.0.attn_v.bias"):
        arch.layer_tensors(_file_with(llama, required | {"bq", "bk"}), llama, 0)


@pytest.fixture(scope="module")
def synth_files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("arch-synth")
    return {a: synth.make_model(a, "tiny", d / f"{a}.gguf") for a in synth.ARCHS}


@pytest.mark.parametrize("name", synth.ARCHS)
def test_loader_resolves_every_synthetic_family(name, synth_files, tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "cache"))
    model = open_model(synth_files[name])
    cfg = model.config
    assert cfg.arch == name and cfg.family is arch.FAMILIES[name] and cfg.recipe is cfg.family.recipe
    backend = NumpyBackend(cfg, load_weights(model.gguf, cfg), n_blocks=4, block_size=16)
    tokens = np.arange(5, dtype=np.int32)
    (logits,) = backend.forward([SeqChunk(tokens, 0, [0], "last")])
    assert logits.shape == (1, cfg.vocab_size) and np.isfinite(logits).all()


# What a file of each family that carries no chat template is served with: the template its vocabulary's
# turn tokens name, else its recipe's (the synthetic llama has Llama 2's vocabulary: llama3 comes from the
# recipe alone), with the recipe's tool-call format and reasoning markers. gpt-oss declares none: refused.
TEMPLATELESS = {
    "deepseek4": ("deepseek", "dsml", "think"),
    "gemma3": ("gemma", "fenced", None),
    "gpt-oss": None,
    "llama": ("llama3", "llama3", None),
    "qwen2": ("chatml", "hermes", None),
    "qwen3": ("chatml", "hermes", "think"),
    "qwen3moe": ("chatml", "hermes", "think"),
}


class _NoTemplate(GGUFFile):
    """The file as it is, less its `tokenizer.chat_template`."""

    def __init__(self, path):
        super().__init__(path)
        self.metadata.pop("tokenizer.chat_template", None)


def test_every_family_is_in_the_templateless_table():
    assert sorted(TEMPLATELESS) == FAMILIES


@pytest.mark.parametrize("name", [n for n in synth.ARCHS if TEMPLATELESS[n] is not None])
def test_a_file_without_a_template_speaks_its_recipes_formats(name, synth_files, monkeypatch):
    monkeypatch.setattr(loader, "GGUFFile", _NoTemplate)
    model = open_model(synth_files[name])
    formats = resolve(model.template, model.tokenizer, None, model.config.family.formats)
    reasoning = formats.reasoning.name if formats.reasoning is not None else None
    assert (model.template.name, formats.tool.name, reasoning) == TEMPLATELESS[name]


@pytest.mark.parametrize("name", [n for n in synth.ARCHS if TEMPLATELESS[n] is None])
def test_a_file_without_a_template_of_a_family_without_a_builtin_is_refused(name, synth_files, monkeypatch):
    monkeypatch.setattr(loader, "GGUFFile", _NoTemplate)
    with pytest.raises(ChatTemplateError, match=f"no chat template .* for architecture '{name}'"):
        open_model(synth_files[name])


def test_unknown_architecture_is_one_clear_line(tmp_path):
    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    proc = subprocess.run([sys.executable, "-m", "ember.worker", "generate", "--model", str(path), "--max-tokens", "1",
                           "hello"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 78, proc.stderr
    assert "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    supported = ", ".join(FAMILIES)
    assert str(path) in line and f"unsupported architecture 'falcon' (supported: {supported})" in line
