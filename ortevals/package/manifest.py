"""ONNX Runtime model packages: a ``manifest.json`` with variants per execution provider, and ``tokenizer_dir``.

A model package (onnxruntime 1.32's model-package reader, onnxruntime-genai 0.18's ``Config.from_package_ep``) is a
folder with ``manifest.json`` and no ``genai_config.json``. Its one component (onnxruntime-genai requires exactly
one, by convention ``model``) lists variants, each tagged with an execution provider (``ep``: onnxruntime's long
name), a ``device`` and an opaque ``compatibility_string``; a variant's folder is its name under the root (or its
``variant_directory``) and holds a complete GenAI package. Files the variants share (the tokenizer) live once in
``shared_assets/sha256-<hex>/``, named from a variant's ``genai_config.json`` as ``model.tokenizer_dir:
"sha256:<hex>"`` (an optional ``/tail`` selects a subfolder; the manifest's ``shared_assets`` may map the URI to
another folder).

Owns reading the manifest (:func:`read_manifest`, one-line errors naming the field), choosing the variant for an
execution provider as onnxruntime does (:func:`choose`: the first variant declared for it, the order onnxruntime's
selector keeps where the provider scores no compatibility string; no provider asked: the package's only one, as
onnxruntime-genai's ``Model(path)`` does) and resolving ``model.tokenizer_dir`` (:func:`tokenizer_folder`).
Pure JSON and paths; no runtime.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ortevals.errors import PackageError, ProviderError, did_you_mean
from ortevals.package.session_options import PROVIDERS, normalize

log = logging.getLogger(__name__)  # the CLI prints its INFO lines as notices (the variant chosen)

MANIFEST = "manifest.json"
CONFIG = "genai_config.json"
SHA256 = re.compile(r"^sha256:([0-9a-f]{64})(/.*)?$")


@dataclass(frozen=True)
class Variant:
    """One variant of a model package: its name, execution provider (short name), device, folder."""

    name: str
    ep: str  # ortevals' short name (cpu, cuda, openvino, ...), or onnxruntime's long name when unknown to ortevals
    ep_name: str  # as the manifest spells it (onnxruntime's long name)
    device: str | None
    compatibility: str | None
    folder: Path


@dataclass(frozen=True)
class PackageManifest:
    """A model package's root, its component and variants in manifest order, and its shared-asset overrides."""

    root: Path
    component: str
    variants: tuple[Variant, ...]
    shared_assets: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        return ", ".join(f"{v.name} ({v.ep_name}{', ' + v.device if v.device else ''})" for v in self.variants)


def is_model_package(path: Path) -> bool:
    """A folder with ``manifest.json`` and no ``genai_config.json`` (onnxruntime-genai's own test)."""
    return path.is_dir() and (path / MANIFEST).is_file() and not (path / CONFIG).is_file()


