"""What `loraplex-engine run` checks before it imports torch: its flags, the manifest
file (every problem of every document at once), the slots, the model directory, the
datasets (every row of the task's and the eval's read), an environment plug-in's params
and the chat templates (from the model's files; its tokenizer only to render one). A
mistake there is one line in a second or two, not after seconds of imports; only the
target modules need the model's module tree (:func:`with_targets`).
"""

from __future__ import annotations

from pathlib import Path

from loraplex_engine.base_model import TemplateFiles, check_model_dir
from loraplex_engine.local.manifests import Manifest, parse_manifests
from loraplex_engine.local.overrides import manifest_text
from loraplex_engine.plan.admission import Resources, needs_chat_template, resource_problems
from loraplex_engine.plan.experiment import check_step
from loraplex_engine.plan.limits import EngineLimits
from loraplex_engine.settings.commands import RunSettings
from loraplex_engine.spec.errors import InvalidSpecError, ManifestError, UsageError
from loraplex_engine.tenancy.trust import TrustPolicy
from loraplex_engine.tenancy.work_limits import WorkLimits


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
    check_resources(manifests, settings)
    return manifests


def check_resources(manifests: list[Manifest], settings: RunSettings) -> None:
    """The admission's checks of datasets, plug-ins and chat templates
    (plan/admission.py), each problem a line naming its document and field, as the
    manifest's own; the chat template is read only where a manifest renders through it."""
    codec = None
    if any(needs_chat_template(m.spec.task) for m in manifests):
        codec = TemplateFiles(settings.model)
    # Named as the engine names its model: its directory's name (engine_parts.py).
    model, timeout = Path(settings.model).name, settings.engine().plugin_timeout
    res = Resources(trust_of(settings), model, codec, timeout)
    problems = []
    for index, m in enumerate(manifests):  # one manifest per document, in order
        for e in resource_problems(m.spec, m.namespace, res):
            problems.append(problem_line(index, m, e))
    if problems:
        raise ManifestError(settings.manifests, problems)


def problem_line(index: int, m: Manifest, e: InvalidSpecError) -> str:
    """As parse_manifests words a document's problem (one manifest per document)."""
    return f"document {index} ({m.name!r}): {e.field or 'spec'}: {e.message}"


def with_targets(settings: RunSettings) -> list[Manifest]:
    """The manifests checked against the model's LoRA targets too (torch, transformers:
    the module tree is built on the meta device)."""
    from loraplex_engine.base_model import lora_targets_of

    known = lora_targets_of(settings.model)
    text = manifest_text(settings.manifests, settings.only, settings.overrides)
    manifests = parse_manifests(text, settings.manifests, settings.max_rank, known)
    check_step_costs(manifests, settings)
    return manifests


def check_step_costs(manifests: list[Manifest], settings: RunSettings) -> None:
    """Each step's token cost against the engine's limits and the model's context, the
    check the engine's PUT compiles (plan.experiment.check_step): needs the config."""
    from loraplex_engine.base_model import context_tokens_of

    s = settings.engine()
    work = WorkLimits(s.max_prompt_tokens, s.max_step_tokens, context_tokens_of(settings.model))
    limits = EngineLimits(settings.max_rank, None, work)
    problems = []
    for index, m in enumerate(manifests):  # one manifest per document, in order
        try:
            check_step(m.spec, limits)
        except InvalidSpecError as e:
            problems.append(problem_line(index, m, e))
    if problems:
        raise ManifestError(settings.manifests, problems)
