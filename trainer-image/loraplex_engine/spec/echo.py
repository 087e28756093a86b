"""What an error message shows of a tenant's text (a param's name or value, a field
path holding a map key): a bounded prefix, so a megabyte written in a spec never comes
back whole in a 422, a log line or ``status.error``."""

from __future__ import annotations

CLIP_CHARS = 64


def clip(text: str, limit: int = CLIP_CHARS) -> str:
    """``text`` with at most ``limit`` characters of it shown, and how many more there were."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}...({len(text) - limit} more characters)"


__all__ = ["CLIP_CHARS", "clip"]
