"""The model families ember runs, one module each (`arch/<family>.py`, holding a `FAMILY`).

Every module in this package other than `recipe` is a family and is registered by its file alone:
adding a family is adding a file. `family_of(g)` answers the family of a GGUF file (or a one-line
ModelFileError naming the architectures there are); `layer_tensors` names one layer's tensors in a
file, checked against the family's recipe, for the backends' weight loaders.
"""

from __future__ import annotations

import importlib
import pkgutil

from ..gguf_file import GGUFFile, ModelFileError
from .recipe import BIAS_ROLES, ROLES, Family, Presence


def _discover() -> dict[str, Family]:
    families = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name == "recipe" or info.name.startswith("_"):
            continue
        family = importlib.import_module(f"{__name__}.{info.name}").FAMILY
        families[family.name] = family
    return families


FAMILIES: dict[str, Family] = _discover()


def family_of(g: GGUFFile) -> Family:
    arch = g.architecture
    family = FAMILIES.get(arch)
    if family is None:
        raise ModelFileError(g.path, f"unsupported architecture {arch!r} (supported: {', '.join(FAMILIES)})")
    return family


def layer_tensors(g: GGUFFile, family: Family, layer: int) -> dict[str, str]:
    """role -> full tensor name of the tensors layer `layer` of this file has, in ROLES order: every
    role the recipe requires, and its optional ones where the file carries them (biases: all three)."""
    found = {}
    for role, need in family.recipe.layer_roles().items():
        name = family.tensors.layer_name(layer, role)
        if name in g.tensors:
            found[role] = name
        elif need is Presence.REQUIRED:
            raise ModelFileError(g.path, f"missing tensor {name}")
    biases = [r for r in BIAS_ROLES if r in found]
    if biases and len(biases) < len(BIAS_ROLES):
        missing = next(family.tensors.layer_name(layer, r) for r in BIAS_ROLES if r not in found)
        raise ModelFileError(g.path, f"missing tensor {missing} (layer {layer} has the other attention biases)")
    return {role: found[role] for role in ROLES if role in found}
