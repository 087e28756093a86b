"""``loraplex-engine serve``'s flags (generated from settings.commands.ServeSettings), and
the checks of their values that need more than one flag, a file, or the environment.

The engine pod is configured mostly through the environment (the images and the operator
set ``LORAPLEX_PORT``, ``LORAPLEX_ROLLOUT_BACKEND``, ...), so a bad value there is
reported like a bad flag, naming the variable, and does not break other subcommands.
The token comes from ``--token-file`` or ``LORAPLEX_TOKEN``.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
from pathlib import Path
from typing import Any, Protocol

from loraplex_engine.settings.commands import ServeSettings
from loraplex_engine.settings.generate import add_flags, env_epilog, from_namespace
from loraplex_engine.spec.errors import UsageError
from loraplex_engine.tenancy.object_store import ObjectStore, credentials_from
from loraplex_engine.tenancy.plugin_access import PluginAccess

log = logging.getLogger("loraplex_engine.server.serve")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`serve`'s flags on ``p``, each defaulting to its ``LORAPLEX_*`` variable."""
    add_flags(p, ServeSettings)
    p.epilog = env_epilog(ServeSettings)
    p.formatter_class = argparse.RawDescriptionHelpFormatter  # keep the epilog's rows


def serve_settings(args: argparse.Namespace) -> ServeSettings:
    """`serve`'s parsed flags as its settings (``LORAPLEX_VLLM_OPTIONS`` merged in)."""
    return from_namespace(ServeSettings, args)


def resolve_device(requested: str, world_size: int) -> str:
    """This process's device for a parsed ``--device`` (its rank from ``LOCAL_RANK``)."""
    import torch

    from loraplex_engine.parallel import distributed

    count = torch.cuda.device_count() if requested != "cpu" else 0
    return distributed.device_for_rank(requested, world_size, distributed.local_rank(), count)


class _Trust(Protocol):
    data_root: Any
    allow_reward_host: Any


def data_roots(settings: _Trust) -> tuple[Path, ...]:
    """--data-root (or LORAPLEX_DATA_ROOT, ':'-separated); each must be absolute."""
    roots = tuple(Path(d) for d in settings.data_root or ())
    for root in roots:
        if not root.is_absolute():
            raise UsageError(f"--data-root must be an absolute path, not {str(root)!r}")
    return roots


def object_store(settings: Any, environ: dict[str, str] | None = None) -> ObjectStore:
    """--object-store-* with the credentials of ``LORAPLEX_S3_*``, taken out of the
    environment (os.environ by default) so that no process the engine starts inherits
    them. UsageError for a bad prefix or endpoint."""
    env = os.environ if environ is None else environ
    store = ObjectStore.build(
        settings.object_store_prefix or (),
        settings.object_store_endpoint,
        settings.object_store_region,
        credentials_from(env),  # type: ignore[arg-type]
    )
    if any(p.scheme == "gs" for p in store.prefixes) and not importlib.util.find_spec("gcsfs"):
        log.warning("gs:// prefixes given, but gcsfs is not installed: gs:// datasets will fail")
    return store


def reward_hosts(settings: _Trust) -> list[str]:
    """--allow-reward-host (or LORAPLEX_ALLOW_REWARD_HOST, ','-separated)."""
    return list(settings.allow_reward_host or ())


def plugin_access(settings: Any) -> PluginAccess:
    """--allow-plugins (or LORAPLEX_ALLOW_PLUGINS, ';'-separated): the pool's allowlist."""
    return PluginAccess.from_flags(settings.allow_plugins or ())


def read_token(settings: ServeSettings) -> str | None:
    """The bearer token, or None with --insecure-no-auth. Raises UsageError otherwise."""
    token = None
    if settings.token_file:
        try:
            with open(settings.token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as e:
            raise UsageError(f"cannot read --token-file {settings.token_file}: {e}") from e
        if not token:
            raise UsageError(f"--token-file {settings.token_file} is empty")
    elif os.environ.get("LORAPLEX_TOKEN", "").strip():
        token = os.environ["LORAPLEX_TOKEN"].strip()
    if token is None and not settings.insecure_no_auth:
        raise UsageError(
            "no token: give --token-file FILE or LORAPLEX_TOKEN "
            "(or --insecure-no-auth to serve /v1 without auth)"
        )
    if token is not None and settings.insecure_no_auth:
        log.warning("--insecure-no-auth given together with a token: the token is enforced")
    return token


def read_tinker_keys(settings: ServeSettings) -> Any:
    """The tenants' API keys of ``--tinker-keys`` (a ``tinker.keys.KeyStore``), or None:
    no Tinker protocol. Raises UsageError for a source that cannot be read or parsed."""
    if not settings.tinker_keys:
        return None
    from loraplex_engine.server.tinker.keys import KeyFileError, KeyStore

    try:
        store = KeyStore(settings.tinker_keys)
    except KeyFileError as e:
        raise UsageError(str(e)) from None
    if not len(store):
        log.warning("--tinker-keys %s holds no key yet: /api/v1 refuses all", settings.tinker_keys)
    return store


def check(settings: ServeSettings) -> None:
    """What the flags say that cannot be served, before anything heavy is imported."""
    if not settings.model:
        raise UsageError("--model (or LORAPLEX_MODEL) is required")
    settings.check()
    data_roots(settings)
    plugin_access(settings)
    object_store(settings, environ={})  # the prefixes and endpoint (credentials: at start)
