"""The two tenants' Tinker keys and the engine's token limits that the client fair-share
test and its benchmark (bench/client_fair_share.py) both run with."""

from __future__ import annotations

KEY_A = "tml-team-a-0123456789abcdef"
KEY_B = "tml-team-b-0123456789abcdef"
LIMITS = ["--max-prompt-tokens", "64", "--max-step-tokens", "4096"]
