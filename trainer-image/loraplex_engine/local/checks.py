"""What `loraplex-engine run` checks before it imports torch: its flags, the manifest
file (every problem of every document at once), the slots, the model directory and the
datasets. A mistake there is one line in a fraction of a second, not after seconds of
imports; only the target modules need the model's module tree (:func:`with_targets`).
"""

from __future__ import annotations

from pathlib import Path

from loraplex_engine.base_model import check_model_dir
from loraplex_engine.data.sources import resolve_dataset
from loraplex_engine.local.manifests import Manifest, parse_manifests
from loraplex_engine.local.overrides import manifest_text
from loraplex_engine.settings.commands import RunSettings
from loraplex_engine.spec.errors import FieldError, UsageError
from loraplex_engine.spec.experiment import DATA_TASKS
from loraplex_engine.tenancy.trust import TrustPolicy


def trust_of(settings: RunSettings) -> TrustPolicy:
    """The runner's: datasets under --data-root (default: the manifest file's directory)."""
    roots = [Path(d) for d in settings.data_root]
    return TrustPolicy.local(roots or [Path(settings.manifests).resolve().parent])


def check_run(settings: RunSettings) -> list[Manifest]:
    """Every manifest, checked against the flags and the data roots; ``UsageError`` or
    ``ManifestError`` naming the problems. Imports nothing heavy."""
    settings.check()
    default_out = RunSettings.model_fields["out"].default
    if settings.resume and settings.out not in (default_out, settings.resume):
        raise UsageError(f"--resume {settings.resume} and --out {settings.out}: give one")
    source = settings.manifests
    text = manifest_text(source, settings.only, settings.overrides)
    manifests = parse_manifests(text, source, settings.max_rank)
    if len(manifests) > settings.max_adapters:
        raise UsageError(
            f"{source}: {len(manifests)} experiments but the engine has "
            f"{settings.max_adapters} adapter slots (raise --max-adapters)"
        )
    check_model_dir(settings.model)
    trust = trust_of(settings)
    for m in manifests:
        task = m.spec.task
        if task.name in DATA_TASKS and task.dataset:
            try:
                resolve_dataset(trust, task.dataset, task.dataset_options, m.namespace)
            except FieldError as e:
                raise UsageError(f"{source}: {m.name}: {e}") from None
    return manifests


def with_targets(settings: RunSettings) -> list[Manifest]:
    """The manifests checked against the model's LoRA targets too (torch, transformers:
    the module tree is built on the meta device)."""
    from loraplex_engine.base_model import lora_targets_of

    known = lora_targets_of(settings.model)
    text = manifest_text(settings.manifests, settings.only, settings.overrides)
    return parse_manifests(text, settings.manifests, settings.max_rank, known)