def read_manifest(root: Path) -> PackageManifest:
    """The package's manifest, checked: one component with variants, each with an ``ep`` and a folder holding
    ``genai_config.json``."""
    where = root / MANIFEST
    try:
        data = json.loads(where.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PackageError(f"{where}: not a readable JSON manifest ({e})") from None
    if not isinstance(data, dict):
        raise PackageError(f"{where}: expected a JSON object with 'components'")
    if "configs_dir" in data or (root / "models").is_dir() and not isinstance(data.get("components"), dict):
        raise PackageError(f"{where}: 'configs_dir' and models/<component>/ overlays are the layout Olive 0.13's "
                           "generate-model-package writes, which neither onnxruntime 1.32's model-package reader nor "
                           "onnxruntime-genai 0.18 opens; expected variant folders each with a complete "
                           "genai_config.json (or give --pkg one GenAI package folder)")
    components = data.get("components")
    if not isinstance(components, dict) or len(components) != 1:
        found = ", ".join(map(repr, components)) if isinstance(components, dict) else repr(components)
        raise PackageError(f"{where}: field components must hold exactly one component (onnxruntime-genai loads "
                           f"one), got {found or 'none'}")
    (component, body), = components.items()
    variants = body.get("variants") if isinstance(body, dict) else None
    if not isinstance(variants, dict) or not variants:
        raise PackageError(f"{where}: field components.{component}.variants must be a non-empty object of variants")
    shared = data.get("shared_assets") or {}
    if not isinstance(shared, dict) or not all(isinstance(v, str) for v in shared.values()):
        raise PackageError(f"{where}: field shared_assets must map sha256:<hex> URIs to folder paths")
    return PackageManifest(root, component, tuple(_variant(root, component, name, v, where)
                                                  for name, v in variants.items()), dict(shared))


def _variant(root: Path, component: str, name: str, body, where: Path) -> Variant:
    field_name = f"components.{component}.variants.{name}"
    if not isinstance(body, dict) or not isinstance(body.get("ep"), str) or not body["ep"]:
        raise PackageError(f"{where}: field {field_name}.ep must name an execution provider "
                           f"(CPUExecutionProvider, ...), got {body!r}")
    folder = _inside(root, body.get("variant_directory") or name, f"{field_name}.variant_directory", where)
    if not (folder / CONFIG).is_file():
        raise PackageError(f"{where}: variant {name!r} has no {CONFIG} in {folder}; expected each variant folder to "
                           "hold a complete GenAI package")
    try:
        ep = normalize(body["ep"])
    except ProviderError:
        ep = body["ep"]  # a provider ortevals does not know: chosen only by its exact name
    return Variant(name, ep, body["ep"], body.get("device"), body.get("compatibility_string"), folder)


def _inside(root: Path, relative, name: str, where: Path) -> Path:
    """``root / relative``, refused when absolute or leaving ``root`` (onnxruntime's portable layout)."""
    if not isinstance(relative, str) or not relative or os.path.isabs(relative) or ".." in Path(relative).parts:
        raise PackageError(f"{where}: field {name}={relative!r} must be a relative path inside {root} "
                           "(no absolute path, no '..')")
    return root / relative


def choose(manifest: PackageManifest, ep: str | None) -> Variant:
    """The variant onnxruntime-genai loads for ``ep`` (a user spelling: cpu, CUDAExecutionProvider, ...): the first
    declared for it. ``ep`` None: the package's only provider, else one line asking for one."""
    where = manifest.root / MANIFEST
    if ep is None:
        eps = list(dict.fromkeys(v.ep for v in manifest.variants))
        if len(eps) > 1:
            raise PackageError(f"{where}: variants for {len(eps)} execution providers ({manifest.describe()}); "
                               f"{_give_ep(manifest, '--ep (model_args ep=)')}")
        return manifest.variants[0]
    try:
        wanted = normalize(ep)
    except ProviderError:
        wanted = ep
    for variant in manifest.variants:
        if variant.ep == wanted or variant.ep_name.lower() == PROVIDERS.get(wanted, wanted).lower():
            if variant.ep not in PROVIDERS:
                raise PackageError(f"{where}: variant {variant.name!r} is for {variant.ep_name}, an execution "
                                   f"provider ortevals does not run; {_give_ep(manifest, '--ep')}")
            return variant
    accepted = [v.ep for v in manifest.variants if v.ep in PROVIDERS]
    raise PackageError(f"{where}: no variant for execution provider {ep!r}{did_you_mean(ep, accepted)}; the package "
                       f"has {manifest.describe()}: {_give_ep(manifest, '--ep')}")


def _give_ep(manifest: PackageManifest, flag: str) -> str:
    """Which ``flag`` values open a variant: only those ``--ep`` accepts (a variant for a provider ortevals does not
    know is named as such, never suggested)."""
    accepted = list(dict.fromkeys(v.ep for v in manifest.variants if v.ep in PROVIDERS))
    unknown = list(dict.fromkeys(v.ep_name for v in manifest.variants if v.ep not in PROVIDERS))
    other = (f" ({', '.join(unknown)}: {'an execution provider' if len(unknown) == 1 else 'execution providers'} "
             "ortevals does not run)") if unknown else ""
    if not accepted:
        return f"none of its variants is for an execution provider ortevals runs ({', '.join(PROVIDERS)}){other}"
    return f"give {flag} one of {', '.join(accepted)}{other}"


def package_of(folder: Path) -> tuple[PackageManifest, Variant] | None:
    """The model package whose variant ``folder`` is (its manifest in a parent folder naming it), else None."""
    folder = Path(os.path.abspath(folder))
    for parent in list(folder.parents)[:3]:  # variant folders sit at most a few levels below the root
        if is_model_package(parent):
            try:
                manifest = read_manifest(parent)
            except PackageError:  # a manifest.json of something else above a plain package: not its package
                return None
            found = next((v for v in manifest.variants if Path(os.path.abspath(v.folder)) == folder), None)
            return (manifest, found) if found else None
    return None


def tokenizer_folder(folder: Path, value, manifest: PackageManifest | None, where: Path) -> Path:
    """The folder ``model.tokenizer_dir`` names, as onnxruntime-genai resolves it: unset or empty, the package folder;
    ``sha256:<hex>[/tail]``, the model package's shared asset (only inside a model package); another value, a
    relative path inside the package folder."""
    if value is None or value == "":
        return folder
    if not isinstance(value, str):
        raise PackageError(f"{where}: field model.tokenizer_dir must be a path or a sha256:<hex> URI, got {value!r}")
    match = SHA256.match(value)
    if value.startswith("sha256:") and match is None:
        raise PackageError(f"{where}: model.tokenizer_dir={value!r} is not a sha256:<hex> URI (64 lowercase hex "
                           "digits, then an optional /subfolder)")
    if match is None:
        return _inside(folder, value, "model.tokenizer_dir", where)
    if manifest is None:
        raise PackageError(f"{where}: model.tokenizer_dir={value!r} is a sha256: shared-asset reference, valid only "
                           f"in a model package (a folder with {MANIFEST}); {folder} is not a variant of one")
    uri, tail = f"sha256:{match.group(1)}", (match.group(2) or "").strip("/")
    base = manifest.shared_assets.get(uri)
    asset = (_inside(manifest.root, base, f"shared_assets[{uri!r}]", manifest.root / MANIFEST) if base
             else manifest.root / "shared_assets" / f"sha256-{match.group(1)}")
    path = _inside(asset, tail, "model.tokenizer_dir", where) if tail else asset
    if not path.is_dir():
        raise PackageError(f"{where}: model.tokenizer_dir={value!r} names {path}, which is not a folder; expected the "
                           "shared asset holding the tokenizer files")
    return path


def locate(path: Path, ep: str | None) -> tuple[Path, PackageManifest | None, Variant | None]:
    """The GenAI package folder ``path`` names: a model package's variant for ``ep`` (with its manifest), a variant
    folder given directly (its manifest found above it), or a plain folder (no manifest)."""
    if is_model_package(path):
        manifest = read_manifest(path)
        variant = choose(manifest, ep)
        log.info("model package %s: variant %s (%s%s) for %s", path, variant.name, variant.ep_name,
                 f", {variant.device}" if variant.device else "", f"--ep {ep}" if ep else "its only provider")
        return variant.folder, manifest, variant
    found = package_of(path) if (path / CONFIG).is_file() else None
    return (path, *found) if found else (path, None, None)
